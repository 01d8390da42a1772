"""Tree attention mask among each request's tree rows, for a whole batch in one launch.

Inputs (the tensors of a ``vllm_ptd.tree.TreeBatch``; B requests, N nodes in all):
    parents      [N] int32   local parent index per node, -1 = the root
    offsets      [B+1] int32 request b owns nodes offsets[b]:offsets[b+1] (n_b of them)
    causal_from  [B] int32   nodes with local index >= causal_from[b] see every earlier row;
                             a value < 0 means "no causal tail" (as in FlatTree)

Output format (``TreeMask``):
    mask     [sum_b (n_b+1)^2] bool, flat. Request b's block starts at offsets[b] below and is
             a row-major (n_b+1) x (n_b+1) matrix: row r may attend to column c.
             Row/column 0 is the root (the last committed token), row/column i+1 is node i.
    offsets  [B+1] int64 start of each request's block; ``TreeMask.request(b)`` returns the
             (n_b+1, n_b+1) view.

Row r of a tree node sees the root, its ancestors and itself; causal-tail nodes see all rows
0..r; the root row sees only itself. This equals ``FlatTree.ancestor_mask()`` per request.

A flat bool matrix (one byte per entry) was chosen over bitmask words because the attention
kernel loads it as a plain 2-D tile with no bit unpacking, and trees are small (a 128-node
tree takes 16.6 kB).

Precondition: parents[i] < i inside each request (parents come first), which FlatTree checks;
the kernel walks parent pointers and relies on it to terminate.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ._backend import HAVE_TRITON, host_list, next_power_of_2, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl


class TreeMask(NamedTuple):
    mask: torch.Tensor  # [sum (n_b+1)^2] bool
    offsets: torch.Tensor  # [B+1] int64

    def request(self, b: int) -> torch.Tensor:
        """Request b's (n_b+1, n_b+1) mask as a view into the flat tensor."""
        start, end = int(self.offsets[b]), int(self.offsets[b + 1])
        side = int(round((end - start) ** 0.5))
        return self.mask[start:end].view(side, side)


def _mask_layout(offsets: torch.Tensor) -> tuple[list[int], torch.Tensor, int, int]:
    """Node counts, mask block offsets (on offsets' device), total entries, widest row."""
    node_offsets = host_list(offsets)
    counts = [e - s for s, e in zip(node_offsets[:-1], node_offsets[1:])]
    mask_offsets = [0]
    for n in counts:
        mask_offsets.append(mask_offsets[-1] + (n + 1) ** 2)
    max_rows = max(counts, default=0) + 1
    return counts, torch.tensor(mask_offsets, dtype=torch.int64, device=offsets.device), mask_offsets[-1], max_rows


def build_tree_mask_torch(parents: torch.Tensor, offsets: torch.Tensor, causal_from: torch.Tensor) -> TreeMask:
    """Torch twin of the Triton kernel: vectorised over all nodes of the batch."""
    device = parents.device
    counts, mask_offsets, total, _ = _mask_layout(offsets)
    mask = torch.zeros(total, dtype=torch.bool, device=device)
    batch = len(counts)
    if batch == 0:
        return TreeMask(mask, mask_offsets)
    mask[mask_offsets[:-1]] = True  # every root row sees the root
    num_nodes = int(parents.numel())
    if num_nodes == 0:
        return TreeMask(mask, mask_offsets)

    count_t = torch.tensor(counts, dtype=torch.int64, device=device)
    request = torch.repeat_interleave(torch.arange(batch, device=device), count_t)
    node_start = offsets.to(torch.int64)[request]
    local = torch.arange(num_nodes, device=device) - node_start
    side = count_t[request] + 1
    row_base = mask_offsets[request] + (local + 1) * side  # flat index of (row = node, col 0)

    mask[row_base] = True  # the root column
    mask[row_base + local + 1] = True  # the node itself
    # Walk every node's ancestor chain in lock step; chains are at most max depth long.
    cursor = parents.to(torch.int64).clone()
    active = cursor >= 0
    while bool(active.any()):
        idx = active.nonzero().squeeze(1)
        mask[row_base[idx] + cursor[idx] + 1] = True
        cursor[idx] = parents.to(torch.int64)[node_start[idx] + cursor[idx]]
        active = cursor >= 0

    cf = causal_from.to(torch.int64)[request]
    causal = (cf >= 0) & (local >= cf)
    if bool(causal.any()):
        # Causal row r = local+1 sees columns 0..r: r+1 entries starting at row_base.
        bases = row_base[causal]
        lengths = local[causal] + 2
        starts = torch.repeat_interleave(bases, lengths)
        run_start = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        mask[starts + torch.arange(int(lengths.sum()), device=device) - run_start] = True
    return TreeMask(mask, mask_offsets)


if HAVE_TRITON:

    @triton.jit
    def _tree_mask_kernel(
        parents_ptr,  # [N] int32
        offsets_ptr,  # [B+1] int32
        causal_from_ptr,  # [B] int32
        mask_offsets_ptr,  # [B+1] int64
        mask_ptr,  # [total] uint8 (the bool output viewed as bytes)
        BLOCK_COLS: tl.constexpr,
    ):
        row = tl.program_id(0)  # r: 0 = root, i+1 = node i
        req = tl.program_id(1)
        node_start = tl.load(offsets_ptr + req)
        num_nodes = tl.load(offsets_ptr + req + 1) - node_start
        if row <= num_nodes:
            causal_from = tl.load(causal_from_ptr + req)
            node = row - 1
            cols = tl.arange(0, BLOCK_COLS)
            is_causal = (causal_from >= 0) & (node >= causal_from)

            # The row lives in registers and is stored once: separate stores of zeros and
            # ones to the same bytes from different threads would have no defined order.
            visible = cols == 0
            cursor = tl.where(is_causal, -1, node)  # the root row has node == -1: no walk
            while cursor >= 0:
                visible = visible | (cols == cursor + 1)
                cursor = tl.load(parents_ptr + node_start + cursor)
            visible = tl.where(is_causal, cols <= row, visible)

            side = num_nodes + 1
            row_ptr = mask_ptr + tl.load(mask_offsets_ptr + req) + row.to(tl.int64) * side
            tl.store(row_ptr + cols, visible.to(tl.uint8), mask=cols < side)


def build_tree_mask_triton(parents: torch.Tensor, offsets: torch.Tensor, causal_from: torch.Tensor) -> TreeMask:
    """One launch: grid (widest request's rows, B), one program per (row, request)."""
    counts, mask_offsets, total, max_rows = _mask_layout(offsets)
    mask = torch.empty(total, dtype=torch.bool, device=parents.device)
    if not counts:
        return TreeMask(mask, mask_offsets)
    _tree_mask_kernel[(max_rows, len(counts))](
        parents.to(torch.int32), offsets.to(torch.int32), causal_from.to(torch.int32),
        mask_offsets, mask.view(torch.uint8),
        BLOCK_COLS=max(16, next_power_of_2(max_rows)),
    )
    return TreeMask(mask, mask_offsets)


def build_tree_mask(parents: torch.Tensor, offsets: torch.Tensor, causal_from: torch.Tensor) -> TreeMask:
    """Ancestor-only attention mask for every request of a packed tree batch (see module doc).

    Reads ``offsets`` on the host once (output size and grid depend on it)."""
    if use_triton(parents, offsets, causal_from):
        return build_tree_mask_triton(parents, offsets, causal_from)
    return build_tree_mask_torch(parents, offsets, causal_from)
