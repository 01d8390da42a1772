"""How many rows each request's tree gets this step: a cost model the engine measures itself
and acceptance estimates calibrated on outcomes. No vLLM import.

A step of a batch of B decoding requests commits B tokens (each request's bonus) plus the
accepted tree nodes, and costs ``overhead + T * per_tree + forward(rows)``: rows = the step's
other rows + the tree nodes, T = the requests that carry a tree (each costs host work of its
own: drafting, verification, the tree-row attention). So with node i accepted with
probability p_i, a step with the nodes S runs at

    tokens per ms  =  (B + sum_{i in S} p_i) / (overhead + T(S) * per_tree
                                                + forward(base_rows + |S|))

``allocate`` picks S to maximise that: the nodes of all requests ranked by p, and the
count that maximises the ratio (possibly 0: no tree pays, and the step runs as plain
decoding). Trees are sent only when that rate beats plain decoding's by ``MARGIN``: the
estimates are averages, and a tree that only just pays on paper can lose in fact (and in an
offline batch a step lasts as long as its slowest request needs). Because p never rises from
parent to child, the best nodes of a request always include their parents. Draft rows (PTD)
enter with the value the method estimates for them.

``StepCostModel`` learns ``forward(rows)``, the ``overhead`` of a step without trees and the
extra host time ``per_tree`` from the engine's own steps (exponential averages; row counts
not seen yet are interpolated, starting from a prior slope), each per batch size as well
(at one row count a step of four requests costs more than a step of one, and verifying a
tree in a batch of 16 costs several times what it costs alone),
and can be saved and loaded per machine and model, so a new engine starts from what the
last one measured. ``AcceptanceModel`` turns each method's own estimate of a
node (its ``score``, in a ``group``) into a calibrated one: how often nodes of that group
and score bin were accepted, in this request and over all requests.

Tokens per ms is the right measure while finished requests make room for others (a server
under load, an offline run with more prompts than fit one batch). A batch that nothing
follows (an offline batch, a server's last requests) ends when its slowest request ends: a
token gained by a request with fewer tokens left than another shortens nothing but that
request's share of the later steps. ``makespan_weights`` values each request's tokens that
way, and ``allocate`` maximises their worth per ms.
"""
from __future__ import annotations

import bisect
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from vllm_ptd.tree import FlatTree, node_depths

# a tree is sent only when its expected tokens per ms beat plain decoding's by this share
MARGIN = 0.03
# drafting goes on at a batch size only while the milliseconds its accepted tokens saved
# there, measured, beat what drafting and the tree rows cost by this share (RealizedGain)
REALIZED_MARGIN = 0.3
# which misses lengthen TreeBudget's backoff: "trees", the proposals whose trees went out
# and did not pay (the default); "all", every proposal that did not pay, a proposal that
# found nothing worth sending included (the budget before ``miss_backoff``)
MISS_BACKOFFS = ("trees", "all")
# bins of a method's own conditional score (the probability it gives a node given its parent)
SCORE_BINS = (0.1, 0.25, 0.5, 0.75, 0.9)
# engine-wide evidence (acceptance counts, calibration sums) fades by a factor e over this
# many engine steps, with or without new evidence: what held trees back must not hold them
# back for good once no tree is sent that could show otherwise (a benchmark's warm-up on
# reversed prompts, where no draft is accepted, had left an engine sending trees in 20 of
# 2000 steps)
STEP_MEMORY = 256


class EngineClock:
    """The engine steps run so far: what evidence fades with (``faded``). One per engine,
    shared by every model whose evidence fades, and ticked by ``TreeBudget.observe_step``."""

    def __init__(self) -> None:
        self.steps = 0


def faded(values: list[float], since: int, now: int) -> list[float]:
    """``values`` weighed down for the engine steps since they were last updated."""
    if now <= since:
        return values
    f = (1.0 - 1.0 / STEP_MEMORY) ** (now - since)
    return [v * f for v in values]


def faded_cell(cell: list[float] | None, width: int, now: int) -> list[float]:
    """The ``width`` sums of a ``[*sums, engine step of the last update]`` cell, faded to
    engine step ``now``; zeros for no cell."""
    if cell is None:
        return [0.0] * width
    return faded(cell[:width], int(cell[width]), now)


def add_to_cell(table: dict, key, increments: list[float], now: int,
                keep: float = 1.0) -> None:
    """Fade the cell's sums to ``now``, weigh them down by ``keep`` and add ``increments``
    (the cell's layout: ``faded_cell``)."""
    sums = faded_cell(table.get(key), len(increments), now)
    table[key] = [v * keep + x for v, x in zip(sums, increments)] + [float(now)]


def makespan_weights(remaining: list[int], request_share: float) -> list[float]:
    """What one more token of each request is worth to a batch that must finish before
    anything follows it, in steps of the batch (``remaining``: each request's tokens left,
    at most; ``request_share``: the share of a step's cost one request adds).

    The requests with the most tokens left are its critical path: the batch ends when they
    do, so a token they all gain saves one step. Each of them gets ``1 / n`` (n of them),
    the largest weight, by which ``allocate`` knows them (and values them together by the
    least of their gains: all must gain for the batch to gain). Any other request
    gains the batch only the cost it stops adding to each later step once it is done:
    ``request_share`` per token."""
    if not remaining:
        return []
    longest = max(remaining)
    n = sum(1 for r in remaining if r >= longest)
    share = min(1.0, max(0.0, request_share))
    return [1.0 / n if r >= longest else share for r in remaining]


def makespan_lead(remaining: list[int]) -> int:
    """How many tokens the batch's critical path (the requests with the most tokens left)
    can gain before the next request joins it: past that lead a token of theirs no longer
    shortens the batch, the next request's steps do (the whole remainder where every
    request is on it). ``allocate`` bounds the critical worth by it: without it a lone
    critical request's sure chain of 7 nodes was worth 7 steps of the batch whatever its
    lead. (Where trees in the tail of batches of 16 did not pay, README: Batches of 16 with
    the engines side by side, the bound changed nothing that showed.)"""
    if not remaining:
        return 0
    longest = max(remaining)
    below = [r for r in remaining if r < longest]
    return longest - (max(below) if below else 0)


def score_bin(q: float) -> int:
    return bisect.bisect_right(SCORE_BINS, q)


def depth_class(depth: int) -> int:
    """Depth 1 (the root's children), 2, or deeper: a node right after the committed text
    is where a copied continuation diverges, if it does; once it agreed, the copy mostly
    goes on. Pooled with the deeper nodes of its group and score, a depth-1 node was put
    near certain (in a served run at 16 clients: trees whose nodes were all valued above
    0.99 brought 68 of 175 expected tokens, 7 of 17 of them none)."""
    return min(depth, 3)


