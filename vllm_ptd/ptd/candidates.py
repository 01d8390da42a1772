"""PTD's candidate tree for the next step: the pool's trie of the last token, merged with the
continuations of the longest earlier match of the text's suffix, in the request's own text
and in the texts of the engine's earlier requests (``TextHistory``).

Every node gets the estimate that it is accepted given its parent is (``score``): for a
suffix continuation, the rule of succession over the matched occurrences, ``(c + 1) / (n +
2)`` for c of n that went on with its token (a continuation seen once is no certainty: its
raw share of 1 put it in the bin of continuations seen ten times, and the budget valued it
so); for a pool node, its visit-count share (``CandidatePool.children_shares``). Selection
still ranks suffix continuations by their raw share. Its ``group`` says
where it came from: the match length (2..``MAX_GROUP``) for suffix continuations of the
request's own text, ``HISTORY_GROUPS`` plus the match length for those of the history, 0
for the pool. Selection is best-first by the product of scores along the path, pool nodes weighted
by ``pool_weight`` (a suffix match is better evidence than one shared token); the budget
later re-weighs every node by how often nodes of its group and score were accepted.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from vllm_ptd.ptd.candidate_pool import FROM_DRAFT, CandidatePool
from vllm_ptd.ptd.suffix_index import SuffixMatch

POOL_GROUP = 0
MAX_GROUP = 8
# groups of the history's continuations (vllm_ptd.ptd.history): this plus the match length
HISTORY_GROUPS = 10


@dataclass
class Candidates:
    tokens: list[int]
    parents: list[int]
    scores: list[float]
    groups: list[int]
    draft_only: list[bool]   # the node's only evidence is a merged draft subtree


def _succession(node) -> dict[int, tuple]:
    """A suffix trie node's children: token -> (child, raw share, rule-of-succession score)."""
    if node is None or not node.count:
        return {}
    n = node.count
    return {tok: (c, c.count / n, (c.count + 1) / (n + 2)) for tok, c in node.children.items()}


def build_candidates(pool: CandidatePool, last_token: int, match: SuffixMatch | None,
                     budget: int, pool_weight: float = 0.5,
                     history: SuffixMatch | None = None,
                     history_weight: float = 0.75) -> Candidates:
    """Best-first over three sources at once: the request's own suffix match (``match``),
    the engine's history of earlier requests (``history``, weighted by ``history_weight``)
    and the pool's trie of ``last_token`` (weighted by ``pool_weight``). A token that more
    than one source has takes the first of them in that order, and its children come from
    every source that has the token."""
    out = Candidates([], [], [], [], [])
    if budget <= 0:
        return out
    own_group = min(match.length, MAX_GROUP) if match is not None else POOL_GROUP
    hist_group = HISTORY_GROUPS + min(history.length, MAX_GROUP) if history is not None else 0
    heap: list = []
    seq = 0

    def push(own_node, hist_node, pool_node: int, rank: float, parent: int) -> None:
        nonlocal seq
        own, hist = _succession(own_node), _succession(hist_node)
        pooled = {tok: (child, share, src) for tok, child, share, src in
                  pool.children_shares(pool_node)} if pool_node >= 0 else {}
        for tok in {**own, **hist, **pooled}:
            o, h, p = own.get(tok), hist.get(tok), pooled.get(tok)
            if o is not None:
                item = (rank * o[1], o[2], own_group, False)
            elif h is not None:
                item = (rank * h[1] * history_weight, h[2], hist_group, False)
            else:
                item = (rank * p[1] * pool_weight, p[1], POOL_GROUP, p[2] == FROM_DRAFT)
            heapq.heappush(heap, (-item[0], seq, tok, o and o[0], h and h[0],
                                  p[0] if p is not None else -1, parent, item))
            seq += 1

    push(match.root if match is not None else None,
         history.root if history is not None else None, pool.root(last_token), 1.0, -1)
    while heap and len(out.tokens) < budget:
        neg, _, tok, oc, hc, pc, parent, (rank, score, grp, draft_only) = heapq.heappop(heap)
        out.tokens.append(int(tok))
        out.parents.append(parent)
        out.scores.append(float(score))
        out.groups.append(grp)
        out.draft_only.append(draft_only)
        push(oc, hc, pc, -neg, len(out.tokens) - 1)
    return out
