"""PTD's candidate tree for the next step: the pool's trie of the last token, merged with the
continuations of the longest earlier match of the text's suffix.

Every node gets the estimate that it is accepted given its parent is (``score``): for a
suffix continuation, the rule of succession over the matched occurrences, ``(c + 1) / (n +
2)`` for c of n that went on with its token (a continuation seen once is no certainty: its
raw share of 1 put it in the bin of continuations seen ten times, and the budget valued it
so); for a pool node, its visit-count share (``CandidatePool.children_shares``). Selection
still ranks suffix continuations by their raw share. Its ``group`` says
where it came from: the match length (2..``MAX_GROUP``) for suffix continuations, 0 for the
pool. Selection is best-first by the product of scores along the path, pool nodes weighted
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


@dataclass
class Candidates:
    tokens: list[int]
    parents: list[int]
    scores: list[float]
    groups: list[int]
    draft_only: list[bool]   # the node's only evidence is a merged draft subtree


def build_candidates(pool: CandidatePool, last_token: int, match: SuffixMatch | None,
                     budget: int, pool_weight: float = 0.5) -> Candidates:
    out = Candidates([], [], [], [], [])
    if budget <= 0:
        return out
    group = min(match.length, MAX_GROUP) if match is not None else POOL_GROUP
    heap: list = []
    seq = 0

    def push(suffix_node, pool_node: int, rank: float, parent: int) -> None:
        nonlocal seq
        kids: dict[int, list] = {}
        if suffix_node is not None and suffix_node.count:
            n = suffix_node.count
            for tok, c in suffix_node.children.items():
                kids[tok] = [c, c.count / n, -1, 0.0, 0, (c.count + 1) / (n + 2)]
        if pool_node >= 0:
            for tok, child, share, src in pool.children_shares(pool_node):
                entry = kids.get(tok)
                if entry is None:
                    kids[tok] = [None, 0.0, child, share, src, 0.0]
                else:
                    entry[2], entry[3], entry[4] = child, share, src
        for tok, (sc, s_share, pc, p_share, src, s_score) in kids.items():
            if sc is not None:
                item = (rank * s_share, s_score, group, False)
            else:
                item = (rank * p_share * pool_weight, p_share, POOL_GROUP, src == FROM_DRAFT)
            heapq.heappush(heap, (-item[0], seq, tok, sc, pc, parent, item))
            seq += 1

    push(match.root if match is not None else None, pool.root(last_token), 1.0, -1)
    while heap and len(out.tokens) < budget:
        neg, _, tok, sc, pc, parent, (rank, score, grp, draft_only) = heapq.heappop(heap)
        out.tokens.append(int(tok))
        out.parents.append(parent)
        out.scores.append(float(score))
        out.groups.append(grp)
        out.draft_only.append(draft_only)
        push(sc, pc, -neg, len(out.tokens) - 1)
    return out
