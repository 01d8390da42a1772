"""Where the request's current suffix occurred before, and what followed it.

PTD's pool is keyed by one token (the paper's retrieval). Matching the longest suffix of the
committed text instead (as n-gram and suffix decoding do) finds continuations that are much
more often right: after the 6 tokens ``def reverse_string(s):\\n`` the text that followed
them last time is a far better guess than anything that ever followed ``\\n``.

``SuffixIndex.continuations`` finds the longest suffix (at least ``min_match`` tokens) that
occurred before and merges what followed its most recent occurrences into a small trie with
counts. Cost per committed token: one dictionary update; per lookup: at most ``SCAN``
backward comparisons of at most ``max_match`` tokens.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Callable

# between two texts in one index (``TextHistory``): no token id, so no query matches across
# it and a continuation stops there
SEPARATOR = -1


@dataclass
class SuffixTrieNode:
    """A continuation trie: ``count`` occurrences passed through this node."""

    token: int
    count: int = 0
    children: dict[int, "SuffixTrieNode"] = field(default_factory=dict)


@dataclass
class SuffixMatch:
    length: int                # tokens of the matched suffix
    root: SuffixTrieNode       # root.count = occurrences merged; children = continuations


class SuffixIndex:
    """The committed tokens, with the end positions of every bigram's most recent
    occurrences: the longest earlier match of the current suffix is found from the
    occurrences of its last two tokens by comparing backwards (at most ``max_match`` tokens
    each). Memory: the tokens, one position per token and one dictionary entry per distinct
    bigram (about 100 bytes a token at worst, against a kilobyte for a table of every
    n-gram). With ``min_match`` 1 the end positions of every token are kept as well, for
    the one-token match when no bigram matches."""

    SCAN = 64  # most recent occurrences of the last bigram compared per lookup

    def __init__(self, max_match: int = 8, min_match: int = 2, max_occurrences: int = 8) -> None:
        if not 1 <= min_match <= max_match or max_match < 2:
            raise ValueError(f"suffix match lengths: need 1 <= min {min_match} <= max "
                             f"{max_match}, max >= 2")
        self.max_match = max_match
        self.min_match = min_match
        self.max_occurrences = max_occurrences
        self.tokens: list[int] = []
        self._ends: dict[int, array] = {}  # bigram (a << 32 | b) -> end positions, oldest first
        # token -> end positions, oldest first (only with min_match 1)
        self._token_ends: dict[int, array] | None = {} if min_match == 1 else None

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        """Append committed tokens; index the bigram that ends at each."""
        toks, ends, singles = self.tokens, self._ends, self._token_ends
        for t in tokens:
            toks.append(int(t))
            n = len(toks)
            if singles is not None:
                self._add_end(singles, toks[-1], n)
            if n < 2:
                continue
            self._add_end(ends, (toks[-2] << 32) | toks[-1], n)

    def _add_end(self, table: dict[int, array], key: int, n: int) -> None:
        occ = table.get(key)
        if occ is None:
            table[key] = array("i", [n])
        else:
            occ.append(n)
            if len(occ) > 2 * self.SCAN:  # bounded: keep the most recent
                del occ[: len(occ) - self.SCAN]

    def continuations(self, depth: int) -> SuffixMatch | None:
        """The longest suffix (``min_match`` .. ``max_match`` tokens) seen before, with a trie
        of the (up to ``depth``-token) continuations of its most recent ``max_occurrences``
        occurrences; None if there is none."""
        return self.find(self.tokens, depth, before=len(self.tokens))

    def find(self, query: list[int], depth: int, before: int | None = None,
             skip: Callable[[int], bool] | None = None) -> SuffixMatch | None:
        """The longest suffix of ``query`` (``min_match`` .. ``max_match`` tokens) in this
        index, as ``continuations``: only occurrences that end before position ``before``
        (None: anywhere) and that ``skip`` does not refuse (it gets an occurrence's end
        position). A continuation stops at ``SEPARATOR``, so texts appended one after
        another with it between them (``TextHistory``) are never read across."""
        toks = self.tokens
        q_end = len(query)
        if q_end < 2:
            return None
        limit = len(toks) if before is None else before
        best, found = 0, []
        occ = self._ends.get((query[-2] << 32) | query[-1], ())
        for p in reversed(occ[-self.SCAN - 1:]):
            if p >= limit or (skip is not None and skip(p)):
                continue  # the query's own suffix (nothing follows it yet), or refused
            n = 2
            while n < self.max_match and p - n - 1 >= 0 and q_end - n - 1 >= 0 \
                    and toks[p - n - 1] == query[q_end - n - 1]:
                n += 1
            if n > best:
                best, found = n, [p]
            elif n == best and len(found) < self.max_occurrences:
                found.append(p)
        if not found and self._token_ends is not None:  # the last token alone
            best = 1
            for p in reversed(self._token_ends.get(query[-1], ())):
                if p < limit and (skip is None or not skip(p)):
                    found.append(p)
                    if len(found) == self.max_occurrences:
                        break
        if best < self.min_match or not found:
            return None
        root = SuffixTrieNode(token=-1)
        for p in found:
            cont = toks[p: min(p + depth, limit)]
            if SEPARATOR in cont:
                cont = cont[: cont.index(SEPARATOR)]
            if not cont:
                continue
            root.count += 1
            node = root
            for t in cont:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = SuffixTrieNode(token=t)
                child.count += 1
                node = child
        return SuffixMatch(length=best, root=root) if root.count else None

    def nbytes(self) -> int:
        """About how much memory the index holds (for memory accounting)."""
        tables = [self._ends] + ([self._token_ends] if self._token_ends is not None else [])
        return 8 * len(self.tokens) + sum(140 + 4 * len(v) for t in tables for v in t.values())
