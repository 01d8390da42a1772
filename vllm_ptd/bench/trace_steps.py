"""Steps of a proposer trace grouped by how many requests they ran and whether any carried a
tree: mean rows, wall, forward, verification and host ms (``VLLM_PTD_TRACE`` step records;
the engine's waits between calls left out, ``aggregate.busy_steps``); and how the budget's estimates
came out on its decode-only tree steps, and what decoding gained over the engine's own plain
steps with drafting counted (``budget_outcomes``, ``decode_speedup``); and how the trees of
requests whose earlier trees had brought more or less than expected came out
(``request_ratio_buckets``); and what the share of offered nodes that were accepted would
have been had the trees expected to bring fewer tokens than a floor not been sent, and the
accepted tokens that would have cost (``share_floors``); and per batch size what drafting
saved against what it cost, as the budget's ``RealizedGain`` measures it (``realized_gain``).

  python -m vllm_ptd.bench.trace_steps results/bs4_16/traces/ptd.jsonl [--requests 16]
  python -m vllm_ptd.bench.trace_steps results/serving/traces/ptd.jsonl --outcomes --min-requests 4
  python -m vllm_ptd.bench.trace_steps results/bs4/traces/pctree.jsonl --tries
  python -m vllm_ptd.bench.trace_steps results/b1/traces/ptd.jsonl --request-ratios
  python -m vllm_ptd.bench.trace_steps results/b1/traces/ptd.jsonl --share-floors 0.5,1
  python -m vllm_ptd.bench.trace_steps results/bs4/traces/pctree.jsonl --realized
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
from collections import defaultdict

from vllm_ptd.bench.aggregate import busy_steps, is_busy
from vllm_ptd.budget import AcceptanceModel, StepCostModel


def step_records(lines) -> list[dict]:
    """The step records of a trace's lines (request records left out)."""
    return [json.loads(line)["step"] for line in lines if line.startswith('{"step"')]


def request_records(lines) -> list[dict]:
    """The request records of a trace's lines (one per request and tree step), in order."""
    return [json.loads(line) for line in lines if line.startswith('{"req"')]


def step_groups(lines, requests: int | None = None) -> dict[tuple[int, bool], dict]:
    """``{(requests, with trees): {"steps", "rows", "wall", "forward", "verify", "drafting",
    "host", "busy_s", "accepted"}}``: means per step, but for busy_s (the group's summed
    wall, in seconds) and accepted (its accepted nodes, summed); drafting = the method's
    ``observe`` and ``propose`` (the proposer's step clock); host = wall - forward -
    drafting (vLLM's and the proposer's host work)."""
    records = step_records(lines)
    groups: dict[tuple[int, bool], list[dict]] = defaultdict(list)
    for s in busy_steps(records):
        if "requests" in s and requests in (None, s["requests"]):
            groups[(s["requests"], s["trees"] > 0)].append(s)
    out = {}
    for key, steps in sorted(groups.items()):
        n = len(steps)

        def mean(k: str) -> float:
            return sum(s[k] for s in steps) / n

        g = out[key] = {"steps": n, "rows": mean("rows"), "wall": mean("wall_ms"),
                        "forward": mean("forward_ms"), "verify": mean("verify_ms"),
                        "drafting": mean("drafting_ms"),
                        "busy_s": sum(s["wall_ms"] for s in steps) / 1000,
                        "accepted": sum(s.get("accepted", 0) for s in steps)}
        g["host"] = g["wall"] - g["forward"] - g["drafting"]
    return out


def decode_only_step(s: dict, min_requests: int = 1) -> bool:
    """An engine step at work that ran only decoding requests (each its root and tree
    nodes), at least ``min_requests`` of them."""
    r = s.get("requests")
    return r is not None and r >= min_requests and is_busy(s) \
        and s["rows"] == r + s.get("nodes", 0)


def plain_step_ms(steps: list[dict]) -> dict[int, float]:
    """Mean ms (wall less drafting) of the decode-only steps without trees, per batch size."""
    plain: dict[int, list[float]] = defaultdict(list)
    for s in steps:
        if decode_only_step(s) and not s["trees"]:
            plain[s["requests"]].append(s["wall_ms"] - s.get("drafting_ms", 0.0))
    return {r: sum(v) / len(v) for r, v in plain.items()}


