"""Packed token trees: the one representation every part of the project shares.

A request's tree hangs under its *root*, the last committed token (which is not a node).
Nodes are numbered parents-first, so any prefix of a request's nodes is itself a valid tree:
the scheduler may cut a request's speculative tokens short and the cut tree stays whole.

Inside one request's nodes the first ``num_verify`` are *candidate* nodes (verified this
step, their ancestors are candidate nodes too) and the rest are *draft* nodes (they only
draft: their outputs grow the next tree and are never accepted).

``causal_from`` marks where the rows stop needing a tree mask: nodes at index >= causal_from
may attend causally to every earlier row of the request (root, candidates, earlier draft
nodes). Draft rows are never accepted, so what they see changes only drafting quality, never
the output; on CPU the causal rows are computed by vLLM's own attention op for free.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def node_depths(parents: list[int]) -> list[int]:
    """Depth of every node of a flat tree given its parents (parents before children; -1:
    the root); children of the root have depth 1."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


@dataclass
class FlatTree:
    """One request's tree. ``parents[i] == -1`` means node i is a child of the root."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    num_verify: int = -1  # -1: every node is verified
    causal_from: int = -1  # -1: no causal tail, every node uses the tree mask
    # Optional, for the verify nodes: the method's own estimate that node i is accepted
    # given that its parent is (``scores``), and a method-defined category of the node
    # (``groups``) under which the budget calibrates that estimate against outcomes.
    scores: list[float] | None = None
    groups: list[int] | None = None
    # Optional: the expected accepted tokens one draft row brings (later, through drafting)
    draft_value: float | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"tokens ({len(self.tokens)}) and parents ({len(self.parents)}) differ in length")
        n = len(self.tokens)
        if self.num_verify < 0 or self.num_verify > n:
            self.num_verify = n
        if self.causal_from < 0 or self.causal_from > n:
            self.causal_from = n
        if self.causal_from < self.num_verify:
            raise ValueError("causal_from must not cut into the verified nodes")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must come before children")
        for name in ("scores", "groups"):
            v = getattr(self, name)
            if v is not None and len(v) != self.num_verify:
                raise ValueError(f"{name} has {len(v)} entries for {self.num_verify} verify nodes")

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        return node_depths(self.parents)

    def truncated(self, n: int) -> "FlatTree":
        """The first n nodes (still a valid tree, parents come first)."""
        n = max(0, min(n, self.num_nodes))
        nv = min(self.num_verify, n)
        return FlatTree(list(self.tokens[:n]), list(self.parents[:n]), nv,
                        min(self.causal_from, n),
                        None if self.scores is None else self.scores[:nv],
                        None if self.groups is None else self.groups[:nv], self.draft_value)

    def select(self, verify: list[int], num_draft: int) -> "FlatTree":
        """The verify nodes ``verify`` (ascending indices, each one's parent included) and the
        first ``num_draft`` draft nodes, re-indexed; the causal tail keeps its place."""
        nv = self.num_verify
        new_index = {old: new for new, old in enumerate(verify)}
        tokens = [self.tokens[i] for i in verify]
        parents = []
        for i in verify:
            p = self.parents[i]
            if p >= 0 and p not in new_index:
                raise ValueError(f"node {i} is selected without its parent {p}")
            parents.append(-1 if p < 0 else new_index[p])
        num_draft = max(0, min(num_draft, self.num_nodes - nv))
        k = len(verify)
        for j in range(nv, nv + num_draft):
            p = self.parents[j]
            if p >= nv:
                parents.append(p - nv + k)
            elif p < 0:
                parents.append(-1)
            else:  # a draft node under a verify node (not made by PTD; kept if its parent is)
                if p not in new_index:
                    num_draft = j - nv
                    break
                parents.append(new_index[p])
            tokens.append(self.tokens[j])
        tokens = tokens[: k + num_draft]
        parents = parents[: k + num_draft]
        if self.causal_from >= self.num_nodes:
            causal = -1
        elif self.causal_from == nv:
            causal = k
        else:
            raise ValueError("select keeps a causal tail only where it starts at the draft nodes")
        return FlatTree(tokens, parents, k, causal,
                        None if self.scores is None else [self.scores[i] for i in verify],
                        None if self.groups is None else [self.groups[i] for i in verify],
                        self.draft_value)

    def depth_first(self) -> "FlatTree":
        """The same tree with its verify nodes laid out depth first, the deepest subtree first
        (ties: the earlier node): its longest root-to-leaf path becomes the leading chain
        (node i the parent of node i + 1), whose rows vLLM's causal attention computes
        exactly, so only the other branches need the tree mask. Draft nodes keep their
        places; scores and groups follow their nodes."""
        nv = self.num_verify
        children = self.verify_part().children()  # [0]: the root's, [i + 1]: node i's
        height = [1] * nv
        for i in reversed(range(nv)):  # children come after their parents
            for ch in children[i + 1]:
                height[i] = max(height[i], height[ch] + 1)
        order: list[int] = []
        stack = [-1]
        while stack:
            i = stack.pop()
            if i >= 0:
                order.append(i)
            # pushed in reverse, so popped deepest first
            stack.extend(sorted(children[i + 1], key=lambda ch: (height[ch], -ch)))
        if order == list(range(nv)):
            return self
        new_index = {old: new for new, old in enumerate(order)}
        new_index[-1] = -1
        parents = [new_index[self.parents[i]] for i in order]
        parents += [p if p >= nv else new_index[p] for p in self.parents[nv:]]
        tokens = [self.tokens[i] for i in order] + list(self.tokens[nv:])
        return FlatTree(tokens, parents, nv, self.causal_from,
                        None if self.scores is None else [self.scores[i] for i in order],
                        None if self.groups is None else [self.groups[i] for i in order],
                        self.draft_value)

    def verify_part(self) -> "FlatTree":
        return self.truncated(self.num_verify)

    def children(self) -> list[list[int]]:
        """children[i + 1] lists node i's children; children[0] the root's."""
        ch: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for i, p in enumerate(self.parents):
            ch[p + 1].append(i)
        return ch

    def path_to(self, i: int) -> list[int]:
        """Node indices from the root's child down to node i."""
        path = []
        while i >= 0:
            path.append(i)
            i = self.parents[i]
        return path[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """[n+1, n+1] bool, row r may see column c. Row/col 0 is the root; node i is i+1.

        Nodes below ``causal_from`` see the root and their ancestors; causal-tail nodes see
        every earlier row."""
        n = self.num_nodes
        m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        m[0, 0] = True
        for i, p in enumerate(self.parents):
            r = i + 1
            if i >= self.causal_from:
                m[r, : r + 1] = True
            else:
                m[r] = m[p + 1]
                m[r, r] = True
        return m


@dataclass
class TreeBatch:
    """A batch of trees packed as tensors (the kernels' input).

    Node arrays are concatenated over requests; ``offsets[b]:offsets[b+1]`` are request b's
    nodes. ``parents`` are local indices (-1 = root) as in FlatTree."""

    tokens: torch.Tensor  # [N] int64
    parents: torch.Tensor  # [N] int32, local index, -1 = root
    depths: torch.Tensor  # [N] int32, root children = 1
    offsets: torch.Tensor  # [B+1] int32
    num_verify: torch.Tensor  # [B] int32
    causal_from: torch.Tensor  # [B] int32

    @property
    def batch_size(self) -> int:
        return int(self.offsets.numel()) - 1

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    @staticmethod
    def from_trees(trees: list[FlatTree], device: str | torch.device = "cpu") -> "TreeBatch":
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        offsets = [0]
        for t in trees:
            tokens += t.tokens
            parents += t.parents
            depths += t.depths()
            offsets.append(offsets[-1] + t.num_nodes)
        i32 = dict(dtype=torch.int32, device=device)
        return TreeBatch(
            tokens=torch.tensor(tokens, dtype=torch.int64, device=device),
            parents=torch.tensor(parents, **i32),
            depths=torch.tensor(depths, **i32),
            offsets=torch.tensor(offsets, **i32),
            num_verify=torch.tensor([t.num_verify for t in trees], **i32),
            causal_from=torch.tensor([t.causal_from for t in trees], **i32),
        )

    def tree(self, b: int) -> FlatTree:
        s, e = int(self.offsets[b]), int(self.offsets[b + 1])
        return FlatTree(self.tokens[s:e].tolist(), self.parents[s:e].tolist(),
                        int(self.num_verify[b]), int(self.causal_from[b]))
