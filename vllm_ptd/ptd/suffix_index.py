"""Where the request's current suffix occurred before, and what followed it.

PTD's pool is keyed by one token (the paper's retrieval). Matching the longest suffix of the
committed text instead (as n-gram and suffix decoding do) finds continuations that are much
more often right: after the 6 tokens ``def reverse_string(s):\\n`` the text that followed
them last time is a far better guess than anything that ever followed ``\\n``.

``SuffixIndex`` keeps, for every n-gram of the request's committed tokens (n = 1 ..
``max_match``), the positions right after its most recent ``max_occurrences`` occurrences.
``continuations`` looks up the longest suffix of length >= ``min_match`` that occurred
before and merges what followed its occurrences into a small trie with counts. Cost per
committed token: ``max_match`` dictionary updates; memory: at most ``max_match`` entries per
token, each list capped.
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
    def __init__(self, max_match: int = 8, min_match: int = 2, max_occurrences: int = 8) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"suffix match lengths: need 1 <= min {min_match} <= max {max_match}")
        self.max_match = max_match
        self.min_match = min_match
        self.max_occurrences = max_occurrences
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        """Append committed tokens; index every n-gram that ends at one of them."""
        # one more than max_occurrences: the newest occurrence is often the suffix itself
        toks, after, cap = self.tokens, self._after, self.max_occurrences + 1
        for t in tokens:
            toks.append(int(t))
            end = len(toks)
            for n in range(1, min(self.max_match, end) + 1):
                key = tuple(toks[end - n:])
                occ = after.get(key)
                if occ is None:
                    after[key] = [end]
                else:
                    occ.append(end)
                    if len(occ) > cap:
                        del occ[0]

    def continuations(self, depth: int) -> SuffixMatch | None:
        """The longest suffix (>= ``min_match`` tokens) seen before, with a trie of the
        (up to ``depth``-token) continuations of its earlier occurrences; None if none."""
        toks = self.tokens
        end = len(toks)
        for n in range(min(self.max_match, end), self.min_match - 1, -1):
            occ = self._after.get(tuple(toks[end - n:]))
            # the last occurrence is the suffix itself: nothing follows it yet
            starts = [p for p in occ if p < end] if occ else []
            if not starts:
                continue
            root = SuffixTrieNode(token=-1)
            for p in starts:
                cont = toks[p: min(p + depth, end)]
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
            if root.count:
                return SuffixMatch(length=n, root=root)
        return None

    def nbytes(self) -> int:
        """A rough size of the index (for memory accounting): 8 bytes a token, about 100
        bytes an n-gram entry plus 8 a stored position."""
        return 8 * len(self.tokens) + sum(100 + 8 * len(v) for v in self._after.values())