class AcceptanceModel:
    """Calibrated P(node accepted | its parent accepted) per (group, score bin, depth class).

    Estimate for a request: ``(a_r + s_r * p_e) / (n_r + s_r)`` with the request's own counts
    (a_r accepted of n_r offered) and the engine-wide estimate ``p_e = (a_e + s_e * q) /
    (n_e + s_e)`` as prior, which in turn starts from the method's own score q. A node counts
    as offered only when its parent was accepted (or is the root): otherwise the walk never
    looked at it.

    ``unconditional`` also scales a request's values by how its own trees came out: its
    accepted tokens against the tokens they were expected to bring (``request_factor``: a
    ratio of sums over about its last ``REQUEST_MEMORY`` trees, shrunk toward 1 by
    ``REQUEST_PRIOR`` expected tokens). Why: the cells above pool a request's evidence by
    node kind, and a request whose text the drafts do not follow fails across all of them
    at once. In the traces of two bf16 runs here (16 prompts at batch 1 and in closed
    batches of 4, both methods; ``trace_steps --request-ratios``), trees sent while a
    request's ratio was 0.5-0.75 brought 0.62-0.70 of the tokens expected of them, at
    0.75-1 0.79-0.89, at 1-1.25 0.97-0.99; at the end of a closed batch of 4 one request
    decoded alone for 58 steps, 33 of them with a PCTree tree, none accepted."""

    REQUEST_PRIOR = 8.0   # expected tokens "as estimated" that a request's ratio starts from
    REQUEST_MEMORY = 16   # trees: each weighs a request's earlier ones down by 1 - 1/16

    def __init__(self, engine_strength: float = 8.0, request_strength: float = 4.0,
                 max_requests: int = 100_000, clock: EngineClock | None = None,
                 request_calibration: bool = True) -> None:
        self.engine_strength = engine_strength
        self.request_strength = request_strength
        self.max_requests = max_requests
        self.request_calibration = request_calibration  # False: request_factor is 1
        # engine-wide [accepted, offered, step of the last update]; faded with the steps
        self.engine: dict[tuple[int, int, int], list[float]] = {}
        self.requests: dict[str, dict[tuple[int, int, int], list[float]]] = {}
        # per request [accepted tokens, expected tokens, step of the last update]
        # (request_factor); faded with the engine's steps as well, so a request whose trees
        # stopped going out is not held to its old ratio for good
        self.request_sums: dict[str, list[float]] = {}
        self.clock = clock or EngineClock()

    @staticmethod
    def key(group: int, score: float, depth: int) -> tuple[int, int, int]:
        return group, score_bin(score), depth_class(depth)

    def conditional(self, req_id: str, scores: list[float], groups: list[int],
                    depths: list[int]) -> list[float]:
        own = self.requests.get(req_id, {})
        se, sr = self.engine_strength, self.request_strength
        now = self.clock.steps
        out = []
        for q, g, d in zip(scores, groups, depths):
            key = self.key(g, q, d)
            a, n = faded_cell(self.engine.get(key), 2, now)
            pe = (a + se * q) / (n + se)
            a, n = own.get(key, (0.0, 0.0))
            out.append(min(1.0, max(0.0, (a + sr * pe) / (n + sr))))
        return out

    def request_factor(self, req_id: str) -> float:
        """The request's accepted tokens over the tokens its trees were expected to bring,
        ``(accepted + REQUEST_PRIOR) / (expected + REQUEST_PRIOR)`` (1 before its first tree,
        and always without ``request_calibration``)."""
        cell = self.request_sums.get(req_id)
        if cell is None or not self.request_calibration:
            return 1.0
        accepted, expected = faded_cell(cell, 2, self.clock.steps)
        return (accepted + self.REQUEST_PRIOR) / (expected + self.REQUEST_PRIOR)

    def _path_products(self, req_id: str, tree: FlatTree,
                       depths: list[int] | None = None) -> list[float]:
        parents = tree.parents[: tree.num_verify]
        if depths is None:
            depths = node_depths(parents)
        cond = self.conditional(req_id, tree.scores, tree.groups, depths)
        out: list[float] = []
        for i, p in enumerate(parents):
            out.append(cond[i] * (1.0 if p < 0 else out[p]))
        return out

    def unconditional(self, req_id: str, tree: FlatTree) -> list[float]:
        """P(node accepted) for every verify node: the product of the conditional estimates
        along its path, times the request's ``request_factor`` (at most 1). One factor for
        all of a request's nodes keeps a parent valued at least as its child."""
        if tree.scores is None or tree.groups is None:
            return [0.0] * tree.num_verify
        f = self.request_factor(req_id)
        return [min(1.0, f * v) for v in self._path_products(req_id, tree)]

    def observe(self, req_id: str, tree: FlatTree, accepted: list[int]) -> None:
        if tree.scores is None or tree.groups is None or tree.num_verify == 0:
            return
        parents = tree.parents[: tree.num_verify]
        depths = node_depths(parents)
        if self.request_calibration:
            self._observe_request(req_id, tree, depths, len(accepted))
        own = self.requests.get(req_id)
        if own is None:
            if len(self.requests) >= self.max_requests:  # bounded: drop the oldest
                oldest = next(iter(self.requests))
                self.requests.pop(oldest)
                self.request_sums.pop(oldest, None)
            own = self.requests[req_id] = {}
        on_path = set(accepted)
        for i, (p, d) in enumerate(zip(parents, depths)):
            if p >= 0 and p not in on_path:
                continue  # never looked at
            key = self.key(tree.groups[i], tree.scores[i], d)
            hit = 1.0 if i in on_path else 0.0
            add_to_cell(self.engine, key, [hit, 1.0], self.clock.steps)
            cell = own.get(key)
            if cell is None:
                own[key] = [hit, 1.0]
            else:
                cell[0] += hit
                cell[1] += 1.0

    def _observe_request(self, req_id: str, tree: FlatTree, depths: list[int],
                         accepted: int) -> None:
        """Adds a tree's outcome to the request's sums (``request_factor``): its accepted
        tokens, and what it was expected to bring by the estimates before this outcome,
        without the request's factor (the factor measures them)."""
        expected = sum(self._path_products(req_id, tree, depths))
        add_to_cell(self.request_sums, req_id, [accepted, expected], self.clock.steps,
                    keep=1.0 - 1.0 / self.REQUEST_MEMORY)

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.request_sums.pop(req_id, None)


def monotone(points: list[tuple[int, float, int]], max_weight: int = 16) -> list[tuple[int, float]]:
    """The non-decreasing curve nearest to measured (rows, ms, samples) points, sorted by
    rows (pool-adjacent-violators, each point weighted by its samples up to ``max_weight``).

    A step with more rows never costs less; a point measured low by chance would otherwise
    be where the allocation lands, since it picks the row count that looks best."""
    blocks: list[list[float]] = []  # [weighted sum, weight, count of points]
    for _, ms, n in points:
        w = float(min(max(n, 1), max_weight))
        blocks.append([ms * w, w, 1])
        while len(blocks) >= 2 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, w, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += w
            blocks[-1][2] += c
    out: list[tuple[int, float]] = []
    i = 0
    for s, w, c in blocks:
        for _ in range(int(c)):
            out.append((points[i][0], s / w))
            i += 1
    return out


