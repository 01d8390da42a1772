"""Move K/V cache rows between slots after a tree walk: dst_slots[k] <- src_slots[k].

After verification, the accepted path's K/V rows sit at the slots of their tree rows; they
must move to the consecutive slots right after the root. The caller passes one pair per
accepted node (all requests concatenated), for each K and V cache tensor of every layer.

Cache layouts (``cache`` is modified in place):
    paged=False   [num_slots, *row]                  slot s is cache[s]
    paged=True    [num_blocks, block_size, *row]     slot s is cache[s // block_size, s % block_size]
                  (vLLM's GPU layout: slot = block_table[req, pos // bs] * bs + pos % bs)
``row`` (e.g. [num_kv_heads, head_dim]) must be contiguous; the leading dims may have any
strides (so ``kv_cache[0]`` of a [2, num_blocks, block_size, heads, dim] cache works).
Any dtype, fp8 included: rows are copied as raw bits.

    src_slots, dst_slots  [P] integer, same length. Pairs with a negative slot (padding) or
                          with src == dst (already in place) are skipped.

Overlap: in the accepted-path pattern a destination is often a source of an *earlier* pair
(path nodes [1, 2] give pairs (2 -> 1), (3 -> 2): the second write lands on the first read).
Programs of one grid run in no defined order, so the Triton version first gathers every source
row into a scratch buffer and scatters in a second launch; the launch boundary orders all reads
before all writes. That makes any pattern safe as long as the destination slots are distinct.
"""
from __future__ import annotations

import math

import torch

from ._backend import HAVE_TRITON, next_power_of_2, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _check_layout(cache: torch.Tensor, paged: bool) -> int:
    """Number of leading slot dims; raises if the row part is not contiguous."""
    slot_dims = 2 if paged else 1
    if cache.dim() < slot_dims:
        raise ValueError(f"cache of shape {tuple(cache.shape)} has no slot dimension")
    expected = 1
    for size, stride in zip(reversed(cache.shape[slot_dims:]), reversed(cache.stride()[slot_dims:])):
        if size != 1 and stride != expected:
            raise ValueError("the per-slot row of the cache must be contiguous")
        expected *= size
    return slot_dims


def compact_kv_torch(cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor, *,
                     paged: bool = False) -> None:
    _check_layout(cache, paged)
    src = src_slots.to(device=cache.device, dtype=torch.int64)
    dst = dst_slots.to(device=cache.device, dtype=torch.int64)
    keep = (src >= 0) & (dst >= 0) & (src != dst)
    src, dst = src[keep], dst[keep]
    if paged:
        block_size = cache.shape[1]
        rows = cache[src // block_size, src % block_size]  # advanced indexing copies: all reads first
        cache[dst // block_size, dst % block_size] = rows
    else:
        cache[dst] = cache[src]


if HAVE_TRITON:

    @triton.jit
    def _copy_rows_kernel(
        cache_ptr,
        scratch_ptr,  # [P, row_size]
        slots_ptr,  # [P] int64: the source slots when gathering, destinations when scattering
        other_slots_ptr,  # [P] int64: the other side, only to skip padding and no-op pairs
        row_size,
        block_size,  # slots per block (1 when the cache is not paged)
        stride_block,
        stride_offset,
        GATHER: tl.constexpr,  # True: cache -> scratch, False: scratch -> cache
        BLOCK: tl.constexpr,
    ):
        pair = tl.program_id(0)
        chunk = tl.program_id(1)
        slot = tl.load(slots_ptr + pair)
        other = tl.load(other_slots_ptr + pair)
        if (slot >= 0) & (other >= 0) & (slot != other):
            cols = chunk * BLOCK + tl.arange(0, BLOCK)
            in_row = cols < row_size
            slot_base = (slot // block_size) * stride_block + (slot % block_size) * stride_offset
            scratch_row = scratch_ptr + pair.to(tl.int64) * row_size
            if GATHER:
                tl.store(scratch_row + cols, tl.load(cache_ptr + slot_base + cols, mask=in_row), mask=in_row)
            else:
                tl.store(cache_ptr + slot_base + cols, tl.load(scratch_row + cols, mask=in_row), mask=in_row)


def compact_kv_triton(cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor, *,
                      paged: bool = False) -> None:
    slot_dims = _check_layout(cache, paged)
    num_pairs = src_slots.numel()
    if dst_slots.numel() != num_pairs:
        raise ValueError("src_slots and dst_slots differ in length")
    row_size = math.prod(cache.shape[slot_dims:])
    if num_pairs == 0 or row_size == 0:
        return
    bits = cache.view(_BITS_DTYPE[cache.element_size()])
    src = src_slots.to(device=cache.device, dtype=torch.int64)
    dst = dst_slots.to(device=cache.device, dtype=torch.int64)
    scratch = torch.empty(num_pairs, row_size, dtype=bits.dtype, device=cache.device)
    block = min(1024, next_power_of_2(row_size))
    grid = (num_pairs, triton.cdiv(row_size, block))
    if paged:
        block_size, stride_block, stride_offset = cache.shape[1], cache.stride(0), cache.stride(1)
    else:
        block_size, stride_block, stride_offset = 1, cache.stride(0), 0
    geometry = (row_size, block_size, stride_block, stride_offset)
    _copy_rows_kernel[grid](bits, scratch, src, dst, *geometry, GATHER=True, BLOCK=block)
    _copy_rows_kernel[grid](bits, scratch, dst, src, *geometry, GATHER=False, BLOCK=block)


def compact_kv(cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor, *,
               paged: bool = False) -> None:
    """In place: copy cache slot src_slots[k] to slot dst_slots[k] for every k (see module doc)."""
    if use_triton(cache, src_slots, dst_slots):
        compact_kv_triton(cache, src_slots, dst_slots, paged=paged)
    else:
        compact_kv_torch(cache, src_slots, dst_slots, paged=paged)
