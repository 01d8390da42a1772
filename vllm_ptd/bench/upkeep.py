"""Where an engine's time goes outside the forward, method by method: each method's engine
runs in-process in a fresh child process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the same
batches in the same order, with wall-clock timers around the engine core's and the model
runner's phases. Why: the per-step upkeep of a method that sends no tree (pool updates,
drafter context) is a few per cent of a step, smaller than what separate engine processes
differ by on the same work, so it is read off the phases that hold it (``propose``) rather
than off throughput ratios; running ``none`` more than once shows that process-to-process
spread.

  python scripts/bench_upkeep.py --methods none,ptd:disable_by_batch_size=1,none \\
      --batch-size 16 --num-prompts 16 --max-tokens 64 --rounds 2
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

# engine core and model runner methods timed (the runner's only where they exist)
CORE_PHASES = {"schedule": ("scheduler", "schedule"),
               "update": ("scheduler", "update_from_output"),
               "execute": ("model_executor", "execute_model"),
               "sample_tokens": ("model_executor", "sample_tokens")}
RUNNER_PHASES = ("_prepare_inputs", "_calc_spec_decode_metadata", "_model_forward", "_sample",
                 "propose_draft_token_ids")
# Python's cyclic garbage collector: its pauses are the process's, whichever engine's objects
# made them, so engines in one process (``bench_paired``) share them; here each method's own
GC_KEYS = ("gc", "gc_full")  # seconds in collections; full (generation 2) collections


def add_gc_timer(totals: dict) -> None:
    """Add each collection's wall seconds to ``totals["gc"]`` and count the full ones."""
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            totals["gc"] = totals.get("gc", 0.0) + time.perf_counter() - started.pop()
            if info.get("generation") == 2:
                totals["gc_full"] = totals.get("gc_full", 0) + 1

    gc.callbacks.append(on_gc)


def add_timer(obj, name: str, key: str, totals: dict) -> None:
    """Wrap ``obj.name`` so that each call adds its wall seconds to ``totals[key]``."""
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - t0

    setattr(obj, name, timed)


def add_engine_args(ap: argparse.ArgumentParser, batch_size: int) -> None:
    """The prompts, batches and engine options of a probe whose engines run in-process
    (here and ``vllm_ptd.bench.paired``)."""
    ap.add_argument("--model", default=None, help="HF model folder (default: the embedded model)")
    ap.add_argument("--datasets", default="mt_bench,gsm8k,humaneval,mbpp")
    ap.add_argument("--num-prompts", type=int, default=16, help="per dataset")
    ap.add_argument("--batch-size", type=int, default=batch_size)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--enforce-eager", action="store_true")


def summarize(records: list[dict], reference: dict | None) -> dict:
    """One method's rounds (``records``: ``{"round", "dataset", "wall", <phase>...,
    "outputs"}`` per batch) as mean and spread over rounds of each phase's seconds per
    round, and how many outputs equal ``reference`` (``{(dataset, chunk): outputs}`` of
    ``none``: each batch against the same batch of plain decoding)."""
    rounds = sorted({r["round"] for r in records})
    keys = ["wall", *CORE_PHASES, *RUNNER_PHASES, *GC_KEYS]
    per_round = {k: [sum(r.get(k, 0.0) for r in records if r["round"] == n) for n in rounds]
                 for k in keys}
    out = {k: {"mean": statistics.fmean(v), "min": min(v), "max": max(v)}
           for k, v in per_round.items() if v}
    same = total = 0
    if reference is not None:
        for r in records:
            for a, b in zip(r["outputs"], reference.get((r["dataset"], r["chunk"]), [])):
                total += 1
                same += int(a == b)
    out["identical"], out["compared"] = same, total
    return out


def _child(label: str, spec: dict | None, opts: dict, prompts: dict, out_path: str) -> None:
    from vllm_ptd.bench.engines import engine_env, llm_kwargs

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    engine_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**llm_kwargs(opts, spec))
    core = llm.llm_engine.engine_core.engine_core
    totals: dict = {}
    for key, (owner, name) in CORE_PHASES.items():
        add_timer(getattr(core, owner), name, key, totals)
    runner = core.model_executor.driver_worker.worker.model_runner
    for name in RUNNER_PHASES:
        if hasattr(runner, name):
            add_timer(runner, name, name, totals)
    add_gc_timer(totals)
    sp = SamplingParams(temperature=0.0, max_tokens=opts["max_tokens"])

    def generate(ids):
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], sp, use_tqdm=False)

    bs = opts["max_num_seqs"]
    first = next(iter(prompts.values()))
    generate([list(reversed(p)) for p in first[:bs]])  # warm-up on text nobody measures
    with open(out_path, "w") as f:
        for rnd in range(opts["rounds"]):
            for ds, items in prompts.items():
                for start in range(0, len(items), bs):
                    totals.clear()
                    t0 = time.perf_counter()
                    outs = generate(items[start: start + bs])
                    rec = {"method": label, "round": rnd, "dataset": ds, "chunk": start,
                           "wall": time.perf_counter() - t0, **totals,
                           "outputs": [list(o.outputs[0].token_ids) for o in outs]}
                    f.write(json.dumps(rec) + "\n")
                    f.flush()


