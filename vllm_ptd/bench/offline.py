"""The offline benchmark run: prompts, engines, the interleaved run, OUT/results.*."""
from __future__ import annotations

import json
import time
from pathlib import Path

from vllm_ptd.bench.aggregate import aggregate
from vllm_ptd.bench.engines import Engine, engine_opts, start_engines, stop_engines
from vllm_ptd.bench.host import host_info
from vllm_ptd.bench.interleave import run_interleaved
from vllm_ptd.bench.methods import Method, parse_methods
from vllm_ptd.bench.near_ties import explain_run
from vllm_ptd.bench.plots import make_plots
from vllm_ptd.bench.prompts import load_held_out_prompts, load_token_prompts, set_token_limits
from vllm_ptd.bench.report import markdown_report


def strip_records(records: list[dict]) -> list[dict]:
    out = []
    for r in records:
        r = dict(r)
        r["output_lens"] = [len(o) for o in r.pop("outputs")]
        r["trace_steps"] = len(r.pop("trace"))
        r.pop("steps", None)
        out.append(r)
    return out


def replot(results_json: Path, row_cost_json: str | None) -> None:
    """results.md and the PNG plots again, next to an earlier run's results.json."""
    data = json.loads(results_json.read_text())
    out = results_json.parent
    methods = parse_methods(",".join(data["meta"]["methods"]), check_installed=False)
    md = markdown_report(data["aggregate"], data["meta"], methods, data["failed"])
    (out / "results.md").write_text(md + "\n")
    plots = make_plots(data["aggregate"], methods, data["failed"], out, row_cost_json)
    print(f"[bench] wrote {out / 'results.md'}, " + ", ".join(str(out / p) for p in plots))


def run_benchmark(args, methods: list[Method], datasets: list[str], say=None) -> dict | None:
    """Load prompts and engines, run the interleaved benchmark, write OUT/results.*."""
    try:
        from tqdm import tqdm

        say = say or (lambda s: tqdm.write(s))
    except ImportError:
        say = say or print
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t_start = time.time()
    prompts = load_token_prompts(args.model, datasets, args.num_prompts, args.data_dir,
                                 args.max_model_len - args.max_tokens, say)
    lo = getattr(args, "min_tokens_limit", None)
    set_token_limits(prompts, lo, args.max_tokens)
    say(f"[bench] {sum(len(v) for v in prompts.values())} prompts from {', '.join(prompts)}; "
        f"methods: {', '.join(m.label for m in methods)}; output: {out}")
    spare = None  # every prompt measured: the warm-up falls back to reversed prompts
    if args.num_prompts is not None and not args.no_warmup:
        spare = load_held_out_prompts(args.model, datasets, args.num_prompts,
                                      max(args.batch_sizes), args.data_dir,
                                      args.max_model_len - args.max_tokens)
    opts = engine_opts(args, max_num_seqs=max(args.batch_sizes))
    engines: list[Engine] = []
    failed: dict[str, str] = {}
    try:
        engines, failed = start_engines(methods, opts, out / "logs", out / "traces",
                                        args.start_jobs, say)
        failed = {k: f"engine failed to start: {v}" for k, v in failed.items()}
        if "none" in failed:
            say("[bench] the plain engine (none) did not start: nothing to compare against")
            return None
        load = {e.label: e.load_s for e in engines}
        meta = {"model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens,
                "min_tokens_limit": lo,
                "repeats": args.repeats, "batch_sizes": args.batch_sizes,
                "prompts": {d: len(v) for d, v in prompts.items()},
                "prompt_ids": {d: [p["id"] for p in v] for d, v in prompts.items()},
                "methods": {m.label: m.spec for m in methods}, "load_s": load,
                "args": vars(args), "started": started, "host": host_info(),
                "settle_s": args.settle, "batching": args.batching,
                "warmup_prompt_ids": {d: [p["id"] for p in v] for d, v in (spare or {}).items()}}

        def write(records, partial: bool):
            labels = [m.label for m in methods]
            agg = aggregate(records, [x for x in labels if x in load], prompts,
                            args.batch_sizes, args.repeats, args.batching == "continuous")
            meta["elapsed_s"] = time.time() - t_start
            errors = {e.label: e.error for e in engines if e.error}
            fail = {**failed, **{k: f"failed during the run: {v}" for k, v in errors.items()}}
            data = {"meta": meta, "partial": partial, "failed": fail, "aggregate": agg,
                    "records": strip_records(records)}
            (out / "results.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
            md = markdown_report(agg, meta, methods, fail)
            (out / "results.md").write_text(md + "\n")
            plots = [] if partial else make_plots(agg, methods, fail, out, args.row_cost_json)
            return md, plots

        records = run_interleaved(
            engines, prompts, args.batch_sizes, args.repeats, args.max_tokens, args.settle,
            warmup=not args.no_warmup, progress=not args.no_progress,
            on_repeat_done=lambda recs, r: write(recs, True), say=say, warmup_prompts=spare,
            continuous=args.batching == "continuous")
        explain_run(engines, records, prompts, args.dtype, say)
        md, plots = write(records, False)
        print(md)
        say(f"[bench] wrote {out / 'results.md'}, {out / 'results.json'}, "
            + ", ".join(str(out / p) for p in plots))
        return {"records": records, "meta": meta}
    finally:
        stop_engines(engines)
