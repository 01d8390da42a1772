"""Speedups, speculation metrics and identity checks from the run's records."""
from __future__ import annotations

import math
import statistics

from vllm_ptd.bench.engines import COUNTERS
from vllm_ptd.bench.interleave import prompts_per_call
from vllm_ptd.bench.near_ties import near_tie_counts, plain_records


ALL = "all"


def mean_sd(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return {"mean": None, "sd": None, "min": None, "max": None, "n": 0, "values": []}
    return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else None,
            "min": min(xs), "max": max(xs), "n": len(xs), "values": xs}


def spec_summary(trace: list, counters: dict, gen_tokens: int, requests: int) -> dict:
    """Speculation metrics of a pool of generate calls (see the module docstring)."""
    from vllm_ptd.metrics import SpecMetrics

    sm = SpecMetrics()
    for nodes, verify, acc, com in trace:
        sm.record(com, acc, nodes - verify, verify)
    D, T, A = counters.get("drafts", 0), counters.get("draft_tokens", 0), counters.get("accepted", 0)
    pos = counters.get("accepted_per_pos", [])
    out: dict = {"gen_tokens": gen_tokens, "requests": requests, "source": None}
    if sm.steps:
        d = sm.as_dict()
        d["survival"] = d["survival"][:12]
        out.update(d)
        out["source"] = "trace"
        accepted, extra = sm.accepted, sm.draft_rows + sm.verify_rows
    elif D:
        hits = pos[0] if pos else 0
        out.update(source="vllm", steps=D, tokens=A + D, accepted=A, HR=hits / D,
                   AL=(A + hits) / hits if hits else 0.0, DE=(A + D) / D, tau=(A + D) / D,
                   Dft=0.0, Ver=T / D, util=A / T if T else 0.0,
                   survival=[1.0] + [p / D for p in _trim(pos)][:11])
        accepted, extra = A, T
    else:
        accepted, extra = 0, 0
    # Request-steps: each request's prefill step plus its decode steps. Both terms are lower
    # bounds (gen <= steps + accepted, with equality unless a request's last step was cut at
    # EOS / max-tokens; every speculative step is a decode step), so take the larger.
    spec_steps = sm.steps if sm.steps else D
    steps_all = max(gen_tokens - accepted, spec_steps + requests, 1)
    out["DE_all"] = gen_tokens / steps_all if gen_tokens else None
    out["rows_all"] = extra / steps_all if gen_tokens else None
    out["vllm"] = {"drafts": D, "draft_tokens": T, "accepted": A, "accepted_per_pos": pos,
                   "generation_tokens": counters.get("generation_tokens", 0),
                   "mean_acceptance_length": (1 + A / D) if D else None,
                   "draft_acceptance_rate": (A / T) if T else None}
    out["trace_steps"] = sm.steps
    out["trace_accepted"] = sm.accepted
    return out


STEP_PARTS = ("forward", "tree_attention", "verify", "drafting", "budget")
# traces written before StepClock split off ``idle_ms``: a step record this long is taken
# for the engine waiting between calls (real prefill steps of several prompts go with it)
IDLE_STEP_MS = 1000.0


def is_busy(step: dict) -> bool:
    """Whether a step record is the engine at work. A record with ``idle_ms`` has the wait
    already left out of its wall; an older one of ``IDLE_STEP_MS`` or more is the wait."""
    return "idle_ms" in step or step.get("wall_ms", 0) < IDLE_STEP_MS


def busy_steps(steps) -> list[dict]:
    """The step records of an engine at work (``is_busy``)."""
    return [s for s in steps if is_busy(s)]


def step_time_summary(steps: list[dict]) -> dict | None:
    """Mean milliseconds per engine step of each part the tree proposer times
    (``vllm_ptd.integration.step_clock``), and ``other`` = wall minus the timed parts
    (vLLM's scheduling, sampling and bookkeeping); ``forward`` includes ``tree_attention``.
    The engine's waits between calls are left out (``busy_steps``)."""
    steps = busy_steps(steps)
    if not steps:
        return None
    n = len(steps)
    out = {"steps": n, "rows": sum(s["rows"] for s in steps) / n,
           "wall": sum(s["wall_ms"] for s in steps) / n}
    for p in STEP_PARTS:
        out[p] = sum(s.get(f"{p}_ms", 0.0) for s in steps) / n
    out["other"] = out["wall"] - out["forward"] - out["verify"] - out["drafting"] - out["budget"]
    return out