def _reference(records: list[dict]) -> dict:
    """``{(dataset, chunk): outputs}`` of a ``none`` run's first round."""
    return {(r["dataset"], r["chunk"]): r["outputs"] for r in records if r["round"] == 0}


def report(results: list[tuple[str, dict]]) -> str:
    lines = ["| run | method | wall s | execute s | of which forward s | of which prepare_inputs s "
             "| of which spec-decode metadata s | sample_tokens s | of which sample s "
             "| of which propose s | schedule + update s "
             "| garbage collector s (full collections) | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(s, k):
        v = s.get(k)
        return "—" if v is None else f"{v['mean']:.2f} ({v['min']:.2f}-{v['max']:.2f})"

    for i, (label, s) in enumerate(results):
        su = s.get("schedule", {}).get("mean", 0.0) + s.get("update", {}).get("mean", 0.0)
        ident = f"{s['identical']}/{s['compared']}" if s["compared"] else "ref"
        full = s.get("gc_full", {}).get("mean", 0.0)
        lines.append(f"| {i + 1} | {label} | {cell(s, 'wall')} | {cell(s, 'execute')} | "
                     f"{cell(s, '_model_forward')} | {cell(s, '_prepare_inputs')} | "
                     f"{cell(s, '_calc_spec_decode_metadata')} | {cell(s, 'sample_tokens')} | "
                     f"{cell(s, '_sample')} | {cell(s, 'propose_draft_token_ids')} | "
                     f"{su:.2f} | {cell(s, 'gc')} ({full:g}) | {ident} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from vllm_ptd.bench.engines import engine_env, engine_opts
    from vllm_ptd.bench.methods import parse_method, safe_label
    from vllm_ptd.bench.prompts import load_token_prompts
    from vllm_ptd.model_store import default_model_path

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="none,ptd:disable_by_batch_size=1,"
                    "pctree:disable_by_batch_size=1,none",
                    help="run one after another, each in a fresh process; a method may repeat")
    add_engine_args(ap, batch_size=16)
    ap.add_argument("--out", default=None, help="folder for the records (default results/upkeep-<time>)")
    args = ap.parse_args(argv)
    methods = [parse_method(m) for m in args.methods.split(",") if m.strip()]
    args.model = args.model or default_model_path()
    args.seed, args.prefix_caching = 0, False
    prompts = load_token_prompts(args.model, args.datasets.split(","), args.num_prompts, None,
                                 args.max_model_len - args.max_tokens)
    prompts = {ds: [p["ids"] for p in items] for ds, items in prompts.items()}
    out = Path(args.out or f"results/upkeep-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    # the offline benchmark's engine options, batches of one size
    opts = {**engine_opts(args, args.batch_size), "max_tokens": args.max_tokens,
            "rounds": args.rounds}
    engine_env()  # inherited by the engine processes, before their torch allocates
    ctx = mp.get_context("spawn")
    runs = []
    for i, m in enumerate(methods):
        path = out / f"{i + 1}_{safe_label(m.label)}.jsonl"
        print(f"[upkeep] {i + 1}/{len(methods)} {m.label} ...", flush=True)
        p = ctx.Process(target=_child, args=(m.label, m.spec, opts, prompts, str(path)))
        p.start()
        p.join()
        if p.exitcode != 0:
            print(f"[upkeep] {m.label} failed (exit {p.exitcode})", file=sys.stderr)
            return 1
        runs.append((m, [json.loads(line) for line in path.read_text().splitlines()]))
    ref = next((_reference(r) for m, r in runs if m.spec is None), None)
    table = report([(m.label, summarize(r, ref if m.spec is not None else None))
                    for m, r in runs])
    text = (f"# Upkeep per round ({args.rounds} rounds; batches of {args.batch_size}, "
            f"{args.num_prompts} prompts x {args.max_tokens} tokens per dataset, "
            f"{args.dtype}, {'eager' if args.enforce_eager else 'compiled'})\n\n"
            "Seconds per round, mean (min-max over rounds); runs in the order given, each a "
            "fresh process.\n\n" + table + "\n")
    (out / "upkeep.md").write_text(text)
    print(text)
    return 0
