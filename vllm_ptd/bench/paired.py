"""Engines side by side in one process: where a tree engine's time goes against plain
decoding's, step kind by step kind, without the differences between engine processes.

Every method's engine is built in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the
same batches go to the engines in turn (order rotating). Separate engine processes running
the same plain steps differ by a few per cent on this machine (``bench_upkeep``), more than
what some of the effects measured here are. Engines in one process differ too, if less:
three plain engines here took 24.1-25.3 ms a decode step of 4 requests on the same batches
(README, What is not reached), so a run that should resolve a few per cent lists ``none``
more than once (``none,ptd,none@2``): the report then gives each engine's speed against the
plain engines' mean, the plain engines' own included. Each engine step is timed (the executor's
``execute_model`` to the end of its ``sample_tokens``, which holds sampling, and for a tree
method its verification and drafting) and sorted by kind: *decode* (every request
schedules its one token, plus its tree) or *prefill* (some request schedules prompt rows),
with or without a tree; so is the engine's host work around the steps (the scheduler, the
drafts handed to it, the output processing). Outputs are compared with the first method's,
batch by batch; in bf16 (or fp16) where the first method is plain decoding, each output that
parts from it is explained as the offline benchmark's are (``near_ties``): the plain engine
reruns that batch once, untimed, with logprobs, and the report counts the first divergences
at which its top-2 logits were within ``TIE_GAP``.

Threads: a multiprocess vLLM CPU engine binds its worker to the cores it does not reserve
for its front end (one per worker on x86, so one core of two here); engines in one process
are not bound, so ``--threads`` sets torch's threads, by default that same count.

  python scripts/bench_paired.py --methods none,ptd --batch-size 4 --batching continuous \\
      --num-prompts 16 --max-tokens 64 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

from vllm_ptd.bench.near_ties import (EXPLAINED_DTYPES, TIE_GAP, count_near_ties,
                                      first_divergence, gap_at_divergence, near_tie_note,
                                      top2_gaps)

STEP_KINDS = ("decode", "decode+tree", "prefill", "prefill+tree")
# the engine's host work around its steps: (owner, method) under ``LLM.llm_engine``
HOST_PHASES = {"schedule": ("engine_core.engine_core.scheduler", "schedule"),
               "update_from_output": ("engine_core.engine_core.scheduler", "update_from_output"),
               "post_step (drafts to the scheduler)": ("engine_core.engine_core", "post_step"),
               "process_outputs": ("output_processor", "process_outputs")}


def step_kind(num_requests: int, scheduled_tokens: int, tree_tokens: int) -> str:
    """A step's kind from what the scheduler gave it: ``num_requests`` requests,
    ``scheduled_tokens`` rows in all, ``tree_tokens`` of them speculative."""
    prompt_rows = scheduled_tokens - num_requests - tree_tokens
    return ("prefill" if prompt_rows > 0 else "decode") + ("+tree" if tree_tokens else "")


class StepTimer:
    """Times each engine step of ``executor`` (an in-process vLLM executor) into ``steps``
    as ``(kind, rows, seconds)``: from ``execute_model`` to the end of ``sample_tokens``, or
    of ``execute_model`` when that returns the step's output itself (directly or, with
    ``non_block``, as a done future)."""

    def __init__(self, executor) -> None:
        self.steps: list[tuple[str, int, float]] = []
        self._open: tuple[str, int, float] | None = None
        execute, sample = executor.execute_model, executor.sample_tokens

        def execute_model(scheduler_output, *args, **kwargs):
            tree = sum(len(t) for t in scheduler_output.scheduled_spec_decode_tokens.values())
            rows = scheduler_output.total_num_scheduled_tokens
            kind = step_kind(len(scheduler_output.num_scheduled_tokens), rows, tree)
            t0 = time.perf_counter()
            out = execute(scheduler_output, *args, **kwargs)
            result = out.result() if hasattr(out, "result") else out
            if result is None:
                self._open = (kind, rows, t0)
            else:
                self.steps.append((kind, rows, time.perf_counter() - t0))
            return out

        def sample_tokens(*args, **kwargs):
            out = sample(*args, **kwargs)
            if self._open is not None:
                kind, rows, t0 = self._open
                self._open = None
                self.steps.append((kind, rows, time.perf_counter() - t0))
            return out

        executor.execute_model, executor.sample_tokens = execute_model, sample_tokens


def summarize_steps(steps: list[tuple[str, int, float]]) -> dict[str, dict]:
    """Per step kind: steps, seconds and rows."""
    out = {k: {"steps": 0, "seconds": 0.0, "rows": 0} for k in STEP_KINDS}
    for kind, rows, seconds in steps:
        s = out[kind]
        s["steps"] += 1
        s["seconds"] += seconds
        s["rows"] += rows
    return out


def divergence_gaps(reference: list[list[list[int]]], outputs: list[list[list[int]]],
                    rerun: Callable[[int], tuple[list[list[int]], list[list[float]]]]
                    ) -> list[float | None]:
    """Plain decoding's top-2 gap at the first divergence of each output in ``outputs``
    (per call, per prompt) that parts from ``reference``'s (the same calls); None where
    ``rerun(call)`` (the reference's outputs and top-2 gaps of that call's batch, rerun with
    logprobs) did not reproduce the timed reference output."""
    gaps: list[float | None] = []
    for call, (ref_call, out_call) in enumerate(zip(reference, outputs)):
        for j, (a, b) in enumerate(zip(ref_call, out_call)):
            k = first_divergence(b, a)
            if k is None:
                continue
            again, top2 = rerun(call)
            gaps.append(gap_at_divergence(again[j], top2[j], a, k))
    return gaps


def identical_cell(same: int, total: int, gaps: list[float | None] | None) -> str:
    """``same/total``, and in bf16 how many of the divergences were near-ties."""
    return f"{same}/{total}" + near_tie_note(*count_near_ties(gaps or []))


def round_sums(walls: list[float], rounds: int) -> list[float]:
    """The wall of each round, ``walls`` holding ``rounds`` rounds of batches in order."""
    n = len(walls) // rounds
    return [sum(walls[i * n:(i + 1) * n]) for i in range(rounds)]


def mean_sd(values: list[float]) -> str:
    """``mean ± sample sd`` (sd 0 for one value)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {sd:.3f}"


