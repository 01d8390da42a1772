"""Position ids of tree rows: root = base position, node = base + depth.

Inputs (B requests, N nodes in all):
    depths          [N] int32   node depth, children of the root have depth 1
    offsets         [B+1] int32 request b owns nodes offsets[b]:offsets[b+1]
    base_positions  [B] int64   position of each request's root (its last committed token)

Two entry points, both one launch with no host synchronisation (the grid depends only on
tensor sizes; each program finds its request by binary search over ``offsets``):

``build_tree_positions(depths, offsets, base_positions) -> [N+B] int64``
    Packed row layout: request b's rows are [root_b, node_0, ..., node_{n_b-1}], requests
    back to back, so root_b sits at row offsets[b] + b.

``write_node_positions(positions, depths, offsets, base_positions, root_rows) -> None``
    In place, nodes only: node j of request b is written to positions[root_rows[b] + 1 + j]
    (``root_rows`` [B] is where each root sits, e.g. vLLM's ``query_start_loc[:B]``); the
    root rows and every other entry are left alone. ``positions`` is 1-D, any integer dtype.
"""
from __future__ import annotations

import torch

from ._backend import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl


def _node_requests(offsets: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Request index of every node ([N] int64)."""
    counts = (offsets[1:] - offsets[:-1]).to(torch.int64)
    batch = torch.arange(counts.numel(), device=offsets.device)
    return torch.repeat_interleave(batch, counts, output_size=num_nodes)


def build_tree_positions_torch(depths: torch.Tensor, offsets: torch.Tensor,
                               base_positions: torch.Tensor) -> torch.Tensor:
    batch, num_nodes = offsets.numel() - 1, depths.numel()
    device = depths.device
    positions = torch.empty(num_nodes + batch, dtype=torch.int64, device=device)
    request = _node_requests(offsets, num_nodes)
    base = base_positions.to(torch.int64)
    root_rows = offsets[:-1].to(torch.int64) + torch.arange(batch, device=device)
    positions[root_rows] = base
    node_rows = torch.arange(num_nodes, device=device) + request + 1  # + one root per request so far
    positions[node_rows] = base[request] + depths.to(torch.int64)
    return positions


def write_node_positions_torch(positions: torch.Tensor, depths: torch.Tensor, offsets: torch.Tensor,
                               base_positions: torch.Tensor, root_rows: torch.Tensor) -> None:
    num_nodes = depths.numel()
    device = depths.device
    request = _node_requests(offsets, num_nodes)
    local = torch.arange(num_nodes, device=device) - offsets.to(torch.int64)[request]
    rows = root_rows.to(torch.int64)[request] + 1 + local
    values = base_positions.to(torch.int64)[request] + depths.to(torch.int64)
    positions[rows] = values.to(positions.dtype)


if HAVE_TRITON:

    @triton.jit
    def _tree_positions_kernel(
        depths_ptr,  # [N] int32
        offsets_ptr,  # [B+1] int32
        base_ptr,  # [B] int64
        root_rows_ptr,  # [B] (unused when INCLUDE_ROOTS)
        out_ptr,
        num_items,  # N, or N + B with roots
        batch,
        INCLUDE_ROOTS: tl.constexpr,
        SEARCH_STEPS: tl.constexpr,  # >= ceil(log2(B)) + 1
        BLOCK: tl.constexpr,
    ):
        item = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = item < num_items

        # Largest request b whose first item is <= item. Empty requests share their start with
        # the next one; taking the largest skips them (they own no node; with roots included
        # the starts are strictly increasing).
        lo = tl.zeros([BLOCK], dtype=tl.int32)
        hi = tl.zeros([BLOCK], dtype=tl.int32) + (batch - 1)
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi + 1) // 2
            start = tl.load(offsets_ptr + mid, mask=valid, other=0)
            if INCLUDE_ROOTS:
                start += mid
            go_up = start <= item
            lo = tl.where(go_up, mid, lo)
            hi = tl.where(go_up, hi, mid - 1)
        req = lo

        node_start = tl.load(offsets_ptr + req, mask=valid, other=0)
        base = tl.load(base_ptr + req, mask=valid, other=0).to(tl.int64)
        if INCLUDE_ROOTS:
            local = item - node_start - req  # 0 = root, j + 1 = node j
            is_node = valid & (local > 0)
            depth = tl.load(depths_ptr + node_start + local - 1, mask=is_node, other=0)
            tl.store(out_ptr + item, base + depth.to(tl.int64), mask=valid)
        else:
            local = item - node_start  # node j
            depth = tl.load(depths_ptr + item, mask=valid, other=0)
            root_row = tl.load(root_rows_ptr + req, mask=valid, other=0).to(tl.int64)
            dest = out_ptr + root_row + 1 + local
            tl.store(dest, (base + depth.to(tl.int64)).to(out_ptr.dtype.element_ty), mask=valid)


_BLOCK = 256


def _launch(out: torch.Tensor, depths: torch.Tensor, offsets: torch.Tensor, base_positions: torch.Tensor,
            root_rows: torch.Tensor | None) -> None:
    batch = offsets.numel() - 1
    num_items = depths.numel() + (batch if root_rows is None else 0)
    if batch <= 0 or num_items == 0:
        return
    _tree_positions_kernel[(triton.cdiv(num_items, _BLOCK),)](
        depths.to(torch.int32), offsets.to(torch.int32), base_positions.to(torch.int64),
        root_rows if root_rows is not None else offsets, out, num_items, batch,
        INCLUDE_ROOTS=root_rows is None, SEARCH_STEPS=max(1, int(batch).bit_length()), BLOCK=_BLOCK,
    )


def build_tree_positions_triton(depths: torch.Tensor, offsets: torch.Tensor,
                                base_positions: torch.Tensor) -> torch.Tensor:
    positions = torch.empty(depths.numel() + offsets.numel() - 1, dtype=torch.int64, device=depths.device)
    _launch(positions, depths, offsets, base_positions, None)
    return positions


def write_node_positions_triton(positions: torch.Tensor, depths: torch.Tensor, offsets: torch.Tensor,
                                base_positions: torch.Tensor, root_rows: torch.Tensor) -> None:
    if positions.dim() != 1 or positions.stride(0) != 1:
        raise ValueError("positions must be a contiguous 1-D tensor")
    _launch(positions, depths, offsets, base_positions, root_rows.to(torch.int64))


def build_tree_positions(depths: torch.Tensor, offsets: torch.Tensor, base_positions: torch.Tensor) -> torch.Tensor:
    """[N+B] int64 positions in the packed row layout [root_b, nodes_b...] (see module doc)."""
    if use_triton(depths, offsets, base_positions):
        return build_tree_positions_triton(depths, offsets, base_positions)
    return build_tree_positions_torch(depths, offsets, base_positions)


def write_node_positions(positions: torch.Tensor, depths: torch.Tensor, offsets: torch.Tensor,
                         base_positions: torch.Tensor, root_rows: torch.Tensor) -> None:
    """positions[root_rows[b] + 1 + j] = base_positions[b] + depth of node j of request b."""
    if use_triton(positions, depths, offsets, base_positions, root_rows):
        write_node_positions_triton(positions, depths, offsets, base_positions, root_rows)
    else:
        write_node_positions_torch(positions, depths, offsets, base_positions, root_rows)