def curve_at(known: list[tuple[int, float]], x: float, tail_slope: float | None = None) -> float:
    """The piecewise-linear curve through ``known`` (sorted (x, y), x >= its first x),
    extended past the last point along its last slope (flat with one point), or along
    ``tail_slope`` where the caller knows better."""
    xs = [b for b, _ in known]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return known[i][1]
    if i >= len(xs):
        b, y = known[-1]
        if tail_slope is not None:
            return y + max(0.0, tail_slope) * (x - b)
        if len(known) < 2:
            return y
        b0, y0 = known[-2]
        return y + max(0.0, (y - y0) / (b - b0)) * (x - b)
    if i == 0:
        return known[0][1]
    (b0, y0), (b1, y1) = known[i - 1], known[i]
    return y0 + (y1 - y0) * (x - b0) / (b1 - b0)


def decode_only(rows: int, requests: int | None, nodes: int | None) -> bool:
    """A step of decoding requests and their tree rows, no prefill rows (the steps the
    budget sizes trees for; None: not known)."""
    return requests is not None and nodes is not None and rows == requests + nodes


@dataclass
class _Stat:
    ms: float
    n: int


def _dump(table: dict[int, _Stat]) -> dict[str, list]:
    return {str(b): [s.ms, s.n] for b, s in sorted(table.items())}


