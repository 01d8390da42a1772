"""The n-grams of a request's committed text that are due in its candidate pool, written
key by key when a proposal reads the key.

PTD puts the n-grams of the prompt and the output into ``pool[first token]``, but a proposal
reads one key only: ``pool[last token]``. Writing a path costs about ten microseconds of
Python, and each committed token is in the windows of up to ``n - 1`` paths: a request that
sends no tree (16 requests on a CPU, where the budget finds no tree that pays) wrote them all
at its next proposal and read almost none (in a run of 16-request batches here that was most
of PTD's drafting time). So committing notes the span and where each token stands, and a
key's paths are written just before the key is read.

What is written is what writing every key at each proposal wrote, in the same order, with
the same recency: each path has an ordinal (the order PTD wrote them in, commit by commit,
key position by key position), ``stamp`` reserves the pool's clock for the paths noted since
the last proposal, and a path written later carries the clock value it would have had
(``CandidatePool.insert_path``'s ``stamp``). So the pool's counts, recency and candidates do
not depend on when a key is read, while no cap evicts (which branch a full key evicts may).
"""
from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from typing import Sequence

from vllm_ptd.ptd.candidate_pool import CandidatePool


class PendingNgrams:
    """Text spans committed and where each key token stands, for the paths
    ``key -> text[i + 1 : min(i + n, span end)]`` of every key position i whose n-gram
    window (``n`` tokens, the key included) reaches into a span, the window cut at the span's
    end, as writing each commit's n-grams at once would insert them."""

    __slots__ = ("n", "first_key", "_old", "_new", "_lo", "_ordinal", "_noted", "_stamped",
                 "_seg_first", "_seg_stamp", "_positions", "_cursor", "_written", "_recorded")

    def __init__(self, n: int, first_key: int = 0) -> None:
        self.n = n
        self.first_key = first_key  # no key position before it
        # per committed span: its start and end, its first key position, its first ordinal
        self._old, self._new = array("q"), array("q")
        self._lo, self._ordinal = array("q"), array("q")
        self._noted = 0    # paths noted (the next ordinal)
        self._stamped = 0  # paths whose clock values are reserved
        # per reservation: the ordinal of its first path and that path's stamp
        self._seg_first, self._seg_stamp = array("q"), array("q")
        self._positions: dict[int, array] = {}  # key token -> its text positions, ascending
        self._cursor: dict[int, int] = {}       # key -> index of its first unfinished position
        self._written: dict[int, int] = {}      # key -> paths before this ordinal are written
        self._recorded = 0  # text positions recorded in _positions

    def __len__(self) -> int:
        """Paths noted and not yet written (for tests and accounting; walks every key)."""
        return sum(len(self._due(key, self._noted)) for key in self._positions)

    def note(self, text: Sequence[int], old: int, new: int) -> None:
        """The text span ``[old, new)`` was just committed (``text`` holds it)."""
        lo = max(self.first_key, old - self.n + 1)
        if new - 1 <= lo:
            return  # no key position whose window reaches into it
        positions = self._positions
        for i in range(max(lo, self._recorded), new):
            got = positions.get(text[i])
            if got is None:
                got = positions[text[i]] = array("q")
            got.append(i)
        self._recorded = max(self._recorded, new)
        self._old.append(old)
        self._new.append(new)
        self._lo.append(lo)
        self._ordinal.append(self._noted)
        self._noted += new - 1 - lo

    def stamp(self, pool: CandidatePool) -> None:
        """Reserve the pool's clock for the paths noted since the last call, one tick each
        in ordinal order, as writing them now would take."""
        count = self._noted - self._stamped
        if count:
            self._seg_first.append(self._stamped)
            self._seg_stamp.append(pool.reserve_stamps(count))
            self._stamped = self._noted

    def _due(self, key: int, below: int) -> list[tuple[int, int, int]]:
        """``(ordinal, start, end)`` of ``key``'s paths not yet written with an ordinal
        below ``below``, in ordinal order."""
        positions = self._positions.get(key)
        if positions is None:
            return []
        written = self._written.get(key, 0)
        n, olds, news, los, ordinals = self.n, self._old, self._new, self._lo, self._ordinal
        spans = len(news)
        out = []
        for k in range(self._cursor.get(key, 0), len(positions)):
            i = positions[k]
            # the spans that reach into i's window [i + 1, i + n - 1]
            s = bisect_left(news, i + 2)
            while s < spans and olds[s] <= i + n - 1:
                if i >= los[s]:
                    ordinal = ordinals[s] + i - los[s]
                    if written <= ordinal < below:
                        out.append((ordinal, i + 1, min(i + n, news[s])))
                s += 1
        out.sort()
        return out

    def take(self, key: int, pool: CandidatePool) -> list[tuple[int, int, int]]:
        """``(stamp, start, end)`` of ``key``'s paths noted and not yet written, in the
        order PTD writes them; they count as written from now on."""
        self.stamp(pool)
        due = self._due(key, self._stamped)
        if key in self._positions:
            self._written[key] = self._stamped
            # positions whose whole window is committed get no more paths
            positions, k = self._positions[key], self._cursor.get(key, 0)
            end = self._recorded
            while k < len(positions) and positions[k] + self.n <= end:
                k += 1
            self._cursor[key] = k
        firsts, stamps = self._seg_first, self._seg_stamp
        out = []
        for ordinal, start, end in due:
            seg = bisect_right(firsts, ordinal) - 1
            out.append((stamps[seg] + ordinal - firsts[seg], start, end))
        return out

    def nbytes(self) -> int:
        arrays = (self._old, self._new, self._lo, self._ordinal, self._seg_first,
                  self._seg_stamp)
        return (sum(a.itemsize * len(a) for a in arrays)
                + sum(a.itemsize * len(a) + 100 for a in self._positions.values())
                + 100 * (len(self._cursor) + len(self._written)))