def _trim(xs: list[int]) -> list[int]:
    xs = list(xs)
    while xs and not xs[-1]:
        xs.pop()
    return xs


def sum_counters(recs: list[dict]) -> dict:
    out = {v: 0 for v in COUNTERS.values()}
    pos: list[int] = []
    for r in recs:
        for k in COUNTERS.values():
            out[k] += r["counters"].get(k, 0)
        p = r["counters"].get("accepted_per_pos", [])
        pos = [(pos[i] if i < len(pos) else 0) + (p[i] if i < len(p) else 0)
               for i in range(max(len(pos), len(p)))]
    out["accepted_per_pos"] = pos
    return out


def aggregate(records: list[dict], methods: list[str], prompts: dict[str, list[dict]],
              batch_sizes: list[int], repeats: int, continuous: bool = False) -> dict:
    """Per method, batch size and dataset (and all datasets pooled): tok/s and speedup over
    ``none`` (mean ± sd over repeats; a repeat counts once all its batches are in: one per
    dataset with ``continuous`` batching), outputs identical to ``none``'s (and of the
    others, how many parted from it at a near-tie: ``near_ties.explain_divergences``), step
    times and speculation metrics."""
    datasets = list(prompts)
    expected = {(ds, bs): math.ceil(len(prompts[ds]) / prompts_per_call(len(prompts[ds]), bs,
                                                                        continuous))
                for ds in datasets for bs in batch_sizes}
    by: dict[tuple, list[dict]] = {}
    for rec in records:
        by.setdefault((rec["method"], rec["dataset"], rec["batch_size"], rec["repeat"]), []).append(rec)

    def complete(m, ds, bs, r):
        return len(by.get((m, ds, bs, r), [])) == expected[(ds, bs)]

    def tps(m, dss, bs, r):
        if not all(complete(m, ds, bs, r) for ds in dss):
            return None
        recs = [x for ds in dss for x in by[(m, ds, bs, r)]]
        wall = sum(x["wall"] for x in recs)
        return sum(x["tokens"] for x in recs) / wall if wall > 0 else None

    plain = plain_records(records)
    groups = [(ds, [ds]) for ds in datasets] + ([(ALL, datasets)] if len(datasets) > 1 else [])
    table = []
    for m in methods:
        for bs in batch_sizes:
            for gname, dss in groups:
                t = [tps(m, dss, bs, r) for r in range(repeats)]
                base = [tps("none", dss, bs, r) for r in range(repeats)]
                sp = [a / b if (a is not None and b) else None for a, b in zip(t, base)]
                recs = [x for ds in dss for r in range(repeats) for x in by.get((m, ds, bs, r), [])]
                gen = sum(x["tokens"] for x in recs)
                nreq = sum(len(x["prompt_index"]) for x in recs)
                trace = [row for x in recs for row in x["trace"]]
                spec = spec_summary(trace, sum_counters(recs), gen, nreq)
                same = total = 0
                for x in recs:
                    ref = plain.get((x["dataset"], bs, x["repeat"], x["chunk"]))
                    if ref is None:
                        continue
                    for a, b in zip(x["outputs"], ref["outputs"]):
                        total += 1
                        same += int(a == b)
                near, explained, unknown = near_tie_counts(recs)
                steps = [s for x in recs for s in x.get("steps", [])]
                table.append({"method": m, "batch_size": bs, "dataset": gname,
                              "near_ties": near, "explained": explained,
                              "unexplained": unknown,
                              "step_times": step_time_summary(steps),
                              "tok_s": mean_sd(t), "speedup": mean_sd(sp),
                              "wall_s": sum(x["wall"] for x in recs), "gen_tokens": gen,
                              "requests": nreq, "identical": same, "compared": total,
                              "spec": spec})
    # one pooled point per method (every dataset and batch size) for the DE/rows plot
    pooled = {}
    for m in methods:
        recs = [x for x in records if x["method"] == m]
        gen = sum(x["tokens"] for x in recs)
        nreq = sum(len(x["prompt_index"]) for x in recs)
        pooled[m] = spec_summary([row for x in recs for row in x["trace"]], sum_counters(recs),
                                 gen, nreq)
    return {"rows": table, "pooled": pooled}