class StepCostModel:
    """Forward milliseconds against rows per step, and the per-step overhead, measured.

    ``prior_slope``: the cost of one more row relative to a one-row step before anything was
    measured (CPU: rows are compute, about 0.15; GPU: nearly free, 0.01)."""

    EMA = 0.1
    MIN_SAMPLES = 2

    def __init__(self, prior_slope: float = 0.15, path: str | os.PathLike | None = None) -> None:
        self.prior_slope = prior_slope
        self.path = Path(path) if path is not None else None
        self.rows: dict[int, _Stat] = {}
        # Where the batch is known (``requests``, ``nodes`` given to ``observe``), a tree step
        # is costed as a plain step of its requests plus what its tree rows add at that batch
        # size: at one row count a step of four requests with trees costs far more than a
        # step of one (measured here: 4 requests 42.6 ms plain, 85 ms with 12 tree rows;
        # one request with 15 tree rows 63 ms), and prefill rows cost less than tree rows.
        self.decode: dict[int, _Stat] = {}  # forward ms of a decode-only step, per requests
        # per ``batch_bucket``: extra forward ms against tree rows (decode-only steps)
        self.tree_rows: dict[int, dict[int, _Stat]] = {}
        self.overhead = _Stat(0.0, 0)   # host ms of a step without trees
        self.per_tree = _Stat(0.0, 0)   # extra host ms per request that carries a tree
        # the same two per batch size (``batch_bucket``): (overhead, per_tree)
        self.host_by_batch: dict[int, tuple[_Stat, _Stat]] = {}
        self.samples = 0
        if self.path is not None and self.path.is_file():
            self.load(self.path)

    # ---- learning ---------------------------------------------------------------------
    @staticmethod
    def bucket(rows: int) -> int:
        """Exact row counts up to 64, then 1/8-octave buckets (costs grow smoothly there)."""
        if rows <= 64:
            return max(1, rows)
        step = 1 << max(0, int(math.log2(rows)) - 3)
        return (rows // step) * step

    @classmethod
    def _average(cls, st: _Stat, value: float) -> None:
        a = max(cls.EMA, 1.0 / (st.n + 1))
        st.ms = value if st.n == 0 else st.ms + a * (value - st.ms)
        st.n += 1

    @staticmethod
    def batch_bucket(requests: int) -> int:
        """Batch sizes 1, 2-3, 4-7, 8-15, 16-31, ... share their host-time estimates."""
        return max(1, int(requests)).bit_length() - 1

    @classmethod
    def _add(cls, table: dict[int, _Stat], key: int, ms: float) -> None:
        st = table.get(key)
        if st is None:
            table[key] = _Stat(ms, 1)
        else:
            cls._average(st, ms)

    def observe(self, rows: int, forward_ms: float, overhead_ms: float | None = None,
                trees: int = 0, requests: int | None = None, nodes: int | None = None) -> None:
        """One step: its rows, forward ms, host ms around the forward (None: unknown), how
        many of its requests carried a tree, how many requests it ran and how many tree
        nodes (None: unknown)."""
        self._add(self.rows, self.bucket(rows), forward_ms)
        if decode_only(rows, requests, nodes):
            # plain, or plain plus its tree rows
            key = self.bucket(requests)
            if nodes == 0:
                self._add(self.decode, key, forward_ms)
            else:
                plain = self.plain_forward_ms(requests)
                if plain is not None:
                    self._add(self.tree_rows.setdefault(self.batch_bucket(requests), {}),
                              self.bucket(nodes), forward_ms - plain)
        if overhead_ms is not None and overhead_ms >= 0:
            stats = [(self.overhead, self.per_tree)]
            if requests is not None:
                stats.append(self.host_by_batch.setdefault(
                    self.batch_bucket(requests), (_Stat(0.0, 0), _Stat(0.0, 0))))
            for overhead, per_tree in stats:
                if trees <= 0:
                    self._average(overhead, overhead_ms)
                    continue
                # against a plain step of this batch size, or of any until one was seen
                plain = overhead if overhead.n > 0 else self.overhead
                if plain.n > 0:
                    self._average(per_tree, max(0.0, (overhead_ms - plain.ms) / trees))
        self.samples += 1

    def _host(self, requests: int | None) -> tuple[float, float]:
        """(overhead, per_tree) ms at this batch size: its own once measured, else over all."""
        overhead, per_tree = self.overhead.ms, self.per_tree.ms
        if requests is not None:
            mine = self.host_by_batch.get(self.batch_bucket(requests))
            if mine is not None:
                if mine[0].n >= self.MIN_SAMPLES:
                    overhead = mine[0].ms
                if mine[1].n >= self.MIN_SAMPLES:
                    per_tree = mine[1].ms
        return overhead, per_tree

    # ---- estimates ----------------------------------------------------------------------
    def _known(self) -> list[tuple[int, float]]:
        """The measured (rows, ms) points over all steps, made non-decreasing in rows."""
        return monotone(sorted((b, s.ms, s.n) for b, s in self.rows.items()
                               if s.n >= self.MIN_SAMPLES))

    def _tree_curve(self, requests: int) -> tuple[float, list[tuple[int, float]], float] | None:
        """(plain forward ms, [(tree rows, extra ms)] from (0, 0), non-decreasing, the slope
        past its last point) at this batch size, once both were measured; else None.

        Past the largest node count measured the extra cost grows by the steepest of: the
        last segment between two measured counts, the chord from the first measured count
        to the last (where the monotone fit pooled the last counts into a flat end: at 16
        requests a curve flat past 42 nodes had priced 119 nodes at 71 ms that took 490),
        and what one more decoding request adds. Not along the segment from no tree rows:
        a tree's first row carries the fixed cost of having a tree at all (at 4 requests a
        one-node tree measured at +9 ms, extended so, priced 12 nodes at +110 ms that take
        about +42, and no larger tree was ever tried)."""
        plain = self.plain_forward_ms(requests)
        if plain is None:
            return None
        # every measured node count counts (weighted by its samples in ``monotone``): at
        # large batches trees are sent on few steps, with node counts that seldom repeat, and
        # waiting for two samples of one count left the curve over all steps in charge, which
        # prefill rows make cheap (in a served run at 16 clients: tree steps taken 20 % longer
        # than predicted, throughout)
        pts = sorted((b, s.ms, s.n) for b, s in self.tree_rows.get(
            self.batch_bucket(requests), {}).items())
        if not pts:
            return None
        curve = monotone([(0, 0.0, 1 << 30)] + pts)
        slopes = [self._decode_slope(requests, plain) or 0.0]
        measured = curve[1:]
        if len(measured) >= 2:
            (b0, y0), (b1, y1), (b2, y2) = measured[0], measured[-2], measured[-1]
            slopes += [(y2 - y0) / (b2 - b0), (y2 - y1) / (b2 - b1)]
        return plain, curve, max(slopes)

    def plain_forward_ms(self, requests: int) -> float | None:
        """Forward ms of a plain decode step of ``requests`` requests: measured at that
        batch size or interpolated between the batch sizes measured around it (a step's cost
        grows about linearly with its requests); None outside them. A tree step is costed
        as this plus what its rows add, so without it a tree cannot be costed: in a served
        run at 16 clients the first 14 steps carried trees before any plain step of 16 was
        seen, priced by the curve over all steps at 120-135 ms for 11-41 nodes, and took
        up to 255."""
        key = self.bucket(requests)
        st = self.decode.get(key)
        if st is not None:
            return st.ms
        pts = monotone(sorted((b, s.ms, s.n) for b, s in self.decode.items()))
        if not pts or not pts[0][0] < key < pts[-1][0]:
            return None
        return curve_at(pts, key)

    def _decode_slope(self, requests: int, plain: float) -> float | None:
        """Ms one more decoding request adds to a plain step of ``requests`` (forward
        ``plain``): the chord from the smallest batch measured; None without one."""
        smaller = [(b, st.ms) for b, st in self.decode.items() if b < requests]
        if not smaller:
            return None
        b0, ms0 = min(smaller)
        return max(0.0, (plain - ms0) / (requests - b0))

    def forward_ms(self, rows: int, known: list[tuple[int, float]] | None = None) -> float:
        """Estimated forward ms of a step with ``rows`` rows (``known``: ``self._known()``,
        passed by callers that ask for many row counts at once)."""
        rows = max(1, rows)
        known = self._known() if known is None else known
        if not known:
            base = next(iter(self.rows.values())).ms if self.rows else 1.0
            return base * (1.0 + self.prior_slope * (rows - 1))
        if rows < known[0][0]:  # below every measurement: scale down along the prior slope
            b, ms = known[0]
            return ms * (1.0 + self.prior_slope * (rows - 1)) / (1.0 + self.prior_slope * (b - 1))
        if len(known) == 1 and rows > known[0][0]:  # above the only one: the prior slope
            b, ms = known[0]
            return ms + ms * self.prior_slope / (1.0 + self.prior_slope * (b - 1)) * (rows - b)
        return curve_at(known, rows)

    def _forward_range(self, lo: int, hi: int, requests: int | None) -> list[float]:
        """Forward ms for rows = lo .. hi: at a batch of ``requests`` decoding requests with
        ``rows - requests`` tree rows where that was measured, else from the curve over all
        steps."""
        curve = self._tree_curve(requests) if requests is not None and lo >= requests else None
        if curve is None:
            known = self._known()
            out = [self.forward_ms(r, known) for r in range(lo, hi + 1)]
            plain = self.plain_forward_ms(requests) if requests is not None else None
            slope = self._decode_slope(requests, plain) if plain is not None else None
            if slope is not None:
                # no tree step measured at this batch size yet: a tree row costs at least
                # what one more decoding request adds (the curve over all steps, made cheap
                # by prefill rows, had put a first tree step at 16 requests at 151 ms that
                # took 279)
                out = [max(f, plain + slope * (r - requests))
                       for f, r in zip(out, range(lo, hi + 1))]
            return out
        plain, extra, tail_slope = curve
        return [plain + curve_at(extra, r - requests, tail_slope) for r in range(lo, hi + 1)]

    def step_ms_range(self, lo: int, hi: int, requests: int | None = None) -> list[float]:
        """``overhead + forward(rows)`` for rows = lo .. hi (no per-tree host time), at a
        batch of ``requests`` (None: over all batch sizes)."""
        overhead = self._host(requests)[0]
        return [overhead + f for f in self._forward_range(lo, hi, requests)]

    @property
    def overhead_ms(self) -> float:
        return self.overhead.ms

    @property
    def per_tree_ms(self) -> float:
        return self.per_tree.ms

    def per_tree_ms_at(self, requests: int | None) -> float:
        return self._host(requests)[1]

    def request_share(self, requests: int) -> float:
        """The share of a plain step of ``requests`` decoding requests that one of them
        adds (what the step saves once one of them is done)."""
        if requests <= 1:
            return 0.0
        full = self.step_ms(requests, requests=requests)
        return max(0.0, full - self.step_ms(requests - 1, requests=requests - 1)) / max(full, 1e-6)

    def step_ms(self, rows: int, trees: int = 0, requests: int | None = None) -> float:
        overhead, per_tree = self._host(requests)
        return overhead + trees * per_tree + self._forward_range(rows, rows, requests)[0]

    # ---- persistence --------------------------------------------------------------------
    def save(self, path: str | os.PathLike | None = None) -> None:
        path = Path(path) if path is not None else self.path
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"rows": _dump(self.rows), "overhead": [self.overhead.ms, self.overhead.n],
                "per_tree": [self.per_tree.ms, self.per_tree.n],
                "host_by_batch": {str(b): [[o.ms, o.n], [t.ms, t.n]]
                                  for b, (o, t) in sorted(self.host_by_batch.items())},
                "decode": _dump(self.decode),
                "tree_rows": {str(k): _dump(t) for k, t in sorted(self.tree_rows.items())}}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    @classmethod
    def _prior(cls, saved) -> _Stat:
        ms, n = saved
        return _Stat(float(ms), min(int(n), cls.MIN_SAMPLES))

    @classmethod
    def _load_table(cls, saved: dict) -> dict[int, _Stat]:
        return {int(b): cls._prior(v) for b, v in saved.items()}

    def load(self, path: str | os.PathLike) -> None:
        try:
            data = json.loads(Path(path).read_text())
            # a loaded curve is a prior: it counts as at most MIN_SAMPLES samples per bucket,
            # so this engine's own steps take over quickly
            self.rows = self._load_table(data["rows"])
            self.overhead = self._prior(data["overhead"])
            self.per_tree = self._prior(data.get("per_tree", (0.0, 0)))
            self.decode = self._load_table(data.get("decode", {}))
            self.tree_rows = {int(k): self._load_table(t)
                              for k, t in data.get("tree_rows", {}).items()}
            self.host_by_batch = {int(b): (self._prior(o), self._prior(t))
                                  for b, (o, t) in data.get("host_by_batch", {}).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            # a broken cache is no cache
            self.rows, self.overhead, self.per_tree = {}, _Stat(0.0, 0), _Stat(0.0, 0)
            self.host_by_batch, self.decode, self.tree_rows = {}, {}, {}


@dataclass
class Allocation:
    verify: list[list[int]]   # per request: the verify node indices kept (ascending)
    draft: list[int]          # per request: draft rows kept
    rows: int
    pays: bool = False        # the trees beat plain decoding even counting their drafting
    # what the budget expected (unscaled by ``Calibration``): accepted tokens per request
    # from its verify nodes, and the step's milliseconds (drafting left out)
    expected: list[float] = field(default_factory=list)
    step_ms: float = 0.0
    deepest: int = 0          # the depth of the deepest verify node kept (0: none)
    branching: int = 0        # the k an expansion needs for the kept trees (kept_branching)


def allocate(values: list[list[float]], parents: list[list[int]], draft_values: list[float],
             draft_caps: list[int], base_rows: int, num_requests: int,
             cost: StepCostModel, drafting_ms: float = 0.0,
             weights: list[float] | None = None, time_ratio: float = 1.0,
             token_ratio: float = 1.0, critical_lead: float = math.inf) -> Allocation:
    """The nodes that maximise expected (weighted) tokens per millisecond this step.

    ``values[r][i]``: P(request r's verify node i is accepted); ``parents[r][i]`` its parent
    (-1: the root); ``draft_values[r]``: expected tokens per draft row of request r, at most
    ``draft_caps[r]`` rows; ``base_rows``: the step's rows besides tree nodes (one root per
    decoding request, and any prefill rows); ``num_requests``: the bonus tokens.
    ``drafting_ms``: what making the trees cost this step (already spent; ``pays`` says
    whether the chosen trees beat plain decoding with it counted). The cost model's
    overheads leave drafting out: it is charged here, where it is known.

    ``weights``: None counts tokens (a plain step is worth ``num_requests``); else
    ``weights[r]`` is what a token of request r is worth in steps of the batch
    (``makespan_weights``), and a plain step is worth one step. The requests of the largest
    weight are the batch's critical path: the batch ends one step sooner only when every
    one of them gains a token, so they are worth the least of their expected gains, not
    their mean (with the mean, trees at batch 4 ran at 1.20x plain decoding's tokens per
    ms and the batches ended no sooner), and at most ``critical_lead`` steps
    (``makespan_lead``; the sum of expected tokens capped, an upper bound of the expected
    capped gain). ``time_ratio`` and
    ``token_ratio`` (``Calibration``) scale what a step with trees takes and what its nodes
    bring; ``expected`` and ``step_ms`` in the result are the unscaled estimates."""
    w = [1.0] * len(values) if weights is None else weights
    base = float(num_requests) if weights is None else 1.0  # a plain step's worth
    items: list[tuple[float, int, int, int, int]] = []  # (-worth, depth, request, kind, index)
    depths: list[list[int]] = [[] for _ in values]
    for r, vals in enumerate(values):
        if w[r] <= 0.0:
            continue
        depth = depths[r] = node_depths(parents[r][: len(vals)])
        for i, v in enumerate(vals):
            items.append((-v * w[r], depth[i], r, 0, i))
        for j in range(draft_caps[r]):  # after equal-valued nodes
            items.append((-draft_values[r] * w[r], 1_000 + j, r, 1, j))
    items.sort()
    step_ms = cost.step_ms_range(base_rows, base_rows + len(items), num_requests)
    per_tree = cost.per_tree_ms_at(num_requests)
    plain_rate = base / step_ms[0]
    top = max(w) if weights is not None and w else 0.0
    # the critical path's expected tokens per request (closed batches), the rest's worth
    critical = {r: 0.0 for r, wr in enumerate(w) if top > 0.0 and wr >= top}
    other = 0.0
    best_k, best_rate, best_trees, best_worth = 0, plain_rate, 0, 0.0
    with_tree: set[int] = set()
    for k, it in enumerate(items, start=1):
        r = it[2]
        if r in critical:
            critical[r] += -it[0] / w[r]
        else:
            other += -it[0]
        gain = min(min(critical.values()), critical_lead) if critical else 0.0
        worth = (other + gain) * token_ratio
        with_tree.add(r)
        rate = (base + worth) / ((step_ms[k] + len(with_tree) * per_tree) * time_ratio)
        if rate > best_rate:
            best_k, best_rate, best_trees, best_worth = k, rate, len(with_tree), worth
    if best_rate < plain_rate * (1.0 + MARGIN):
        best_k, best_rate, best_trees, best_worth = 0, plain_rate, 0, 0.0
    keep_v: list[list[int]] = [[] for _ in values]
    keep_d = [0] * len(values)
    expected = [0.0] * len(values)
    for v, _, r, kind, i in items[:best_k]:
        if kind == 0:
            expected[r] -= v / w[r]
            keep_v[r].append(i)
        else:
            keep_d[r] += 1
    for r, kept in enumerate(keep_v):
        kept.sort()
        # ties in value are broken by depth, so a parent is always ranked before its child;
        # keep the set closed under parents all the same (values from outside may tie oddly)
        have = set(kept)
        keep_v[r] = [i for i in kept if all_ancestors_in(parents[r], i, have)]
    deepest = max((depths[r][i] for r, kept in enumerate(keep_v) for i in kept), default=0)
    branching = max((kept_branching(parents[r], depths[r], kept)
                     for r, kept in enumerate(keep_v) if kept), default=0)
    # drafting was spent this step either way; ``pays``: the trees beat plain decoding with
    # their drafting counted, so drafting is worth running again next step. (Asking MARGIN
    # here too, with every miss pausing drafting for 1.5 % of the time, held PCTree's chain
    # at batch 1 to 1.20x from 1.37x in one run: its trees pay there though their estimates
    # are close to the line.)
    pays = best_k > 0 and (base + best_worth) / (
        (base + best_worth) / best_rate + drafting_ms) > plain_rate
    return Allocation(keep_v, keep_d, base_rows + best_k, pays=pays,
                      expected=expected, step_ms=step_ms[best_k] + best_trees * per_tree,
                      deepest=deepest, branching=branching)


def kept_branching(parents: list[int], depths: list[int], kept: list[int]) -> int:
    """The branching k a PCTree-style expansion (at most k parents per depth, at most k
    children each) needs to hold the kept nodes: the most kept children of one node, or the
    most nodes of one depth with kept children (the root at depth 0); 0 for none kept."""
    children = Counter(parents[i] for i in kept)
    if not children:
        return 0
    parents_at = Counter(depths[p] if p >= 0 else 0 for p in children)
    return max(max(children.values()), max(parents_at.values()))


def all_ancestors_in(parents: list[int], i: int, have: set[int]) -> bool:
    p = parents[i]
    while p >= 0:
        if p not in have:
            return False
        p = parents[p]
    return True


class Calibration:
    """How the budget's estimates came out, per batch size (``batch_bucket``): the ms that
    steps with trees took against the ms predicted, and the tokens their nodes brought
    against the tokens expected. Each is a ratio of sums, shrunk toward 1 by ``PRIOR_STEPS``
    steps that came out as estimated, and bounded.

    The nodes and row counts a step picks are those whose estimates look best, so their
    estimates err on the bright side (in runs here, at 4-8 requests: steps 10-15 % longer
    than predicted, 80-90 % of the expected tokens), while the trees pay only by a few
    per cent on paper; at batch 1, where rows are nearly free, the same errors cost little.

    The sums forget: each observation weighs the earlier ones down by ``1 - 1 / MEMORY``,
    and every engine step by ``1 - 1 / STEP_MEMORY``, so a bad stretch (a served engine's
    first 65 trees brought 3 of 55 expected tokens, later ones 35-56 % of their nodes; an
    offline engine after the benchmark's warm-up on reversed prompts) stops holding trees
    back, even when it held them back so well that no later tree could show otherwise."""

    PRIOR_STEPS = 8
    BOUNDS = (0.25, 4.0)
    MEMORY = 64

    def __init__(self, clock: EngineClock | None = None) -> None:
        # bucket -> [predicted ms, taken ms, steps, engine step of the last update]
        self.time: dict[int, list[float]] = {}
        # bucket -> [expected, accepted, steps, engine step of the last update]
        self.tokens: dict[int, list[float]] = {}
        self.clock = clock or EngineClock()

    def _add(self, table: dict[int, list[float]], requests: int, estimate: float,
             outcome: float) -> None:
        add_to_cell(table, StepCostModel.batch_bucket(requests), [estimate, outcome, 1.0],
                    self.clock.steps, keep=1.0 - 1.0 / Calibration.MEMORY)

    def observe_time(self, requests: int, predicted_ms: float, taken_ms: float) -> None:
        if predicted_ms > 0 and taken_ms > 0:
            self._add(self.time, requests, predicted_ms, taken_ms)

    def observe_tokens(self, requests: int, expected: float, accepted: float) -> None:
        if expected > 0:
            self._add(self.tokens, requests, expected, accepted)

    def _ratio(self, table: dict[int, list[float]], requests: int) -> float:
        cell = table.get(StepCostModel.batch_bucket(requests))
        if cell is None or cell[2] == 0:
            return 1.0
        est, out, n = faded_cell(cell, 3, self.clock.steps)
        prior = self.PRIOR_STEPS * est / n  # PRIOR_STEPS average steps, as estimated
        lo, hi = self.BOUNDS
        return min(hi, max(lo, (out + prior) / (est + prior)))

    def time_ratio(self, requests: int) -> float:
        return self._ratio(self.time, requests)

    def token_ratio(self, requests: int) -> float:
        return self._ratio(self.tokens, requests)


class RealizedGain:
    """What drafting has brought at each batch size (``StepCostModel.batch_bucket``),
    measured on the engine's own steps rather than estimated: the milliseconds its accepted
    tokens saved (each at a plain step's ms per token of its batch size) against the
    milliseconds it cost (every proposal's drafting, the rows it caught up on included, and
    each decode-only tree step's time beyond a plain step). ``pays`` says whether the
    savings beat the cost by ``REALIZED_MARGIN``.

    Why a margin on what was measured, besides the budget's estimates: the budget sends a
    tree when its estimate beats a plain step with drafting counted, and calibrates those
    estimates on outcomes; where trees only break even that way, what its step accounting
    does not see decides. At 4 requests in bf16 here PCTree's trees and drafting came out
    at 1.000x its own plain steps (savings 2.0 s against 2.0 s of cost), and its engine ran
    at 0.92x plain decoding against 0.98x with the same engine sending no tree (closed
    batches in separate engine processes): the requests the trees sped up left the batch
    early and its slowest decoded alone for longer (its steps of one and two requests took
    4.5 s against 2.5 s), and its plain steps ran 2 % slower. Where trees paid run after
    run the savings were 1.5-2.8x the cost (PCTree and PTD at 4 requests in fp32, PTD at 4
    in bf16, served or offline); where they broke even or lost, 0.5-1.3x (PCTree at 4
    requests in bf16, served or offline, PTD at 8-31 requests served in bf16);
    ``python -m vllm_ptd.bench.trace_steps <trace> --realized`` reads them off a trace.

    Sums fade as ``Calibration``'s do (each tree step weighs the earlier ones down by
    ``1 - 1 / MEMORY``, every engine step by ``1 - 1 / STEP_MEMORY``), and a batch size
    starts from ``PRIOR_STEPS`` plain steps of cost at a gain of ``1 + 2 * REALIZED_MARGIN``:
    drafting starts everywhere, and where it stopped paying it is tried again now and then
    (``TreeBudget``'s pauses after misses) and resumes once what it brings shows."""

    # two plain steps of cost: two or three tries whose trees bring nothing do not stop
    # drafting at a new batch size (a try costs drafting and some rows; at batch 1 in bf16
    # here about a fifth of a plain step)
    PRIOR_STEPS = 2.0
    MEMORY = 64

    def __init__(self, clock: EngineClock | None = None,
                 margin: float | None = REALIZED_MARGIN) -> None:
        self.margin = margin  # None: ``pays`` always (the estimates alone decide)
        # bucket -> [saved ms, cost ms, engine step of the last update]
        self.sums: dict[int, list[float]] = {}
        self.clock = clock or EngineClock()

    def _add(self, requests: int, saved_ms: float, cost_ms: float, keep: float) -> None:
        add_to_cell(self.sums, StepCostModel.batch_bucket(requests), [saved_ms, cost_ms],
                    self.clock.steps, keep)

    def observe_drafting(self, requests: int, ms: float) -> None:
        """A proposal for a batch of ``requests`` took ``ms`` (catch-up included)."""
        if ms > 0:
            self._add(requests, 0.0, ms, 1.0)

    def observe_tree_step(self, requests: int, accepted: int, taken_ms: float,
                          plain_ms: float) -> None:
        """A decode-only step of ``requests`` with trees took ``taken_ms`` (drafting left
        out) and gained ``accepted`` tokens; a plain step of that batch takes ``plain_ms``."""
        if requests > 0 and plain_ms > 0:
            self._add(requests, accepted * plain_ms / requests, taken_ms - plain_ms,
                      1.0 - 1.0 / self.MEMORY)

    def gain(self, requests: int, plain_ms: float) -> float:
        """Saved over cost at this batch size, the prior counted (``plain_ms``: a plain
        step of it, the prior's scale)."""
        prior_cost = self.PRIOR_STEPS * max(plain_ms, 1e-6)
        prior_saved = prior_cost * (1.0 + 2.0 * (self.margin or 0.0))
        saved, cost = faded_cell(self.sums.get(StepCostModel.batch_bucket(requests)), 2,
                                 self.clock.steps)
        return (saved + prior_saved) / max(cost + prior_cost, 1e-6)

    def pays(self, requests: int, plain_ms: float) -> bool:
        return self.margin is None or self.gain(requests, plain_ms) >= 1.0 + self.margin


class TreeBudget:
    """Sizes a step's trees (``size``) and decides whether drafting is worth running at all
    (``should_draft``), as n-gram drafting sends nothing when nothing matches. A proposal
    whose trees do not beat plain decoding (drafting cost included) is a miss:

    * every miss pauses drafting long enough that failed drafting costs at most
      ``EXPLORE_SHARE`` of the engine's time, counting only the share of tries that miss
      at this batch size (``StepCostModel.batch_bucket``; hits over tries,
      ``(hits + PRIOR_TRIES / 2) / (tries + PRIOR_TRIES)`` over about the last
      ``HIT_MEMORY`` tries). Where fewer
      than half the tries pay, that share shrinks with the hit rate, down to
      ``MIN_EXPLORE`` of it: a try is worth what the chance it pays makes it. A drafter
      that costs as much as a step and never pays, like PCTree's on a CPU at 16 requests,
      then tries about once in 100 steps once its misses add up (priced with the rows a
      try catches up on: see ``size``); one whose tries mostly pay, like PCTree's at
      batch 1, is hardly paused by a miss; PTD's drafting, a fraction of a millisecond, is
      never paused for this. Why: in served runs here, PCTree's tries at 3 % of the time
      regardless of its hits were all it lost to plain decoding at 16 clients, and at 1.5 %
      of the time counting its misses they were still most of it (17 tries of a median
      55 ms in three rounds, none followed by a tree), while 1.5 % regardless of its hits
      (with a margin on ``pays``) held its chain at batch 1 to 1.20x from 1.37x;
    * after ``MISSES`` misses whose trees went out with no paying proposal between them,
      drafting also pauses for 2, 4, ... up to ``MAX_PAUSE`` steps (with ``miss_backoff``
      "all", after any ``MISSES`` misses in a row). Why only those: a proposal that found
      nothing worth sending cost its drafting alone, which the pause above already prices,
      while a pause blinds the method to what the next steps would match. Counting them,
      PTD on an AVX2-only CPU (a row 12 % of a step at batch 1) sat paused in 18 % of its
      decode steps at batch 1 (``docs/results/avx2_fp32_b1_f6b07fb``): after four steps
      without a match worth its rows it looked again only after 2, 4, ... 64 steps, where
      vLLM's ngram looks at every step. Side by side there (``avx2_fp32_b1_backoff_1e8aa4e``)
      PTD then sat paused in 5 % of its steps against 12 % and ran level (1.27x both): the
      skipped steps held next to no match worth a row; PCTree sent 256 trees against 176
      (1.04x against 1.01x, within the spread);
    * a proposal counts as a miss, whatever its estimate, while what drafting brought at
      this batch size, measured, does not beat what it cost by ``REALIZED_MARGIN``
      (``RealizedGain``): its trees still go out, and show whether that has changed.

    A proposal that pays ends both pauses."""

    MISSES = 4
    MAX_PAUSE = 64
    EXPLORE_SHARE = 0.015
    MIN_EXPLORE = 0.25
    HIT_MEMORY = 16
    PRIOR_TRIES = 4.0  # before any try at a batch size: this many, half of them hits
    # levels (or degrees of branching) the reach of the kept trees loses per sizing
    # (draft_depth, draft_branching)
    REACH_FADE = 0.125

    def __init__(self, cost: StepCostModel, acceptance: AcceptanceModel | None = None,
                 realized_margin: float | None = REALIZED_MARGIN,
                 miss_backoff: str = MISS_BACKOFFS[0]) -> None:
        if miss_backoff not in MISS_BACKOFFS:
            raise ValueError(f"miss_backoff {miss_backoff!r}: allowed {list(MISS_BACKOFFS)}")
        self.cost = cost
        self.miss_backoff = miss_backoff
        self.clock = EngineClock()  # one clock: both models' evidence fades with the same steps
        self.acceptance = acceptance or AcceptanceModel()
        self.acceptance.clock = self.clock
        self.calibration = Calibration(self.clock)
        self.realized = RealizedGain(self.clock, realized_margin)
        self._misses = 0
        self._pause = 1
        self._skip = 0
        # batch bucket -> [tries whose trees paid, tries], each weighing the earlier ones
        # down by 1 - 1 / HIT_MEMORY
        self._tries: dict[int, list[float]] = {}
        # batch bucket -> the depth of the deepest node kept lately (draft_depth)
        self._reach: dict[int, float] = {}
        # batch bucket -> the branching of the kept trees lately (draft_branching)
        self._branching: dict[int, float] = {}
        self.last: Allocation | None = None

    def should_draft(self) -> bool:
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    def draft_depth(self, num_requests: int) -> int | None:
        """How deep the next proposal at this batch size should draft: one level below
        the deepest node kept lately there (None before its first sizing: no limit). The
        reach is the depth of the deepest kept node, or, when that is shallower, the last
        reach less ``REACH_FADE``: one deep tree keeps drafting deep for a while, and
        a tree kept to the last level drafted lets the next proposal go one deeper. Why:
        a drafter block costs in proportion to its rows (``TreeMethod.propose``), and at
        4 requests the budget kept a median of one or two nodes of a request's 15."""
        reach = self._reach.get(StepCostModel.batch_bucket(num_requests))
        return None if reach is None else math.ceil(reach) + 1

    def draft_branching(self, num_requests: int) -> int | None:
        """How wide the next proposal at this batch size should branch (PCTree's k: the
        parents expanded per depth and the children of each): one more than the branching
        of the trees kept lately there (``kept_branching``; None before its first sizing:
        the method's own), fading as ``draft_depth`` does. Why: a wider expansion costs
        more (at 4 requests in bf16 here k = 4 took 0.8 ms more a proposal than k = 1, an
        eighth of it), and where rows cost a few per cent each the budget keeps one to three
        nodes of a request's tree: there the trees then needed k = 2 (the median) and a
        proposal of 4 requests took a median 6.7 ms, against 8.4 ms with PCTree's
        ``draft_shape: "full"`` and 6.2 ms for its chain in the same run; at batch 1, where
        the budget keeps wide trees, k stayed 4 in most proposals. One more than the
        branching kept lets a wider tree show that it pays."""
        branching = self._branching.get(StepCostModel.batch_bucket(num_requests))
        return None if branching is None else math.ceil(branching) + 1

    def _kept_reach(self, num_requests: int, deepest: int, branching: int) -> None:
        bucket = StepCostModel.batch_bucket(num_requests)
        for table, kept in ((self._reach, deepest), (self._branching, branching)):
            last = table.get(bucket)
            table[bucket] = float(kept) if last is None else max(
                float(kept), last - self.REACH_FADE)

    def _tried(self, num_requests: int, paid: bool) -> float:
        """Counts a try at this batch size; the share of tries that paid there."""
        bucket = StepCostModel.batch_bucket(num_requests)
        keep = 1.0 - 1.0 / self.HIT_MEMORY
        hits, tries = (x * keep for x in self._tries.get(bucket, (0.0, 0.0)))
        hits, tries = hits + (1.0 if paid else 0.0), tries + 1.0
        self._tries[bucket] = [hits, tries]
        return (hits + self.PRIOR_TRIES / 2) / (tries + self.PRIOR_TRIES)

    def _missed(self, try_ms: float, base_rows: int, num_requests: int, sent: bool) -> None:
        """A try that did not pay (``sent``: its trees went out all the same)."""
        plain_ms = max(self.cost.step_ms(base_rows, requests=num_requests), 1e-6)
        hit_rate = self._tried(num_requests, paid=False)
        # the full share while half the tries or more pay (as the prior has it), less below
        share = self.EXPLORE_SHARE * max(self.MIN_EXPLORE, min(1.0, hit_rate / 0.5))
        self._skip = max(0, math.ceil((1.0 - hit_rate) * try_ms / (share * plain_ms)) - 1)
        if not sent and self.miss_backoff == "trees":
            return
        self._misses += 1
        if self._misses >= self.MISSES:
            self._misses = 0
            self._skip = max(self._skip, self._pause)
            self._pause = min(2 * self._pause, self.MAX_PAUSE)

    def size(self, req_ids: list[str], trees: list[FlatTree], base_rows: int,
             num_requests: int, drafting_ms: float = 0.0,
             weights: list[float] | None = None, catch_up_ms: float = 0.0,
             critical_lead: float = math.inf, paused_ms: float = 0.0) -> list[FlatTree]:
        """Each request's tree cut to what pays (``weights``, ``critical_lead``: see
        ``allocate``); none while
        a plain step of this batch size is not known (``StepCostModel.plain_forward_ms``):
        it is measured on the next step, and drafting goes on (no miss). ``drafting_ms``:
        what drafting again next step would cost; ``catch_up_ms``: what this proposal spent
        beyond it on rows earlier steps left (a pause's, a new prompt's), which only the
        pause after a miss counts in full; ``paused_ms``: the part of it on a pause's rows,
        which the measured gain (``RealizedGain``) leaves out. Why: drafting at every step
        never pays for a pause's rows, and charged to what drafting brings at this batch
        size they made every try after a pause look worse than drafting at every step would
        be (PCTree in continuous batches of 4 in fp32 here: a try after a pause put up to 64
        rows a request into its drafter's contexts, 13-19 ms against 5-7 ms for a proposal
        right after another)."""
        if self.cost.plain_forward_ms(num_requests) is None:
            self.last = Allocation([[] for _ in trees], [0] * len(trees), base_rows,
                                   expected=[0.0] * len(trees))
            return [t.select([], 0) for t in trees]
        values = [self.acceptance.unconditional(r, t) for r, t in zip(req_ids, trees)]
        parents = [t.parents[: t.num_verify] for t in trees]
        draft_caps = [t.num_nodes - t.num_verify for t in trees]
        draft_values = [t.draft_value or 0.0 for t in trees]
        alloc = allocate(values, parents, draft_values, draft_caps, base_rows, num_requests,
                         self.cost, drafting_ms, weights,
                         self.calibration.time_ratio(num_requests),
                         self.calibration.token_ratio(num_requests), critical_lead)
        self.last = alloc
        self._kept_reach(num_requests, alloc.deepest, alloc.branching)
        self.realized.observe_drafting(num_requests, drafting_ms + catch_up_ms - paused_ms)
        plain_ms = self.cost.step_ms(num_requests, requests=num_requests)
        if alloc.pays and self.realized.pays(num_requests, plain_ms):
            self._misses, self._pause = 0, 1
            self._tried(num_requests, paid=True)
        else:
            # what the failed try cost, the rows it caught up on included: ``pays`` leaves
            # them out (whichever proposal comes first pays them), but a try after a pause
            # pays them again, so each isolated try costs them (at 16 requests here a try's
            # catch-up was more than half of its 25-30 ms, and pauses priced without it let
            # tries run every 14-39 steps, 1.3 % of the time, where none paid)
            sent = alloc.rows > base_rows  # some node or draft row kept
            self._missed(drafting_ms + catch_up_ms, base_rows, num_requests, sent)
        return [t.select(v, d) for t, v, d in zip(trees, alloc.verify, alloc.draft)]

    def observe(self, req_id: str, tree: FlatTree, accepted: list[int]) -> None:
        self.acceptance.observe(req_id, tree, accepted)

    def observe_step(self, rows: int, forward_ms: float, overhead_ms: float | None,
                     trees: int, requests: int, nodes: int, predicted_ms: float,
                     taken_ms: float, accepted: int = 0) -> None:
        """One step's times (``StepCostModel.observe``), and for a decode-only step with
        trees what the sizing predicted against what it took (a prefill beside the trees is
        no error of the estimate) and what its ``accepted`` tokens saved against the time
        it took beyond a plain step (``RealizedGain``)."""
        self.cost.observe(rows, forward_ms, overhead_ms, trees=trees, requests=requests,
                          nodes=nodes)
        self.clock.steps += 1
        if trees and overhead_ms is not None and decode_only(rows, requests, nodes):
            self.calibration.observe_time(requests, predicted_ms, taken_ms)
            self.realized.observe_tree_step(requests, accepted, taken_ms,
                                            self.cost.step_ms(requests, requests=requests))

    def forget(self, req_id: str) -> None:
        self.acceptance.forget(req_id)
