"""PTD's candidate pool: one trie per key token, the candidate trees of paper 3.1/3.2.

``pool[x]`` holds continuations seen after token x: draft subtrees rooted at x (merged with the
paper's recursive union M), n-grams of the prompt and the output, and the target's own argmax
at the nodes verified last step. When x is the last committed token, ``retrieve`` cuts the
candidate tree for the next step out of ``pool[x]``.

Every trie node keeps a visit count (how many merges/insertions passed through it) and the
stamp of its last visit (a counter advanced by every write, so recency is exact).
Bounded memory, with no work proportional to the whole pool:
* per key: at most ``key_max_nodes`` nodes; room is made by evicting the key's least recently
  visited first-level branch (the "oldest" branch; ties to the fewer visits);
* whole pool: at most ``max_nodes`` nodes; room is made by evicting the least recently
  written key.
The branch or key being written is never the one evicted; if it alone fills its cap, new
nodes are refused instead.

Storage is flat (parallel integer arrays, an edge dict keyed by ``parent << 32 | token`` and
sibling links) rather than one Python object per node: a pool may hold 10^5 nodes per
request, and per-node objects would cost ~3x the memory and make every full collection of
the cyclic GC walk them all.

Retrieval is best-first by an estimated path probability: a child's share of its siblings'
visit counts (+1 smoothing), multiplied down the path. Picking the budget's most probable
nodes maximises the expected number of accepted nodes under that estimate, and is
prefix-closed because the estimate only falls along a path. Ties go to the more recently
visited node, then to the earlier sibling.
"""
from __future__ import annotations

import heapq
from array import array
from typing import Iterable, Protocol, Sequence

from vllm_ptd.tree import FlatTree

_SHIFT = 32  # edge key = parent id << 32 | token (token ids are < 2^32)
_NONE = -1
# where a node's evidence came from (bits of ``_src``): a merged draft subtree, or the text
# (n-grams of prompt and output, the target's own argmax at verified nodes)
FROM_DRAFT = 1
FROM_TEXT = 2


class TreeLike(Protocol):
    """A source tree for ``merge``: anything with ``token`` and ordered ``children``."""

    token: int

    @property
    def children(self) -> Iterable["TreeLike"]: ...


