"""PTD's draft tree: the rows the target runs only to draft for itself (paper 3.1, App. D).

What the draft tree's root is. The paper grows a forest of *subtrees* whose root values are
the keys under which their continuations enter the candidate pool. Every subtree hangs under
one virtual root that stands for the step's root row (the last committed token): in the packed
FlatTree the top-level nodes have parent -1, sit at position pos(last) + 1 and each node sees
the committed prefix plus its own ancestors. Semantically a subtree does not continue the last
token: a subtree rooted at token r asks the target "if r came next, what would follow?",
conditioned on the current context. Those lookahead answers are harvested into the pool keyed
by r and pay off once r is actually the last token. Draft rows are never accepted, so this
choice only affects drafting quality, never the output.

Life cycle per step (``grow``), given the target's argmax d_v at each draft row:
1. EOS: a node whose argmax is one of the model's EOS ids is cut with its descendants (the
   text ends there, drafting past it is wasted rows); its parent's prediction of the same
   token in the same step does not bring it straight back.
2. Expansion: d_v becomes a new child of v unless v already has a child d_v or has ``width``
   children (width control). Main-line extensions (the leaf of a subtree's earliest-child
   chain) go first and may evict side leaves; side additions only use free room.
3. Stepping prune (depth control): a subtree deeper than ``depth`` is replaced by its
   earliest-added child's subtree; if that child's token duplicates another top-level token
   the subtree is dropped (two subtrees under one key would draft the same thing).
4. Top-level control (as the authors keep exactly w subtrees): surplus subtrees are dropped
   oldest first; when fewer remain, the newest subtree root's argmax becomes a new subtree
   root, so the top level keeps moving forward like a lookahead chain.
5. Refilling from seeds when the tree is empty is the caller's job (it owns the prompt/history
   and the random generator), via ``seed``.

Node budget: the tree never holds more than ``max_nodes`` nodes. When full, a main-line
extension first evicts the newest side leaf (a leaf off every earliest-child chain); with no
side leaf left the extension's own subtree steps early (a shorter sliding window), which keeps
every main line moving instead of freezing the tree once the budget is reached.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Sequence

from vllm_ptd.tree import FlatTree


class DraftNode:
    """One draft-tree node. ``children`` are ordered oldest first (children[0] is the earliest
    added child: the node's main line)."""

    __slots__ = ("token", "parent", "children", "birth", "alive")

    def __init__(self, token: int, parent: "DraftNode | None", birth: int) -> None:
        self.token = token
        self.parent = parent
        self.children: list[DraftNode] = []
        self.birth = birth
        self.alive = True

    def __repr__(self) -> str:
        return f"DraftNode({self.token}, kids={[c.token for c in self.children]})"


class DraftTree:
    """The per-request draft forest. See the module docstring for the rules."""

    def __init__(self, width: int, depth: int, max_nodes: int,
                 eos_token_ids: Iterable[int] = (), max_roots: int | None = None) -> None:
        if width < 1 or depth < 1 or max_nodes < 0:
            raise ValueError(f"bad draft tree shape: width={width} depth={depth} max_nodes={max_nodes}")
        self.width = width
        self.depth = depth
        self.max_nodes = max_nodes
        self.max_roots = width if max_roots is None else max_roots
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.roots: list[DraftNode] = []
        self._n = 0
        self._clock = 0
        self._emitted: list[DraftNode] = []

    # ------------------------------------------------------------------ inspection
    @property
    def num_nodes(self) -> int:
        return self._n

    def __len__(self) -> int:
        return self._n

    @property
    def empty(self) -> bool:
        return self._n == 0

    def nodes(self) -> Iterator[DraftNode]:
        """All nodes, preorder (parents first, each subtree contiguous, oldest child first)."""
        stack = list(reversed(self.roots))
        while stack:
            v = stack.pop()
            yield v
            stack.extend(reversed(v.children))

    def subtrees(self) -> Iterator[tuple[int, DraftNode]]:
        """(root token, subtree) for every node: each node with its descendants is a subtree
        T' of the paper's merge step, keyed by the node's token (as the authors do)."""
        for v in self.nodes():
            yield v.token, v

    def subtree_depth(self, v: DraftNode) -> int:
        """Levels in v's subtree, v included (a lone node has depth 1)."""
        best, stack = 0, [(v, 1)]
        while stack:
            u, d = stack.pop()
            if d > best:
                best = d
            for c in u.children:
                stack.append((c, d + 1))
        return best

    def max_depth(self) -> int:
        return max((self.subtree_depth(r) for r in self.roots), default=0)

    # ------------------------------------------------------------------ building
    def _new(self, token: int, parent: DraftNode | None) -> DraftNode:
        self._clock += 1
        v = DraftNode(token, parent, self._clock)
        if parent is None:
            self.roots.append(v)
        else:
            parent.children.append(v)
        self._n += 1
        return v

    def _kill(self, v: DraftNode) -> None:
        """Detach v and its descendants."""
        if v.parent is None:
            self.roots.remove(v)
        else:
            v.parent.children.remove(v)
        self._kill_detached(v)

    def _root_tokens(self) -> set[int]:
        return {r.token for r in self.roots}

    def seed(self, chains: Sequence[Sequence[int]]) -> int:
        """Add seed chains as new subtrees (chain[0] the subtree root). Skips EOS tokens and
        root tokens already present; respects the budget and the top-level limit. Returns
        the number of nodes added."""
        added = 0
        have = self._root_tokens()
        for chain in chains:
            if len(self.roots) >= self.max_roots or self._n >= self.max_nodes:
                break
            chain = [int(t) for t in chain[: self.depth]]
            if not chain or chain[0] in have:
                continue
            parent = None
            for t in chain:
                if t in self.eos or self._n >= self.max_nodes:
                    break
                parent = self._new(t, parent)
                added += 1
            have.add(chain[0])
        return added

    # ------------------------------------------------------------------ emission
    def emit(self) -> tuple[list[int], list[int]]:
        """The draft rows in preorder: (tokens, parents), parents local to the draft rows
        with -1 = the step root. Remembers the order so ``grow`` can map the argmax back.

        Preorder keeps each subtree contiguous and puts a node's first child right after it,
        so with a causal draft tail (every row sees all earlier rows) the rows just before a
        node are mostly its own ancestors."""
        order = list(self.nodes())
        index = {id(v): i for i, v in enumerate(order)}
        tokens = [v.token for v in order]
        parents = [-1 if v.parent is None else index[id(v.parent)] for v in order]
        self._emitted = order
        return tokens, parents

    def to_flat(self, verify: FlatTree | tuple[list[int], list[int]],
                causal: bool = False) -> FlatTree:
        """The candidate tree (a FlatTree, whose verify part is used, or (tokens, parents)
        lists) followed by the draft rows. Draft parents are shifted by the verify count;
        draft roots hang under the step root. With ``causal`` the draft rows form the causal
        tail (``causal_from = num_verify``)."""
        if isinstance(verify, FlatTree):
            nv = verify.num_verify
            vt, vp = verify.tokens[:nv], verify.parents[:nv]
        else:
            vt, vp = list(verify[0]), list(verify[1])
            nv = len(vt)
        tokens, parents = self.emit()
        return FlatTree(vt + tokens, vp + [p + nv if p >= 0 else -1 for p in parents],
                        num_verify=nv, causal_from=nv if causal else -1)

    # ------------------------------------------------------------------ evolution
    def _main_line(self) -> set[int]:
        """ids of nodes on some subtree's earliest-child chain."""
        main: set[int] = set()
        for r in self.roots:
            v: DraftNode | None = r
            while v is not None:
                main.add(id(v))
                v = v.children[0] if v.children else None
        return main

    def _evict_side_leaf(self) -> bool:
        main = self._main_line()
        victim = None
        for v in self.nodes():
            if not v.children and id(v) not in main and (victim is None or v.birth > victim.birth):
                victim = v
        if victim is None:
            return False
        self._kill(victim)
        return True

    def _step(self, root: DraftNode) -> DraftNode | None:
        """Stepping prune of one subtree: its earliest child becomes the subtree root, the old
        root and the other children's branches go. Returns the new root or None (dropped)."""
        first = root.children[0]
        slot = self.roots.index(root)
        for c in root.children[1:]:
            self._kill(c)
        root.children = []
        root.alive = False
        self._n -= 1
        first.parent = None
        if any(r.token == first.token for r in self.roots if r is not root):
            self.roots.pop(slot)
            self._kill_detached(first)
            return None
        self.roots[slot] = first
        return first

    def _kill_detached(self, v: DraftNode) -> None:
        stack = [v]
        while stack:
            u = stack.pop()
            u.alive = False
            self._n -= 1
            stack.extend(u.children)
            # break the parent/child cycles so dead nodes go by refcount, not by the
            # cyclic GC (which would otherwise scan them on every full collection)
            u.children = []
            u.parent = None

    def _top(self, v: DraftNode) -> DraftNode:
        while v.parent is not None:
            v = v.parent
        return v

    def _add_child(self, parent: DraftNode, token: int, may_evict: bool) -> DraftNode | None:
        if self._n >= self.max_nodes:
            if not may_evict:
                return None
            if not self._evict_side_leaf():
                top = self._top(parent)
                if top is parent or not top.children:
                    return None  # a lone root cannot step: no room for its child
                if self._step(top) is None or not parent.alive:
                    return None
            if self._n >= self.max_nodes:
                return None
        return self._new(token, parent)

    def grow(self, argmax: Sequence[int]) -> None:
        """One step of the life cycle from the target's argmax at the draft rows emitted last
        (``argmax[i]`` for emitted row i; a tree cut short by the scheduler gives fewer)."""
        rows = self._emitted[: len(argmax)]
        self._emitted = []
        if not rows:
            # no draft row ran (the budget sent none, or a step without a tree): the
            # controls below hold already (they held after the last grow and seeding keeps
            # them), and nothing grows; most steps of a batch of 16 on a CPU are such steps
            return
        preds: list[tuple[DraftNode, int]] = []
        newest_root_pred = None
        newest_root = self.roots[-1] if self.roots else None
        ended: set[tuple[int, int]] = set()  # (parent id, token) of branches cut at EOS
        for v, a in zip(rows, argmax):
            a = int(a)
            if not v.alive:
                continue
            if a in self.eos:
                if v.parent is not None:
                    ended.add((id(v.parent), v.token))
                self._kill(v)
                continue
            preds.append((v, a))
            if v is newest_root:
                newest_root_pred = a
        # expansion: main-line extensions first (they may evict), side branches after
        main = self._main_line()
        firsts, sides = [], []
        for v, a in preds:
            if not v.alive or len(v.children) >= self.width or (id(v), a) in ended:
                continue
            if any(c.token == a for c in v.children):
                continue
            (firsts if (id(v) in main and not v.children) else sides).append((v, a))
        for v, a in firsts:
            if v.alive:
                self._add_child(v, a, may_evict=True)
        for v, a in sides:
            if v.alive and len(v.children) < self.width and not any(c.token == a for c in v.children):
                self._add_child(v, a, may_evict=False)
        # depth control
        for r in list(self.roots):
            while r is not None and r.alive and self.subtree_depth(r) > self.depth:
                r = self._step(r)
        # top-level control: exactly max_roots subtrees when there is anything to work with
        while len(self.roots) > self.max_roots:
            self._kill(self.roots[0])
        if (0 < len(self.roots) < self.max_roots and newest_root_pred is not None
                and newest_root_pred not in self._root_tokens()):
            if self._n < self.max_nodes or self._evict_side_leaf():
                self._new(newest_root_pred, None)

    def check(self) -> None:
        """Assert the structural invariants (tests and debugging)."""
        count = 0
        tops = [r.token for r in self.roots]
        assert len(tops) == len(set(tops)), f"duplicate subtree roots {tops}"
        assert len(self.roots) <= self.max_roots
        for v in self.nodes():
            count += 1
            assert v.alive
            assert len(v.children) <= self.width, f"node {v} exceeds width {self.width}"
            assert len({c.token for c in v.children}) == len(v.children)
            for c in v.children:
                assert c.parent is v
            assert v.token not in self.eos
        assert count == self._n, (count, self._n)
        assert self._n <= self.max_nodes
        assert self.max_depth() <= self.depth