def decode_speedup(steps: list[dict], min_requests: int = 1) -> dict:
    """What decoding gained over the same engine's plain steps once the drafter's cost is
    counted: every decode-only step (``decode_only_step``) of a batch size that also ran
    plain steps, with or without trees (a try that sent no tree included); each step's
    tokens (``requests`` + ``accepted``) priced at the plain steps' ms per token of its
    batch size (their wall less drafting), against the wall it took. Robust to a machine
    that slows down for a while, as both sides come from the same steps' neighbourhood."""
    steps = [s for s in steps if decode_only_step(s, min_requests)]
    plain = plain_step_ms(steps)
    out = {"steps": 0, "tokens": 0, "wall_ms": 0.0, "drafting_ms": 0.0,
           "plain_equivalent_ms": 0.0}
    for s in steps:
        r = s["requests"]
        if r not in plain:
            continue
        tokens = r + (s.get("accepted", 0) if s["trees"] else 0)
        out["steps"] += 1
        out["tokens"] += tokens
        out["wall_ms"] += s["wall_ms"]
        out["drafting_ms"] += s.get("drafting_ms", 0.0)
        out["plain_equivalent_ms"] += tokens * plain[r] / r
    if out["steps"]:
        out["speedup"] = out["plain_equivalent_ms"] / out["wall_ms"]
    return out


def realized_gain(lines) -> dict[int, dict]:
    """Per batch size bucket (``StepCostModel.batch_bucket``) of the decode-only steps: the
    ms the trees' accepted tokens saved (each at the mean plain step's ms per token of its
    batch size, ``plain_step_ms``), the ms drafting and the tree rows cost (the drafting of
    steps that ran a proposal, ``budget_ms`` > 0, less what it spent on rows a pause held,
    ``paused_ms``, and each tree step's wall less drafting beyond a plain step), their
    ratio (``gain``) and the tree steps. What the budget's ``RealizedGain`` weighs against
    ``realized_margin``, over the whole trace and without its fading or prior (the engine
    prices a plain step by its cost model)."""
    steps = [s for s in step_records(lines) if decode_only_step(s)]
    plain = plain_step_ms(steps)
    out: dict[int, dict] = {}
    for s in steps:
        r = s["requests"]
        if r not in plain:
            continue
        cell = out.setdefault(StepCostModel.batch_bucket(r),
                              {"saved_ms": 0.0, "cost_ms": 0.0, "tree_steps": 0})
        if s.get("budget_ms", 0.0) > 0:
            cell["cost_ms"] += s.get("drafting_ms", 0.0) - s.get("paused_ms", 0.0)
        if s["trees"]:
            cell["tree_steps"] += 1
            cell["saved_ms"] += s.get("accepted", 0) * plain[r] / r
            cell["cost_ms"] += s["wall_ms"] - s.get("drafting_ms", 0.0) - plain[r]
    for cell in out.values():  # infinite where the tree rows made steps faster than drafting cost
        cell["gain"] = (cell["saved_ms"] / cell["cost_ms"] if cell["cost_ms"] > 0
                        else math.inf if cell["saved_ms"] > 0 else None)
    return dict(sorted(out.items()))


def budget_outcomes(lines, min_requests: int = 1) -> dict:
    """Decode-only steps with trees of at least ``min_requests`` requests whose batch size
    also ran plain steps: their count, the ms the budget predicted and they took (drafting
    left out, as in ``predicted_ms``), the tokens their nodes were expected to bring
    (request records' ``expected``) and brought, nodes offered, and ``speedup``: their
    tokens per ms against the mean plain step of the same batch size, as the budget saw it
    (``predicted``) and as it came out (``realized``); ``decode``: ``decode_speedup`` of the
    same steps; ``plain_step_ms``: the mean plain step they are measured against, per batch
    size, which only another engine's trace can put in perspective
    (the budget, too, prices a tree against its own engine's plain steps). A step's request
    records precede its step record in the trace."""
    tree_steps, steps, pending = [], [], []
    for line in lines:
        d = json.loads(line)
        if "req" in d:
            pending.append(d)
            continue
        if "step" not in d:
            continue
        s, reqs, pending = d["step"], pending, []
        if not decode_only_step(s, min_requests):
            continue
        # traces before the step records carried ``accepted``: from the request records
        steps.append({**s, "accepted": sum(q["accepted"] for q in reqs)})
        if s["trees"]:
            tree_steps.append((s["requests"], s["predicted_ms"],
                               s["wall_ms"] - s.get("drafting_ms", 0.0), reqs))
    plain = plain_step_ms(steps)
    out = {"steps": 0, "predicted_ms": 0.0, "taken_ms": 0.0, "expected": 0.0, "accepted": 0,
           "offered": 0, "requests": 0, "plain_ms": 0.0}
    for r, predicted, taken, reqs in tree_steps:
        if r not in plain:
            continue
        out["steps"] += 1
        out["requests"] += r
        out["predicted_ms"] += predicted
        out["taken_ms"] += taken
        out["plain_ms"] += plain[r]
        out["expected"] += sum(max(0.0, q.get("expected", 0.0)) for q in reqs)
        out["accepted"] += sum(q["accepted"] for q in reqs)
        out["offered"] += sum(q["verify"] for q in reqs)
    if out["steps"]:
        plain_rate = out["requests"] / out["plain_ms"]
        out["speedup"] = {
            "predicted": (out["requests"] + out["expected"]) / out["predicted_ms"] / plain_rate,
            "realized": (out["requests"] + out["accepted"]) / out["taken_ms"] / plain_rate}
    out["decode"] = decode_speedup(steps)
    out["plain_step_ms"] = dict(sorted(plain.items()))
    return out


