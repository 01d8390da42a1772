"""One engine step's trees, as the runner patch, the attention backends and the verifier see
them. Plain dataclasses of tensors, built once per step in ``_prepare_inputs``.

Row layout inside vLLM's flattened batch: a decoding request with a tree owns the rows
``row_start .. row_start + n``: its root (the last committed token, the ordinary decode row)
then its n tree nodes in the tree's parents-first order. vLLM computed the KV slots of those
rows sequentially (node j -> slot of position c + 1 + j); the patch only rewrites their RoPE
positions to c + depth_j, and accepted nodes are later copied to the slots of their final
positions.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch

from vllm_ptd.kernels import TreeMask, build_tree_mask, write_node_positions
from vllm_ptd.tree import FlatTree, TreeBatch


class DeviceTensors(NamedTuple):
    batch_indices: torch.Tensor
    context: torch.Tensor
    row_start: torch.Tensor
    node_offsets: torch.Tensor
    mask: TreeMask
    verify_rows: torch.Tensor
    rows_from: torch.Tensor  # [T] int32, each tree's rows the tree kernel rewrites: from
    rows_to: torch.Tensor    # [T] int32, ... to (``TreeStep.masked_rows``)


@dataclass
class TreeStep:
    req_ids: list[str]            # requests with a tree this step, in batch order
    batch_indices: list[int]      # their index in the input batch
    row_start: torch.Tensor       # [T] int64, their root row in the flattened batch
    context: torch.Tensor         # [T] int64, position of their root (= computed tokens)
    trees: list[FlatTree]         # the trees as scheduled (maybe cut short)
    batch: TreeBatch              # the same, packed
    verify_rows: torch.Tensor     # [V] int64, batch rows of every verify node, request order
    verify_offsets: list[int]     # [T + 1], request i's verify rows are [o_i, o_{i+1})
    # filled by the attention backends during the forward (kv_stash.TreeKVStashMixin):
    # layer -> StashedKV, so accepted rows can be re-written to their final slots
    kv_stash: dict = field(default_factory=dict)
    proposed_nodes: list[int] = field(default_factory=list)  # per request, before any cut
    # the CPU backend's path requests (cpu_attention.PathRequests) per attention metadata,
    # made by the first layer of each KV-cache group and shared by the rest; False: no row
    # of the step needs them
    cpu_paths: dict = field(default_factory=dict)
    _mask: TreeMask | None = None
    _on_device: dict = field(default_factory=dict)
    _verify_rows_on: dict = field(default_factory=dict)

    @property
    def mask(self) -> TreeMask:
        """Ancestor masks of all trees (root row/col 0), built on first use: the GPU backend
        reads them, the CPU backend's path requests need none."""
        if self._mask is None:
            self._mask = build_tree_mask(self.batch.parents, self.batch.offsets,
                                         self.batch.causal_from)
        return self._mask

    @property
    def num_verify_rows(self) -> int:
        return self.verify_offsets[-1]

    def verify_rows_on(self, device) -> torch.Tensor:
        """The verify rows on ``device`` (the K/V stash's index, asked by every layer), moved
        once per step. Not through ``on_device``: that builds the tree masks, which only the
        GPU backend reads (building them took about 0.3 ms a step of 4 trees of 12 nodes
        here, on every tree step of a CPU engine, for nothing)."""
        key = str(device)
        rows = self._verify_rows_on.get(key)
        if rows is None:
            rows = self._verify_rows_on[key] = self.verify_rows.to(device)
        return rows

    @property
    def max_rows(self) -> int:
        return max(t.num_nodes for t in self.trees) + 1

    @cached_property
    def masked_rows(self) -> list[tuple[int, int]]:
        """Per tree, the rows (0: the root) whose mask is not the causal one: from the first
        branch to ``causal_from``. The root, a leading chain and a causal tail are computed
        exactly by the engine's own causal attention (the CPU backend recomputes the rows
        between, the GPU tree kernel rewrites them); an empty range needs neither."""
        return [(1 + chain_prefix(t), 1 + t.causal_from) for t in self.trees]

    @cached_property
    def has_masked_rows(self) -> bool:
        """Whether any tree has such rows (asked by every attention layer)."""
        return any(lo < hi for lo, hi in self.masked_rows)

    def on_device(self, device) -> "DeviceTensors":
        """The step's index tensors and masks on ``device``, moved once per step and shared
        by every attention layer."""
        key = str(device)
        if key not in self._on_device:
            lo, hi = zip(*self.masked_rows)
            self._on_device[key] = DeviceTensors(
                batch_indices=torch.tensor(self.batch_indices, dtype=torch.int64, device=device),
                context=self.context.to(device), row_start=self.row_start.to(device),
                node_offsets=self.batch.offsets.to(device),
                mask=TreeMask(self.mask.mask.to(device), self.mask.offsets.to(device)),
                verify_rows=self.verify_rows_on(device),
                rows_from=torch.tensor(lo, dtype=torch.int32, device=device),
                rows_to=torch.tensor(hi, dtype=torch.int32, device=device))
        return self._on_device[key]


def chain_prefix(tree: FlatTree) -> int:
    """How many leading nodes form a chain under the root (node i's parent is node i - 1):
    their ancestor mask is the causal mask, so causal attention computes them exactly."""
    for i, p in enumerate(tree.parents):
        if p != i - 1:
            return i
    return tree.num_nodes


def build_step(req_ids: list[str], batch_indices: list[int], trees: list[FlatTree],
               row_start: list[int], context: list[int], positions: torch.Tensor) -> TreeStep:
    """Pack the step's trees and write the node rows' positions (root position + depth)
    into the runner's ``positions`` buffer in place."""
    batch = TreeBatch.from_trees(trees)
    starts = torch.tensor(row_start, dtype=torch.int64)
    ctx = torch.tensor(context, dtype=torch.int64)
    dev = positions.device
    write_node_positions(positions, batch.depths.to(dev), batch.offsets.to(dev), ctx.to(dev),
                         starts.to(dev))
    verify_offsets = [0]
    for t in trees:
        verify_offsets.append(verify_offsets[-1] + t.num_verify)
    verify_rows = torch.cat([torch.arange(r + 1, r + 1 + t.num_verify)
                             for r, t in zip(row_start, trees)])
    return TreeStep(req_ids=req_ids, batch_indices=batch_indices, row_start=starts, context=ctx,
                    trees=trees, batch=batch, verify_rows=verify_rows,
                    verify_offsets=verify_offsets)


class StepChannel:
    """How one engine step's :class:`TreeStep` reaches the attention backends.

    Owned by the runner's ``TreeProposer`` and handed to every tree attention impl when the
    model is loaded (``bind_tree_attention``), so no module global carries it. The step is
    opened by ``prepare_step`` (end of ``_prepare_inputs``), read by the backends during the
    forward and by ``verify``, and closed by ``verify`` (in ``_sample``); ``guard`` wraps
    ``execute_model`` and closes it if the step fails, so a stale step never reaches the
    next forward."""

    def __init__(self) -> None:
        self._step: TreeStep | None = None
        self.clock = None  # the proposer's StepClock (backends add their time to it)

    @property
    def step(self) -> TreeStep | None:
        return self._step

    def open(self, step: TreeStep | None) -> None:
        self._step = step

    def close(self) -> None:
        self._step = None

    @contextlib.contextmanager
    def guard(self):
        try:
            yield
        except BaseException:
            self._step = None
            raise
