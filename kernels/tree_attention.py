"""Tree attention over a paged KV cache: each tree row sees the committed prefix and the tree
rows its mask allows. This is the kernel the GPU attention backend calls for tree requests.

Shapes (B tree requests, R query rows in all, n_b nodes in request b):
    query        [R, num_q_heads, head_dim]       request b's rows are query_starts[b] + r,
                                                  r = 0 (root), 1..n_b (node r-1)
    key_cache    [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
                 vLLM's Triton/FlashAttention backend layout: the per-layer cache
                 [num_blocks, 2, block_size, num_kv_heads, head_dim] unbound along dim 1.
                 Any strides are accepted (the two halves of that tensor are not contiguous).
    block_table  [B, max_blocks] int32            request b's sequence index i lives in block
                                                  block_table[b, i // block_size], offset i % block_size
    context_lens [B] int                          ctx_b: committed tokens *before* the root
    query_starts [B] int                          row of ``query`` holding request b's root
    node_offsets [B+1] int                        TreeBatch.offsets (n_b = difference)
    tree_mask    TreeMask                         from ``build_tree_mask`` (flat bool + offsets)
    scale        float                            softmax scale, usually head_dim ** -0.5
    out          [R, num_q_heads, head_dim]       optional; only the tree rows are written, so
                                                  the backend can pass its own output buffer.
                                                  Allocated as zeros when omitted.
    rows_from    [B] int32, optional              only request b's rows r with
    rows_to      [B] int32, optional              rows_from[b] <= r < rows_to[b] are written
                                                  (default: all n_b + 1). Why: rows whose mask
                                                  is the causal one (the root, a leading
                                                  chain, a causal tail) were computed exactly
                                                  by the engine's own kernel; rewriting them
                                                  would only change their rounding.

The cache must already hold this step's K/V: tree row r of request b at sequence index
ctx_b + r (vLLM writes the step's K/V before attention). Row r attends to every index
< ctx_b and to index ctx_b + c where tree_mask[b][r, c] is set.

num_q_heads must be a multiple of num_kv_heads (GQA/MQA); q heads h*G .. h*G+G-1 use kv head h.
dtypes: fp32, fp16 or bf16 (query and caches alike); softmax and accumulation are fp32.
"""
from __future__ import annotations

import math

import torch

from ._backend import HAVE_TRITON, INTERPRETED, host_list, next_power_of_2, use_triton
from .tree_mask import TreeMask

if HAVE_TRITON:
    import triton
    import triton.language as tl


def _check_shapes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    """Query heads per KV head."""
    if query.dim() != 3 or key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError("expected query [R, Hq, D] and caches [num_blocks, block_size, Hkv, D]")
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"query heads {num_q_heads} x {head_dim} do not fit cache heads "
                         f"{num_kv_heads} x {key_cache.shape[3]}")
    return num_q_heads // num_kv_heads