def drafting_tries(lines, min_ms: float = 1.0) -> dict[int, dict]:
    """The method's proposals, per number of requests of the step that made them: steps
    whose drafting took at least ``min_ms`` (a proposal; what a method does on a step
    without one, e.g. PCTree queueing the step's rows, takes hundredths of a millisecond),
    ``{requests: {"tries", "followed_by_trees", "median_ms", "total_s", "median_depth",
    "median_branching"}}`` (a proposal's trees go out with the next step; its drafting is
    timed in the step that made it; ``median_depth``, ``median_branching``: how deep and
    wide the proposals drafted, None where the records do not say, as with PTD or traces
    older than the fields). For PTD, whose upkeep at many
    requests takes as long as a proposal, the count is looser."""
    records = step_records(lines)
    found: dict[int, list[tuple[float, bool, int, int]]] = defaultdict(list)
    for s, nxt in zip(records, records[1:]):
        if s.get("drafting_ms", 0.0) >= min_ms and "requests" in s:
            found[s["requests"]].append((s["drafting_ms"], nxt["trees"] > 0,
                                         int(s.get("draft_depth", 0)),
                                         int(s.get("draft_branching", 0))))

    def median_of(values):
        values = [v for v in values if v > 0]
        return statistics.median(values) if values else None

    out = {}
    for req, tries in sorted(found.items()):
        out[req] = {"tries": len(tries), "followed_by_trees": sum(t[1] for t in tries),
                    "median_ms": statistics.median(t[0] for t in tries),
                    "total_s": sum(t[0] for t in tries) / 1000,
                    "median_depth": median_of(t[2] for t in tries),
                    "median_branching": median_of(t[3] for t in tries)}
    return out


def request_ratio_buckets(lines, prior: float = AcceptanceModel.REQUEST_PRIOR,
                          memory: float = AcceptanceModel.REQUEST_MEMORY,
                          width: float = 0.25, top: float = 1.5) -> dict[float, dict]:
    """Each request's trees (request records with an ``expected`` above 0) grouped by the
    request's ratio before them: its accepted tokens over the tokens its earlier trees were
    expected to bring (the records' ``expected``), ``(accepted + prior) / (expected +
    prior)``, each tree weighing the earlier ones down by ``1 - 1 / memory`` (as
    ``budget.AcceptanceModel.request_factor`` keeps it), in bins of ``width`` up to
    ``top``: ``{bin: {"trees", "expected", "accepted", "ratio"}}``, ratio = accepted over
    expected in the bin. Where the budget's estimates already account for what a request's
    earlier trees showed, every bin's ratio is near 1."""
    sums: dict[str, tuple[float, float]] = {}
    bins: dict[float, dict] = {}
    keep = 1.0 - 1.0 / memory
    for r in request_records(lines):
        if r.get("expected", -1.0) <= 0.0:
            continue
        accepted, expected = sums.get(r["req"], (0.0, 0.0))
        ratio = (accepted + prior) / (expected + prior)
        b = bins.setdefault(min(int(ratio / width) * width, top),
                            {"trees": 0, "expected": 0.0, "accepted": 0})
        b["trees"] += 1
        b["expected"] += r["expected"]
        b["accepted"] += r["accepted"]
        sums[r["req"]] = (accepted * keep + r["accepted"], expected * keep + r["expected"])
    for b in bins.values():
        b["ratio"] = b["accepted"] / b["expected"]
    return dict(sorted(bins.items()))