class CandidatePool:
    """Per-request pool of candidate tries keyed by their root token."""

    def __init__(self, key_max_nodes: int = 60, max_nodes: int = 200_000) -> None:
        if key_max_nodes < 1 or max_nodes < 1:
            raise ValueError(f"pool caps must be >= 1, got {key_max_nodes}, {max_nodes}")
        self.key_max_nodes = key_max_nodes
        self.max_nodes = max_nodes
        # node arrays (index = node id); key roots are nodes too but are not counted
        self._tok = array("q")
        self._cnt = array("q")
        self._last = array("q")
        self._first = array("q")  # first child, -1 none
        self._tail = array("q")   # last child (appending keeps siblings in insertion order)
        self._next = array("q")   # next sibling, -1 none
        self._src = array("b")    # FROM_DRAFT | FROM_TEXT bits
        # the clock of the node's first visit: siblings in order of birth are siblings in
        # the order a pool written as the text came would have linked them
        self._born = array("q")
        self._free: list[int] = []
        self._edges: dict[int, int] = {}
        self._keys: dict[int, int] = {}      # key token -> root id; order = least recent first
        self._key_size: dict[int, int] = {}  # key token -> nodes below its root
        self.total = 0
        self.clock = 0

    # ------------------------------------------------------------------ node storage
    def _alloc(self, token: int) -> int:
        if self._free:
            n = self._free.pop()
            self._tok[n] = token
            self._cnt[n] = 0
            self._last[n] = self.clock
            self._first[n] = self._tail[n] = self._next[n] = _NONE
            self._src[n] = 0
            self._born[n] = self.clock
            return n
        n = len(self._tok)
        self._tok.append(token)
        self._cnt.append(0)
        self._last.append(self.clock)
        self._first.append(_NONE)
        self._tail.append(_NONE)
        self._next.append(_NONE)
        self._src.append(0)
        self._born.append(self.clock)
        return n

    def _link(self, parent: int, token: int) -> int:
        n = self._alloc(token)
        self._edges[(parent << _SHIFT) | token] = n
        tail = self._tail[parent]
        if tail == _NONE:
            self._first[parent] = n
        else:
            self._next[tail] = n
        self._tail[parent] = n
        return n

    def _children(self, n: int) -> list[int]:
        out = []
        c = self._first[n]
        while c != _NONE:
            out.append(c)
            c = self._next[c]
        return out

    def _free_subtree(self, n: int) -> int:
        """Release n and its descendants (n must already be unlinked). Returns the count."""
        freed, stack = 0, [n]
        edges, tok = self._edges, self._tok
        while stack:
            u = stack.pop()
            c = self._first[u]
            while c != _NONE:
                del edges[(u << _SHIFT) | tok[c]]
                stack.append(c)
                c = self._next[c]
            self._free.append(u)
            freed += 1
        return freed

    def _unlink_child(self, parent: int, child: int) -> None:
        del self._edges[(parent << _SHIFT) | self._tok[child]]
        prev, c = _NONE, self._first[parent]
        while c != child:
            prev, c = c, self._next[c]
        nxt = self._next[child]
        if prev == _NONE:
            self._first[parent] = nxt
        else:
            self._next[prev] = nxt
        if self._tail[parent] == child:
            self._tail[parent] = prev

    # ------------------------------------------------------------------ inspection
    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> list[int]:
        return list(self._keys)

    def key_size(self, key: int) -> int:
        return self._key_size.get(key, 0)

    def _find(self, key: int, path: Sequence[int]) -> int:
        n = self._keys.get(key, _NONE)
        for t in path:
            if n == _NONE:
                break
            n = self._edges.get((n << _SHIFT) | int(t), _NONE)
        return n

    def count(self, key: int, path: Sequence[int]) -> int:
        """Visit count of the node at ``path`` under ``key`` (0 if absent)."""
        n = self._find(key, path)
        return 0 if n == _NONE or not len(path) else self._cnt[n]

    def paths(self, key: int) -> set[tuple[int, ...]]:
        """Every root-to-node token path under ``key`` (tests and debugging)."""
        out: set[tuple[int, ...]] = set()
        root = self._keys.get(key)
        if root is None:
            return out
        stack = [(c, (self._tok[c],)) for c in self._children(root)]
        while stack:
            u, p = stack.pop()
            out.add(p)
            stack.extend((c, p + (self._tok[c],)) for c in self._children(u))
        return out

    def tick(self) -> None:
        """Advance the recency clock (writes advance it too; a step boundary is optional)."""
        self.clock += 1

    # ------------------------------------------------------------------ capacity
    def _touch_key(self, key: int, advance: bool = True) -> int:
        if advance:
            self.clock += 1
        root = self._keys.pop(key, _NONE)
        if root == _NONE:
            root = self._alloc(key)
            self._key_size[key] = 0
        self._keys[key] = root  # re-inserted at the young end
        return root

    def _evict_branch(self, key: int, root: int, keep: int) -> bool:
        victim, best = _NONE, None
        c = self._first[root]
        while c != _NONE:
            if self._tok[c] != keep:
                rank = (self._last[c], self._cnt[c])
                if best is None or rank < best:
                    victim, best = c, rank
            c = self._next[c]
        if victim == _NONE:
            return False
        self._unlink_child(root, victim)
        n = self._free_subtree(victim)
        self._key_size[key] -= n
        self.total -= n
        return True

    def _evict_key(self, keep: int) -> bool:
        for key in self._keys:
            if key != keep:
                self._drop_key(key)
                return True
        return False

    def shrink(self, nodes: int) -> int:
        """Free at least ``nodes`` nodes (or all), least recently written keys first; returns
        how many were freed. For a bound on memory across many pools."""
        before = self.total
        while self._keys and before - self.total < nodes:
            self._drop_key(next(iter(self._keys)))
        return before - self.total

    def _drop_key(self, key: int) -> None:
        root = self._keys.pop(key)
        self.total -= self._free_subtree(root) - 1
        del self._key_size[key]

    def _child(self, key: int, root: int, parent: int, token: int, branch: int,
               bump: bool, src: int = FROM_TEXT, stamp: int | None = None) -> int:
        """Child ``token`` of ``parent`` in ``key``, created if missing and the caps allow
        (-1 if refused). ``branch``: the first-level token this node lives under (never
        evicted here). ``stamp``: the visit's clock, if not now (``insert_path``)."""
        node = self._edges.get((parent << _SHIFT) | token, _NONE)
        created = node == _NONE
        if created:
            cap = self.key_max_nodes
            while self._key_size[key] >= cap:
                if not self._evict_branch(key, root, branch):
                    return _NONE
            while self.total >= self.max_nodes:
                if not self._evict_key(key):
                    return _NONE
            node = self._link(parent, token)
            self._key_size[key] += 1
            self.total += 1
        if bump:
            self._cnt[node] += 1
            self._src[node] |= src
            if stamp is None:
                self._last[node] = self.clock
            else:
                self._last[node] = stamp if created else max(self._last[node], stamp)
        if stamp is not None and self._born[node] > stamp:
            self._born[node] = stamp
        return node

    def _drop_if_empty(self, key: int, root: int) -> None:
        if self._first[root] == _NONE:
            del self._keys[key]
            del self._key_size[key]
            self._free.append(root)

    # ------------------------------------------------------------------ writing
    def merge(self, key: int, subtree: TreeLike) -> None:
        """The paper's recursive union M(pool[key], subtree): missing children are added,
        shared children merged recursively; every node visited gets count + 1."""
        kids = list(subtree.children)
        if not kids:
            return
        root = self._touch_key(key)
        edges, cnt, last, clock, srcs = self._edges, self._cnt, self._last, self.clock, self._src
        for first in kids:
            # one first-level branch at a time: making room only ever evicts branches this
            # merge is not standing in
            branch = int(first.token)
            node = self._child(key, root, root, branch, branch, True, FROM_DRAFT)
            if node == _NONE:
                continue
            stack = [(node, c) for c in first.children]
            while stack:
                dst, src = stack.pop()
                tok = src.token
                got = edges.get((dst << _SHIFT) | tok, _NONE)
                if got == _NONE:  # slow path: a new node, caps apply
                    got = self._child(key, root, dst, int(tok), branch, True, FROM_DRAFT)
                    if got == _NONE:
                        continue
                else:  # the common case, inlined: re-merging a known continuation
                    cnt[got] += 1
                    last[got] = clock
                    srcs[got] |= FROM_DRAFT
                for c in src.children:
                    stack.append((got, c))
        self._drop_if_empty(key, root)

    def insert_path(self, key: int, tokens: Sequence[int], stamp: int | None = None) -> None:
        """Insert the chain ``key -> tokens[0] -> tokens[1] ...`` (counts + 1 along it).

        ``stamp``: a clock value reserved earlier (``reserve_stamps``) for a write done
        now: the nodes get the recency that writing then would have given them, and the
        clock does not move. Why: PTD notes its text's n-grams as they are committed but
        writes a key's only when the key is looked up, and which candidate wins a tie, or
        which branch a full key evicts, must not depend on when that happened."""
        if not len(tokens):
            return
        root = self._touch_key(key, advance=stamp is None)
        branch = int(tokens[0])
        node = self._child(key, root, root, branch, branch, True, stamp=stamp)
        if node != _NONE:
            edges, cnt, last, srcs, born = (self._edges, self._cnt, self._last, self._src,
                                            self._born)
            now = self.clock if stamp is None else stamp
            for t in tokens[1:]:
                nxt = edges.get((node << _SHIFT) | t, _NONE)
                if nxt == _NONE:  # slow path: a new node, caps apply
                    nxt = self._child(key, root, node, int(t), branch, True, stamp=stamp)
                    if nxt == _NONE:
                        break
                else:
                    cnt[nxt] += 1
                    if last[nxt] < now:
                        last[nxt] = now
                    if born[nxt] > now:
                        born[nxt] = now
                    srcs[nxt] |= FROM_TEXT
                node = nxt
        self._drop_if_empty(key, root)

    def reserve_stamps(self, count: int) -> int:
        """Advance the clock past ``count`` writes to be done later with ``stamp``; returns
        the first of their stamps (the clock the first of them would have had now)."""
        first = self.clock + 1
        self.clock += count
        return first

    def insert_ngrams(self, tokens: Sequence[int], n: int, start: int = 0) -> None:
        """For every position i >= ``start``: key tokens[i], chain tokens[i+1 : i+n] (n-grams
        of length n, shorter at the end of ``tokens``)."""
        toks = [int(t) for t in tokens]
        for i in range(max(0, start), len(toks) - 1):
            self.insert_path(toks[i], toks[i + 1: i + n])

    def add_verified(self, tree: FlatTree, node_argmax: Sequence[int], root_token: int,
                     root_argmax: int | None = None) -> None:
        """Extend the tree verified last step (its verify nodes, under key ``root_token``)
        with the target's argmax at each node: edge (node i, node_argmax[i]) gets count + 1,
        and (root, root_argmax) when given. Those edges are the target's own continuations,
        so the ones it keeps confirming rise in retrieval. The verify nodes themselves are
        only re-created if evicted (not counted: being proposed is no evidence)."""
        nv = tree.num_verify
        if nv == 0 and root_argmax is None:
            return
        key = int(root_token)
        root = self._touch_key(key)
        if root_argmax is not None:
            ra = int(root_argmax)
            self._child(key, root, root, ra, ra, True)
        # group the nodes by first-level branch and finish one branch before the next, so
        # making room (which evicts other branches) never frees a node still to be used
        branches: list[int] = []
        groups: dict[int, list[int]] = {}
        for i in range(nv):
            p = tree.parents[i]
            b = int(tree.tokens[i]) if p < 0 else branches[p]
            branches.append(b)
            groups.setdefault(b, []).append(i)
        mapped: dict[int, int] = {}
        for b, idx in groups.items():
            for i in idx:  # parents come first inside a group too
                p = tree.parents[i]
                parent = root if p < 0 else mapped.get(p, _NONE)
                if parent == _NONE:
                    continue
                node = self._child(key, root, parent, int(tree.tokens[i]), b, False)
                if node != _NONE:
                    mapped[i] = node
            for i in idx:
                node = mapped.get(i, _NONE)
                if node != _NONE:
                    self._child(key, root, node, int(node_argmax[i]), b, True)
        self._drop_if_empty(key, root)

    # ------------------------------------------------------------------ reading
    def root(self, key: int) -> int:
        """The node id of ``key``'s trie root, or -1."""
        return self._keys.get(key, _NONE)

    def children_shares(self, node: int) -> list[tuple[int, int, float, int]]:
        """(token, child id, share, source bits) of a node's children, oldest first (by
        their first visit's clock, ``_born``: the same order whether the text's n-grams were
        written as they came or later, with their stamps). The share is the retrieval
        estimate of the child given the node: its visit count's share of its siblings'
        (+1 smoothing)."""
        kids, total = [], 0
        c = self._first[node]
        while c != _NONE:
            kids.append(c)
            total += self._cnt[c]
            c = self._next[c]
        kids.sort(key=self._born.__getitem__)
        denom = total + len(kids)
        return [(self._tok[c], c, (self._cnt[c] + 1) / denom, self._src[c]) for c in kids]

    def nbytes(self) -> int:
        """About how much memory the pool holds: its arrays plus the edge and key dicts."""
        arrays = sum(a.itemsize * len(a) for a in (self._tok, self._cnt, self._last, self._first,
                                                    self._tail, self._next, self._src,
                                                    self._born))
        return arrays + 100 * (len(self._edges) + len(self._keys)) + 8 * len(self._free)

    def retrieve(self, last_token: int, budget: int) -> FlatTree:
        """The candidate tree for ``last_token``: its trie's ``budget`` most probable nodes
        (see the module docstring), parents first, prefix-closed. All nodes are verify nodes."""
        tokens, parents = self.retrieve_lists(last_token, budget)
        return FlatTree(tokens, parents)

    def retrieve_lists(self, last_token: int, budget: int) -> tuple[list[int], list[int]]:
        """``retrieve`` as (tokens, parents) lists, for callers that pack the tree further."""
        root = self._keys.get(last_token, _NONE)
        if root == _NONE or budget <= 0:
            return [], []
        cnt, last, nxt, first, tok = self._cnt, self._last, self._next, self._first, self._tok
        heap: list = []
        seq = 0

        def push(node: int, parent_score: float, parent_index: int) -> None:
            nonlocal seq
            kids = []
            total = 0
            c = first[node]
            while c != _NONE:
                kids.append(c)
                total += cnt[c]
                c = nxt[c]
            denom = total + len(kids)
            for c in kids:
                score = parent_score * (cnt[c] + 1) / denom
                heapq.heappush(heap, (-score, -last[c], seq, c, parent_index))
                seq += 1

        push(root, 1.0, -1)
        tokens: list[int] = []
        parents: list[int] = []
        while heap and len(tokens) < budget:
            neg, _, _, node, pidx = heapq.heappop(heap)
            tokens.append(tok[node])
            parents.append(pidx)
            if first[node] != _NONE:
                push(node, -neg, len(tokens) - 1)
        return tokens, parents

    def check(self) -> None:
        """Assert the bookkeeping and caps (tests and debugging)."""
        total = 0
        live = set()
        for key, root in self._keys.items():
            assert self._tok[root] == key
            stack, n = [root], 0
            while stack:
                u = stack.pop()
                live.add(u)
                n += 1
                seen = set()
                for c in self._children(u):
                    assert self._edges[(u << _SHIFT) | self._tok[c]] == c
                    assert self._tok[c] not in seen
                    seen.add(self._tok[c])
                    stack.append(c)
            n -= 1
            assert n == self._key_size[key], (key, n, self._key_size[key])
            assert 0 < n <= self.key_max_nodes
            total += n
        assert total == self.total <= self.max_nodes, (total, self.total)
        assert len(self._edges) == total
        assert not live & set(self._free)
        assert len(live) + len(self._free) == len(self._tok)
