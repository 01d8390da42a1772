"""StepClock: where one engine step's time goes, as the tree proposer sees it.

A step runs from the end of one ``_prepare_inputs`` to the end of the next. Its parts:
``forward`` (end of ``_prepare_inputs`` to the start of sampling: the target model and its
logits, tree attention included), ``tree_attention`` (the CPU backend's recompute of tree
rows, inside ``forward``), ``verify`` (tree walks and K/V moves), ``drafting`` (the method's
``observe`` and ``propose``) and ``budget`` (sizing the trees); the rest of ``wall`` is vLLM's
own host work (scheduling, sampling, bookkeeping). Host clocks: on a GPU, ``forward`` is
where the host waited for the device.

Between the last timed part of a step and the end of the next ``_prepare_inputs`` an
engine does its host work, a few milliseconds, or waits for requests. A gap there of
``IDLE_GAP_MS`` or more is the engine waiting: the closed step's record leaves it out of
``wall_ms`` and gives it as ``idle_ms``, so that a record's wall is the step's own time
(before ``idle_ms`` existed, readers dropped every record of 1 s or more, real prefill
steps of several prompts among them).
"""
from __future__ import annotations

import time

PARTS = ("forward", "tree_attention", "verify", "drafting", "budget")
IDLE_GAP_MS = 200.0  # host work between two steps takes milliseconds; longer is waiting


class StepClock:
    def __init__(self, idle_gap_ms: float = IDLE_GAP_MS) -> None:
        self.idle_gap_ms = idle_gap_ms
        self._start: float | None = None
        self._last_mark: float | None = None  # end of the step's last timed part
        self._rows = 0
        self._requests = 0
        self._trees = 0
        self._nodes = 0
        self._predicted = 0.0
        self._accepted = 0
        self._draft_depth = 0
        self._draft_branching = 0
        self._paused = 0.0
        self._parts = dict.fromkeys(PARTS, 0.0)
        self.totals = dict.fromkeys(("steps", "wall", *PARTS), 0.0)

    def start_step(self, rows: int, requests: int = 0) -> dict | None:
        """Close the step in flight and start the next one (``rows``: its scheduled tokens,
        ``requests``: the requests it runs). Returns the closed step's record: rows,
        requests, trees (requests that carried one), nodes (theirs), accepted (their nodes
        accepted), draft_depth and draft_branching (how deep and wide the step's proposal
        drafted: ``set_draft_shape``), paused_ms (the part of its drafting spent on rows a
        pause held: ``set_paused``), wall_ms, idle_ms (the engine's wait before the next
        step, left out of wall_ms), predicted_ms (the budget's estimate of wall less
        drafting, 0 without one) and one ``<part>_ms`` per part."""
        now = time.perf_counter()
        record = None
        if self._start is not None:
            idle_ms = 0.0
            if self._last_mark is not None:
                gap_ms = 1000 * (now - self._last_mark)
                if gap_ms >= self.idle_gap_ms:
                    idle_ms = gap_ms
            record = {"rows": self._rows, "requests": self._requests, "trees": self._trees,
                      "nodes": self._nodes, "accepted": self._accepted,
                      "draft_depth": self._draft_depth,
                      "draft_branching": self._draft_branching, "paused_ms": self._paused,
                      "wall_ms": 1000 * (now - self._start) - idle_ms, "idle_ms": idle_ms,
                      "predicted_ms": self._predicted,
                      **{f"{k}_ms": v for k, v in self._parts.items()}}
            self.totals["steps"] += 1
            self.totals["wall"] += record["wall_ms"]
            for k, v in self._parts.items():
                self.totals[k] += v
        self._start, self._rows, self._requests, self._trees = now, rows, requests, 0
        self._last_mark = None
        self._nodes, self._predicted, self._accepted = 0, 0.0, 0
        self._draft_depth = self._draft_branching = 0
        self._paused = 0.0
        self._parts = dict.fromkeys(PARTS, 0.0)
        return record

    def set_trees(self, trees: int, nodes: int = 0, predicted_ms: float = 0.0) -> None:
        """How many requests of the step in flight carry a tree, their nodes, and what the
        budget expected the step to take (0: no budget)."""
        self._trees, self._nodes, self._predicted = trees, nodes, predicted_ms

    def set_draft_shape(self, depth: int, branching: int = 0) -> None:
        """How deep and wide the step in flight's proposal drafted (``TreeMethod
        .drafted_depth``, ``.drafted_branching``; 0: no proposal, or a method that does not
        choose them)."""
        self._draft_depth, self._draft_branching = depth, branching

    def set_paused(self, ms: float) -> None:
        """The part of the step in flight's drafting spent on rows a pause held
        (``TreeMethod.paused_ms``), which the budget's measured gain leaves out."""
        self._paused = ms

    def set_accepted(self, accepted: int) -> None:
        """How many tree nodes of the step in flight were accepted."""
        self._accepted = accepted

    def forward_done(self) -> None:
        if self._start is not None and self._parts["forward"] == 0.0:
            self._last_mark = time.perf_counter()
            self._parts["forward"] = 1000 * (self._last_mark - self._start)

    def add(self, part: str, ms: float) -> None:
        self._parts[part] += ms

    def part(self, name: str) -> "_PartTimer":
        """``with clock.part(name):`` adds the block's milliseconds to the part. A plain
        class, not a generator context manager: it runs a few times every step."""
        return _PartTimer(self, name)

    def summary(self) -> str:
        n = max(1.0, self.totals["steps"])
        return " ".join(f"{k}={self.totals[k] / n:.1f}ms" for k in ("wall", *PARTS))


class _PartTimer:
    __slots__ = ("clock", "name", "t0")

    def __init__(self, clock: StepClock, name: str) -> None:
        self.clock, self.name = clock, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        clock = self.clock
        clock._last_mark = time.perf_counter()
        clock._parts[self.name] += 1000 * (clock._last_mark - self.t0)