def share_floors(lines, floors: list[float]) -> list[dict]:
    """The trees of a trace (request records with verify nodes) against floors on their
    expected tokens (the records' ``expected``, the budget's estimate when it sent them):
    for each floor, the trees below it, the accepted tokens they brought, and accepted over
    offered (verify) nodes of the trees at or above it. What the accepted share would have
    been had the budget not sent the trees below the floor, and the tokens that would have
    cost, as a ceiling read from one run: the later steps are taken as they were."""
    trees = [(r.get("expected", 0.0), r["verify"], r["accepted"]) for r in request_records(lines)
             if r.get("verify", 0) > 0]
    accepted = sum(t[2] for t in trees)
    out = []
    for floor in [0.0, *floors]:
        kept = [t for t in trees if t[0] >= floor]
        offered_kept = sum(t[1] for t in kept)
        accepted_kept = sum(t[2] for t in kept)
        out.append({"floor": floor, "trees_left_out": len(trees) - len(kept),
                    "accepted_lost": accepted - accepted_kept,
                    "accepted_lost_share": (accepted - accepted_kept) / accepted if accepted else 0.0,
                    "share": accepted_kept / offered_kept if offered_kept else None})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a VLLM_PTD_TRACE file (.jsonl or .jsonl.gz)")
    ap.add_argument("--requests", type=int, default=None, help="only steps that ran this many")
    ap.add_argument("--outcomes", action="store_true",
                    help="the budget's estimates against what its tree steps did")
    ap.add_argument("--min-requests", type=int, default=1,
                    help="with --outcomes: only steps of at least this many requests")
    ap.add_argument("--tries", action="store_true",
                    help="the method's proposals (steps with 1 ms or more of drafting) per "
                         "batch size")
    ap.add_argument("--request-ratios", action="store_true",
                    help="trees grouped by their request's earlier accepted over expected tokens")
    ap.add_argument("--share-floors", default=None, metavar="X,Y,...",
                    help="accepted over offered nodes had the trees expected to bring fewer "
                         "tokens than each floor not been sent, and the accepted tokens lost")
    ap.add_argument("--realized", action="store_true",
                    help="per batch size: what drafting saved against what it cost")
    args = ap.parse_args(argv)
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        lines = f.readlines()
    if args.tries:
        tries = drafting_tries(lines)
        print("| requests | proposals | followed by trees | median ms | total s | median depth "
              "| median branching |")
        print("|---|---|---|---|---|---|---|")
        for req, t in tries.items():
            depth, branching = ("—" if t[k] is None else f"{t[k]:g}"
                                for k in ("median_depth", "median_branching"))
            print(f"| {req} | {t['tries']} | {t['followed_by_trees']} | {t['median_ms']:.1f} | "
                  f"{t['total_s']:.1f} | {depth} | {branching} |")
        return 0
    if args.share_floors:
        print("| trees left out: expected tokens below | trees left out | accepted tokens lost "
              "| accepted / offered of the rest |")
        print("|---|---|---|---|")
        for r in share_floors(lines, [float(x) for x in args.share_floors.split(",")]):
            share = "—" if r["share"] is None else f"{r['share']:.0%}"
            print(f"| {r['floor']:g} | {r['trees_left_out']} | {r['accepted_lost']} "
                  f"({r['accepted_lost_share']:.0%}) | {share} |")
        return 0
    if args.request_ratios:
        print("| request's ratio before the tree | trees | expected | accepted | accepted / expected |")
        print("|---|---|---|---|---|")
        for lo, b in request_ratio_buckets(lines).items():
            print(f"| {lo:.2f}+ | {b['trees']} | {b['expected']:.1f} | {b['accepted']} | "
                  f"{b['ratio']:.2f} |")
        return 0
    if args.outcomes:
        print(json.dumps(budget_outcomes(lines, args.min_requests), indent=1))
        return 0
    if args.realized:
        print("| requests | tree steps | saved s | cost s | saved / cost |")
        print("|---|---|---|---|---|")
        for bucket, c in realized_gain(lines).items():
            gain = "—" if c["gain"] is None else f"{c['gain']:.2f}"
            lo, hi = 1 << bucket, (2 << bucket) - 1
            print(f"| {lo if lo == hi else f'{lo}-{hi}'} | {c['tree_steps']} | "
                  f"{c['saved_ms'] / 1000:.2f} | "
                  f"{c['cost_ms'] / 1000:.2f} | {gain} |")
        return 0
    groups = step_groups(lines, args.requests)
    busy = sum(g["busy_s"] for g in groups.values()) or 1.0
    print("| requests | trees | steps | rows | wall ms | forward ms | verification ms "
          "| drafting ms | host ms | busy s | share of busy | accepted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (req, trees), g in groups.items():
        print(f"| {req} | {'yes' if trees else 'no'} | {g['steps']} | {g['rows']:.1f} | "
              f"{g['wall']:.1f} | {g['forward']:.1f} | {g['verify']:.1f} | "
              f"{g['drafting']:.2f} | {g['host']:.1f} | "
              f"{g['busy_s']:.1f} | {g['busy_s'] / busy:.1%} | {g['accepted']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