def tree_attention_torch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_table: torch.Tensor, context_lens: torch.Tensor, query_starts: torch.Tensor,
                         node_offsets: torch.Tensor, tree_mask: TreeMask, scale: float, *,
                         out: torch.Tensor | None = None, max_rows: int | None = None,
                         rows_from: torch.Tensor | None = None,
                         rows_to: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin: per request, gather K/V through the block table and run a masked softmax."""
    group = _check_shapes(query, key_cache, value_cache)
    if out is None:
        out = torch.zeros_like(query)
    block_size = key_cache.shape[1]
    nodes = host_list(node_offsets)
    contexts = host_list(context_lens)
    starts = host_list(query_starts)
    lows = host_list(rows_from) if rows_from is not None else [0] * len(contexts)
    highs = host_list(rows_to) if rows_to is not None else [1 << 30] * len(contexts)
    for b, ctx in enumerate(contexts):
        num_rows = nodes[b + 1] - nodes[b] + 1
        lo, hi = lows[b], min(highs[b], num_rows)
        if lo >= hi:
            continue
        seq = torch.arange(ctx + num_rows, device=key_cache.device)
        blocks = block_table[b].to(torch.int64)[seq // block_size]
        keys = key_cache[blocks, seq % block_size].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = value_cache[blocks, seq % block_size].float().repeat_interleave(group, dim=1)
        rows = query[starts[b]:starts[b] + num_rows].float()  # [n+1, Hq, D]
        visible = torch.cat([torch.ones(num_rows, ctx, dtype=torch.bool, device=query.device),
                             tree_mask.request(b).to(query.device)], dim=1)
        scores = torch.einsum("qhd,khd->hqk", rows, keys) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[starts[b] + lo:starts[b] + hi] = torch.einsum("hqk,khd->qhd", probs[:, lo:hi],
                                                          values).to(out.dtype)
    return out


if HAVE_TRITON:

    @triton.jit
    def _online_softmax_step(acc, row_max, row_sum, scores, values, DOT_FP32: tl.constexpr):
        """Fold one key tile into the running (max, sum, weighted values); scores in log2 units."""
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        correction = tl.exp2(row_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * correction + tl.sum(probs, 1)
        if DOT_FP32:
            update = tl.dot(probs, values.to(tl.float32), input_precision="ieee")
        else:
            update = tl.dot(probs.to(values.dtype), values)
        return acc * correction[:, None] + update, new_max, row_sum

    @triton.jit
    def _tree_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr,
        block_table_ptr, context_lens_ptr, query_starts_ptr, node_offsets_ptr, mask_ptr, mask_offsets_ptr,
        rows_from_ptr, rows_to_ptr,
        scale_log2,
        stride_q_row, stride_q_head, stride_q_dim,
        stride_k_block, stride_k_slot, stride_k_head, stride_k_dim,
        stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
        stride_o_row, stride_o_head, stride_o_dim,
        stride_table,
        block_size,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        GROUP: tl.constexpr,  # q heads per kv head
        GROUP_PAD: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,  # tree rows per program; the tile holds BLOCK_ROWS * GROUP_PAD q rows
        BLOCK_KEYS: tl.constexpr,
        DOT_FP32: tl.constexpr,  # products in full fp32 (fp32 inputs; bf16 under the interpreter)
    ):
        req = tl.program_id(0)
        first_row = tl.program_id(1) * BLOCK_ROWS
        kv_head = tl.program_id(2)

        node_start = tl.load(node_offsets_ptr + req)
        num_rows = tl.load(node_offsets_ptr + req + 1) - node_start + 1
        # the rows this request has written (the others are the engine kernel's, exact)
        rows_lo = tl.load(rows_from_ptr + req)
        rows_hi = tl.minimum(tl.load(rows_to_ptr + req), num_rows)
        if (rows_lo < rows_hi) & (first_row < rows_hi) & (first_row + BLOCK_ROWS > rows_lo):
            ctx = tl.load(context_lens_ptr + req)
            query_start = tl.load(query_starts_ptr + req)

            # All query heads that share this kv head go in one tile, so each K/V tile is
            # loaded once for the whole group.
            TILE: tl.constexpr = BLOCK_ROWS * GROUP_PAD
            tile = tl.arange(0, TILE)
            row = first_row + tile // GROUP_PAD
            head = kv_head * GROUP + tile % GROUP_PAD
            tile_ok = (row < num_rows) & (tile % GROUP_PAD < GROUP)
            dim = tl.arange(0, HEAD_DIM_PAD)
            dim_ok = dim < HEAD_DIM

            q_rows = (query_start + row).to(tl.int64)
            q = tl.load(q_ptr + q_rows[:, None] * stride_q_row + head[:, None] * stride_q_head
                        + dim[None, :] * stride_q_dim, mask=tile_ok[:, None] & dim_ok[None, :], other=0.0)

            # A finite start keeps fully masked (padding) rows free of inf - inf.
            row_max = tl.full([TILE], -1.0e30, dtype=tl.float32)
            row_sum = tl.zeros([TILE], dtype=tl.float32)
            acc = tl.zeros([TILE, HEAD_DIM_PAD], dtype=tl.float32)
            table_row = block_table_ptr + req.to(tl.int64) * stride_table
            k_head = k_ptr + kv_head * stride_k_head
            v_head = v_ptr + kv_head * stride_v_head

            # Committed prefix: visible to every tree row.
            for key_start in range(0, ctx, BLOCK_KEYS):
                key = key_start + tl.arange(0, BLOCK_KEYS)
                key_ok = key < ctx
                block = tl.load(table_row + key // block_size, mask=key_ok, other=0).to(tl.int64)
                slot = key % block_size
                k = tl.load(k_head + block[None, :] * stride_k_block + slot[None, :] * stride_k_slot
                            + dim[:, None] * stride_k_dim, mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
                v = tl.load(v_head + block[:, None] * stride_v_block + slot[:, None] * stride_v_slot
                            + dim[None, :] * stride_v_dim, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
                if DOT_FP32:
                    scores = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
                else:
                    scores = tl.dot(q, k)
                scores = tl.where(key_ok[None, :], scores * scale_log2, float("-inf"))
                acc, row_max, row_sum = _online_softmax_step(acc, row_max, row_sum, scores, v, DOT_FP32)

            # Tree rows: a row's ancestors and causal predecessors all come before it, so no
            # key past this program's last row can be visible.
            mask_base = mask_ptr + tl.load(mask_offsets_ptr + req)
            tree_end = tl.minimum(num_rows, first_row + BLOCK_ROWS)
            for col_start in range(0, tree_end, BLOCK_KEYS):
                col = col_start + tl.arange(0, BLOCK_KEYS)
                col_ok = col < tree_end
                key = ctx + col
                block = tl.load(table_row + key // block_size, mask=col_ok, other=0).to(tl.int64)
                slot = key % block_size
                k = tl.load(k_head + block[None, :] * stride_k_block + slot[None, :] * stride_k_slot
                            + dim[:, None] * stride_k_dim, mask=col_ok[None, :] & dim_ok[:, None], other=0.0)
                v = tl.load(v_head + block[:, None] * stride_v_block + slot[:, None] * stride_v_slot
                            + dim[None, :] * stride_v_dim, mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
                visible = tl.load(mask_base + row[:, None] * num_rows + col[None, :],
                                  mask=tile_ok[:, None] & col_ok[None, :], other=0) != 0
                if DOT_FP32:
                    scores = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
                else:
                    scores = tl.dot(q, k)
                scores = tl.where(visible, scores * scale_log2, float("-inf"))
                acc, row_max, row_sum = _online_softmax_step(acc, row_max, row_sum, scores, v, DOT_FP32)

            result = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
            written = tile_ok & (row >= rows_lo) & (row < rows_hi)
            tl.store(out_ptr + q_rows[:, None] * stride_o_row + head[:, None] * stride_o_head
                     + dim[None, :] * stride_o_dim, result.to(out_ptr.dtype.element_ty),
                     mask=written[:, None] & dim_ok[None, :])


def tree_attention_triton(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_table: torch.Tensor, context_lens: torch.Tensor, query_starts: torch.Tensor,
                          node_offsets: torch.Tensor, tree_mask: TreeMask, scale: float, *,
                          out: torch.Tensor | None = None, max_rows: int | None = None,
                          rows_from: torch.Tensor | None = None,
                          rows_to: torch.Tensor | None = None) -> torch.Tensor:
    """One launch, grid (B, row blocks of the widest tree, num_kv_heads)."""
    group = _check_shapes(query, key_cache, value_cache)
    if out is None:
        out = torch.zeros_like(query)
    batch = node_offsets.numel() - 1
    if batch <= 0:
        return out
    if rows_from is None:
        rows_from = torch.zeros(batch, dtype=torch.int32, device=query.device)
    if rows_to is None:
        rows_to = torch.full((batch,), 1 << 30, dtype=torch.int32, device=query.device)
    if max_rows is None:
        nodes = host_list(node_offsets)
        max_rows = max(e - s for s, e in zip(nodes[:-1], nodes[1:])) + 1
    head_dim = query.shape[2]
    head_dim_pad = max(16, next_power_of_2(head_dim))
    group_pad = next_power_of_2(group)
    # Tile of 16..64 query rows (tl.dot needs at least 16), no wider than the widest tree needs.
    block_rows = max(max(1, 16 // group_pad), min(max(1, 64 // group_pad), next_power_of_2(max_rows)))
    # Narrower key tiles where K and V tiles get large (fp32, or wide heads) to bound shared memory.
    block_keys = 64 if head_dim_pad * query.element_size() <= 256 else 32
    # fp32 inputs get true fp32 products (not TF32) to match the twin. Triton's CPU interpreter
    # mis-multiplies bf16 tiles in tl.dot (seen with triton 3.9), so there bf16 goes through fp32.
    dot_fp32 = query.dtype == torch.float32 or (INTERPRETED and query.dtype == torch.bfloat16)
    grid = (batch, triton.cdiv(max_rows, block_rows), key_cache.shape[2])
    _tree_attention_kernel[grid](
        query, key_cache, value_cache, out,
        block_table, context_lens, query_starts, node_offsets,
        tree_mask.mask.view(torch.uint8), tree_mask.offsets, rows_from, rows_to,
        scale * math.log2(math.e),
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(),
        block_table.stride(0), key_cache.shape[1],
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_ROWS=block_rows, BLOCK_KEYS=block_keys, DOT_FP32=dot_fp32,
        num_warps=4,
    )
    return out


def tree_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_table: torch.Tensor, context_lens: torch.Tensor, query_starts: torch.Tensor,
                   node_offsets: torch.Tensor, tree_mask: TreeMask, scale: float, *,
                   out: torch.Tensor | None = None, max_rows: int | None = None,
                   rows_from: torch.Tensor | None = None,
                   rows_to: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every tree row over prefix + visible tree rows (see module doc); with
    ``rows_from``/``rows_to``, of request b's rows in ``[rows_from[b], rows_to[b])`` only.

    ``max_rows`` (largest n_b + 1) sizes the Triton grid; when omitted it is read from
    ``node_offsets`` on the host (one sync on GPU)."""
    args = (query, key_cache, value_cache, block_table, context_lens, query_starts, node_offsets, tree_mask, scale)
    bounds = dict(out=out, max_rows=max_rows, rows_from=rows_from, rows_to=rows_to)
    if use_triton(query, key_cache, value_cache, block_table, context_lens, query_starts, node_offsets):
        return tree_attention_triton(*args, **bounds)
    return tree_attention_torch(*args, **bounds)
