#!/usr/bin/env python
"""A few-minute demo: plain decoding against vLLM's ngram, PTD (and PCTree when its drafter
is there) on the embedded model, one prompt per benchmark, greedy, batch 1.

Every engine is loaded at once in its own process and they take turns on each prompt (order
rotating), as in scripts/benchmark.py; every figure printed is measured in this run. The
engines are compiled, as vLLM runs by default (``--enforce-eager`` starts them faster).

  bash scripts/demo.sh                  # set-up, then this
  python scripts/demo.py [--max-tokens 128] [--repeats 1] [--out results/demo]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vllm_ptd.bench.aggregate import ALL, aggregate
from vllm_ptd.bench.engines import start_engines, stop_engines
from vllm_ptd.bench.host import REPO, resolve_common_args
from vllm_ptd.bench.interleave import run_interleaved
from vllm_ptd.bench.methods import parse_methods
from vllm_ptd.bench.near_ties import LEGEND, explain_run
from vllm_ptd.bench.prompts import load_held_out_prompts, load_token_prompts
from vllm_ptd.bench.report import fmt, fmt_pm, identical_cell

DATASETS = ["mt_bench", "spec_bench", "gsm8k", "humaneval", "mbpp"]


def pctree_drafter(model_path: str) -> tuple[bool, str]:
    """(usable, why) for PCTree's drafter for this target: the packaged one, or
    ``$VLLM_PTD_DSPARK``."""
    from vllm_ptd.pctree.method import resolve_drafter_path

    try:
        return True, str(resolve_drafter_path(None, model_path))
    except ValueError as e:
        return False, str(e)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="auto", help="as scripts/benchmark.py --dtype")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no torch.compile: engines start in seconds instead of about a minute "
                         "or two each on a small CPU, and decode slower")
    ap.add_argument("--out", default=str(REPO / "results" / "demo"))
    args = ap.parse_args(argv)
    args.model = None
    resolve_common_args(args)
    t0 = time.time()
    model = args.model
    labels = ["none", "ngram:6", "ptd"]
    ok, why = pctree_drafter(model)
    if ok:
        labels.append("pctree")
        print(f"[demo] PCTree drafter: {why}")
    else:
        print(f"[demo] PCTree left out: {why}")
    methods = parse_methods(",".join(labels))

    prompts = load_token_prompts(model, DATASETS, 1, None, 2048 - args.max_tokens)
    spare = load_held_out_prompts(model, DATASETS, 1, 1, None, 2048 - args.max_tokens)
    print(f"[demo] model {model}; {len(prompts)} prompts (one per dataset), {args.max_tokens} new "
          f"tokens, greedy, batch 1, {args.dtype}; engines: {', '.join(labels)}")
    out = Path(args.out)
    opts = {"model": model, "dtype": args.dtype,
            "max_model_len": 2048, "max_num_seqs": 1, "seed": 0,
            "enforce_eager": args.enforce_eager, "prefix_caching": False,
            "kv_cache_gib": 1.0 if args.dtype == "float32" else 0.5}
    engines, failed = [], {}
    try:
        engines, failed = start_engines(methods, opts, out / "logs", out / "traces", 2)
        if "none" in failed:
            print(f"[demo] the plain engine failed to start: {failed['none']}")
            return 1
        records = run_interleaved(engines, prompts, [1], args.repeats, args.max_tokens,
                                     settle=1.2, warmup=True, warmup_prompts=spare)
        explain_run(engines, records, prompts, args.dtype)
    finally:
        stop_engines(engines)
    live = [e.label for e in engines if not e.error]
    agg = aggregate(records, live, prompts, [1], args.repeats)
    get = {r["method"]: r for r in agg["rows"] if r["dataset"] == ALL}

    head = ["method", "tok/s", "speedup", "DE", "AL", "HR", "DE all", "identical"]
    body = []
    for lab in live:
        r = get[lab]
        s = r["spec"]
        spec = s.get("source") is not None
        body.append([lab, fmt_pm(r["tok_s"], 1), fmt_pm(r["speedup"]),
                     fmt(s.get("DE")) if spec else "—", fmt(s.get("AL")) if spec else "—",
                     fmt(s.get("HR")) if spec else "—", fmt(s.get("DE_all")),
                     identical_cell(r)])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda row: "  ".join(str(x).ljust(w) for x, w in zip(row, widths))  # noqa: E731
    print()
    print(line(head))
    print(line(["-" * w for w in widths]))
    for row in body:
        print(line(row))
    for lab, why in {**failed, **{e.label: e.error for e in engines if e.error}}.items():
        print(f"(skipped {lab}: {why})")
    ties = "" if args.dtype == "float32" else (
        f" (which flips near-ties; --dtype float32 is exact; {LEGEND})")
    print(f"\nDE = tokens per target forward on speculative steps, AL = tokens per step with an "
          f"accepted draft, HR = share of such steps, DE all = tokens per forward over all steps "
          f"(prefill and steps without a draft too); identical = outputs token-identical to "
          f"plain decoding in {args.dtype}"
          f"{ties}. "
          f"Wall time {time.time() - t0:.0f}s; engine logs in {out / 'logs'}.")
    print("\nFull benchmark (all five datasets, batch sizes 1/4/16, every method, plots; the "
          "README's Results section has the commands of the runs reported there):\n"
          "  .venv/bin/python scripts/benchmark.py --num-prompts 10 --max-tokens 128 "
          "--repeats 2 --out results/bench\n"
          "Cost of a forward against rows per step on this machine:\n"
          "  .venv/bin/python scripts/benchmark.py --row-cost 1,2,4,8,16,32 --out results/rowcost\n"
          "Serving (OpenAI API, concurrent streaming clients):\n"
          "  .venv/bin/python scripts/bench_serving.py --methods none,ngram:6,ptd --clients 1,4")
    return 0


if __name__ == "__main__":
    sys.exit(main())
