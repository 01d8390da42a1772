"""One engine step's trees, as the runner patch, the attention backend and the verifier see
them. Plain dataclasses of tensors, built once per step in ``_prepare_inputs``.

Row layout inside vLLM's flattened batch: a decoding request b with a tree owns the rows
``row_start[b] .. row_start[b] + n_b``: its root (the last committed token, the ordinary
decode row) then its n_b tree nodes in the tree's parents-first order. vLLM computed the KV
slots of those rows sequentially (node j -> slot of position c_b + 1 + j); the patch only
rewrites their RoPE positions to c_b + depth_j, so accepted nodes are later copied to the
slots of their final positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_ptd.tree import FlatTree, TreeBatch


@dataclass
class TreeRows:
    """Attention work of one step: rows that need the tree mask instead of causal."""

    batch_indices: list[int]  # per entry: the request's index in the input batch
    req_rows: list[tuple[int, int, int]]  # per entry: (first tree row, rows, seq_len)
    masks: list[torch.Tensor]  # per tree request: [rows, seq_len] bool, True = may attend


@dataclass
class TreeStep:
    req_ids: list[str]            # requests with a tree this step, in batch order
    batch_indices: list[int]      # their index in the input batch
    row_start: torch.Tensor       # [T] their root row in the flattened batch
    context: torch.Tensor         # [T] position of their root (= computed tokens)
    trees: list[FlatTree]         # the trees as scheduled (maybe cut short)
    batch: TreeBatch              # the same, packed
    rows: TreeRows                # what the attention backend recomputes
    # filled by the attention backend during the forward: layer -> (impl, layer, key,
    # value, kv_cache, slot_mapping), so accepted rows can be re-written to new slots
    kv_stash: dict = field(default_factory=dict)


_active: TreeStep | None = None


def set_active_step(step: TreeStep | None) -> None:
    global _active
    _active = step


def active_step() -> TreeStep | None:
    return _active


def build_tree_rows(trees: list[FlatTree], batch_indices: list[int], row_start: list[int],
                    context: list[int]) -> TreeRows:
    """Which rows the attention backend recomputes and their masks over the request's keys
    (keys 0..c are the committed prefix and the root; key c+1+j is node j)."""
    idx, req_rows, masks = [], [], []
    for tree, b, r0, c in zip(trees, batch_indices, row_start, context):
        m = tree.causal_from  # nodes from causal_from on are plain causal rows
        if m == 0:
            continue
        seq_len = c + 1 + tree.num_nodes
        anc = tree.ancestor_mask()  # [n+1, n+1], row/col 0 = root
        mask = torch.zeros(m, seq_len, dtype=torch.bool)
        mask[:, : c + 1] = True
        mask[:, c + 1:] = anc[1: m + 1, 1:]
        idx.append(b)
        req_rows.append((r0 + 1, m, seq_len))
        masks.append(mask)
    return TreeRows(idx, req_rows, masks)