def speed_against_plain_mean(labels: list[str], walls: dict[str, list[float]],
                             rounds: int = 1) -> dict[str, list[float]] | None:
    """Each engine's speed per round against the plain engines' mean: the mean of the
    plain engines' round walls over its own (the plain engines included, which shows
    their range); None with fewer than two plain engines. Why: identical plain engines in
    one process differ by a few per cent (README, What is not reached), as much as some
    of the differences a paired run is for."""
    from vllm_ptd.bench.methods import parse_method

    plain = [lab for lab in labels if parse_method(lab).name == "none"]
    if len(plain) < 2:
        return None
    plain_mean = [statistics.fmean(r) for r in zip(*(round_sums(walls[p], rounds) for p in plain))]
    return {lab: [m / w for m, w in zip(plain_mean, round_sums(walls[lab], rounds))]
            for lab in labels}


def report(labels: list[str], walls: dict[str, list[float]], kinds: dict[str, dict],
           identical: dict[str, tuple[int, int]], host: dict[str, dict[str, float]],
           rounds: int = 1, gaps: dict[str, list[float | None]] | None = None) -> str:
    """Markdown: each engine's wall time against the first's (per batch: the median of the
    ratios; per round, ``walls`` holding ``rounds`` rounds of batches in order: the ratio of
    the sums, mean ± sample sd) and, with two or more plain engines, its speed against
    their mean (``speed_against_plain_mean``), outputs equal to the first's (with ``gaps``, those of
    ``divergence_gaps``, how many parted at near-ties), its steps by kind, and its
    seconds in each host phase (``HOST_PHASES``) and the rest of the wall time."""
    ref = labels[0]
    lines = ["| method | wall s | wall / first's, per batch (median) | per round (mean ± sd) "
             "| identical |", "|---|---|---|---|---|"]
    ref_rounds = round_sums(walls[ref], rounds)
    for lab in labels:
        w = walls[lab]
        ratios = [b / a for a, b in zip(walls[ref], w)]
        per_round = [b / a for a, b in zip(ref_rounds, round_sums(w, rounds))]
        same, total = identical.get(lab, (0, 0))
        lines.append(f"| {lab} | {sum(w):.2f} | {statistics.median(ratios):.3f} | "
                     f"{mean_sd(per_round)} | "
                     f"{'ref' if lab == ref else identical_cell(same, total, (gaps or {}).get(lab))} |")
    speeds = speed_against_plain_mean(labels, walls, rounds)
    if speeds is not None:
        lines += ["", "| method | speed against the plain engines' mean, per round (mean ± sd) |",
                  "|---|---|"]
        lines += [f"| {lab} | {mean_sd(speeds[lab])} |" for lab in labels]
    lines += ["", "| method | step kind | steps | seconds | rows | ms per step | rows per step |",
              "|---|---|---|---|---|---|---|"]
    for lab in labels:
        for kind, s in kinds[lab].items():
            if s["steps"]:
                lines.append(f"| {lab} | {kind} | {s['steps']} | {s['seconds']:.2f} | "
                             f"{s['rows']} | {1000 * s['seconds'] / s['steps']:.1f} | "
                             f"{s['rows'] / s['steps']:.1f} |")
    names = list(HOST_PHASES)
    lines += ["", "| method | steps s | " + " | ".join(f"{n} s" for n in names) + " | rest s |",
              "|---|---|" + "---|" * len(names) + "---|"]
    for lab in labels:
        steps = sum(s["seconds"] for s in kinds[lab].values())
        phases = [host[lab].get(n, 0.0) for n in names]
        rest = sum(walls[lab]) - steps - sum(phases)
        lines.append(f"| {lab} | {steps:.2f} | " + " | ".join(f"{v:.2f}" for v in phases)
                     + f" | {rest:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from vllm_ptd.bench.upkeep import add_engine_args

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="none,ptd",
                    help="engines built in this process in this order; the first is the "
                         "reference for ratios and outputs")
    add_engine_args(ap, batch_size=4)
    ap.add_argument("--batching", choices=("closed", "continuous"), default="continuous",
                    help="closed: batches of --batch-size prompts, one after another; "
                         "continuous: each dataset's prompts in one call, at most "
                         "--batch-size running")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: the cores a multiprocess engine's worker "
                         "gets, all but one)")
    ap.add_argument("--out", default=None, help="folder for the report (default results/paired-<time>)")
    args = ap.parse_args(argv)

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # every engine core in this process
    from vllm_ptd.bench.engines import engine_env, engine_opts, llm_kwargs

    engine_env()  # before torch's first allocation
    import torch

    from vllm_ptd.bench.host import host_info
    from vllm_ptd.bench.interleave import prompts_per_call
    from vllm_ptd.bench.methods import parse_method
    from vllm_ptd.bench.prompts import load_held_out_prompts, load_token_prompts
    from vllm_ptd.bench.upkeep import add_timer
    from vllm_ptd.model_store import default_model_path

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) - 1))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    methods = [parse_method(m) for m in args.methods.split(",") if m.strip()]
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"[paired] --methods repeats a label: {labels}; tag one (none@2)")
    args.model = args.model or default_model_path()
    args.seed, args.prefix_caching = 0, False
    datasets = args.datasets.split(",")
    max_len = args.max_model_len - args.max_tokens
    prompts = load_token_prompts(args.model, datasets, args.num_prompts, None, max_len)
    held_out = load_held_out_prompts(args.model, datasets, args.num_prompts, 1, None, max_len)
    opts = engine_opts(args, args.batch_size)
    engines = {}
    for m in methods:
        t0 = time.perf_counter()
        llm = LLM(**llm_kwargs(opts, m.spec))
        host: dict[str, float] = {}
        for name, (owner, method) in HOST_PHASES.items():
            obj = llm.llm_engine
            for attr in owner.split("."):
                obj = getattr(obj, attr)
            add_timer(obj, method, name, host)
        engines[m.label] = (llm, StepTimer(llm.llm_engine.engine_core.engine_core.model_executor),
                            host)
        print(f"[paired] {m.label} ready in {time.perf_counter() - t0:.0f}s", flush=True)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def generate(label: str, ids: list[list[int]], params=sp):
        return engines[label][0].generate([TokensPrompt(prompt_token_ids=p) for p in ids],
                                          params, use_tqdm=False)

    def tokens(label: str, ids: list[list[int]]) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in generate(label, ids)]

    for label in labels:  # warm-up on held-out prompts, not timed
        for items in held_out.values():
            if items:
                tokens(label, [p["ids"] for p in items])
        engines[label][1].steps.clear()
        engines[label][2].clear()
    batches = []
    for ds in datasets:
        ids = [p["ids"] for p in prompts[ds]]
        step = prompts_per_call(len(ids), args.batch_size, args.batching == "continuous")
        batches += [ids[i: i + step] for i in range(0, len(ids), step)]
    walls = {lab: [] for lab in labels}
    outputs = {lab: [] for lab in labels}
    for rnd in range(args.rounds):
        for b, ids in enumerate(batches):
            k = (rnd * len(batches) + b) % len(labels)
            for label in labels[k:] + labels[:k]:
                t0 = time.perf_counter()
                outputs[label].append(tokens(label, ids))
                walls[label].append(time.perf_counter() - t0)
        print(f"[paired] round {rnd + 1}/{args.rounds} done", flush=True)
    ref = labels[0]
    identical = {lab: (sum(a == b for x, y in zip(outputs[ref], outputs[lab]) for a, b in zip(x, y)),
                       sum(len(x) for x in outputs[ref])) for lab in labels[1:]}
    kinds = {lab: summarize_steps(engines[lab][1].steps) for lab in labels}
    host = {lab: dict(engines[lab][2]) for lab in labels}
    gaps = None
    if args.dtype in EXPLAINED_DTYPES and methods[0].spec is None:
        reruns: dict[int, tuple[list[list[int]], list[list[float]]]] = {}
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=2)

        def rerun(call: int):  # calls run the batches round after round
            b = call % len(batches)
            if b not in reruns:
                outs = generate(ref, batches[b], params)
                reruns[b] = ([list(o.outputs[0].token_ids) for o in outs],
                             [top2_gaps(o.outputs[0].logprobs) for o in outs])
            return reruns[b]

        gaps = {lab: divergence_gaps(outputs[ref], outputs[lab], rerun) for lab in labels[1:]}
        print(f"[paired] {sum(map(len, gaps.values()))} outputs part from plain decoding; "
              f"{len(reruns)} plain batches rerun with logprobs (near-tie: top-2 logits within "
              f"{TIE_GAP})", flush=True)
    table = report(labels, walls, kinds, identical, host, args.rounds, gaps)
    text = (f"# Engines side by side in one process ({args.rounds} rounds; {args.batching} "
            f"batches of {args.batch_size}, {args.num_prompts} prompts x {args.max_tokens} "
            f"tokens per dataset, {args.dtype}, "
            f"{'eager' if args.enforce_eager else 'compiled'}, {torch.get_num_threads()} "
            f"torch thread(s))\n\n{table}\n")
    out = Path(args.out or f"results/paired-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "paired.md").write_text(text)
    (out / "paired.json").write_text(json.dumps(
        {"args": vars(args), "host": host_info(), "walls": walls, "kinds": kinds,
         "identical": identical, "divergence_gaps": gaps, "host_phases": host}, indent=1))
    print(text)
    return 0
