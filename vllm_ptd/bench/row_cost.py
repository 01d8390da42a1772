"""Cost of one forward against rows per step (vLLM engine or transformers)."""
from __future__ import annotations

FIXED_CHAIN = "vllm_ptd.bench.fixed_chain.FixedChainProposer"

import json
import statistics
import time
from pathlib import Path

from vllm_ptd.bench.engines import engine_opts, start_engines, stop_engines
from vllm_ptd.bench.host import host_info
from vllm_ptd.bench.methods import Method
from vllm_ptd.bench.report import fmt


def _context_ids(model: str, n: int, data_dir: str | None) -> list[int]:
    from transformers import AutoTokenizer

    from vllm_ptd.datasets import load_prompts

    tok = AutoTokenizer.from_pretrained(model)
    text = " ".join(p.text for p in load_prompts("spec_bench", 40, data_dir=data_dir))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def row_cost_vllm(args, rows: list[int], say=print) -> dict:
    """Time one decode step of vLLM with exactly N rows: N=1 plain decoding, N>1 a
    FixedChainProposer drafting N-1 tokens every step (chains; rows cost the same in a tree)."""
    methods = []
    for n in rows:
        spec = None if n == 1 else {"method": "custom_class", "model": FIXED_CHAIN,
                                    "num_speculative_tokens": n - 1}
        methods.append(Method(f"rows={n}", "none" if n == 1 else "fixed", spec))
    ctx = _context_ids(args.model, args.row_cost_context, args.data_dir)
    opts = engine_opts(args, max_num_seqs=1)
    opts["max_model_len"] = max(opts["max_model_len"], args.row_cost_context + args.row_cost_steps + 8)
    out_dir = Path(args.out)
    engines, failed = start_engines(methods, opts, out_dir / "logs", out_dir / "traces",
                                    args.start_jobs, say)
    if "rows=1" in failed:
        stop_engines(engines)
        raise SystemExit(f"[bench] the plain engine failed to start: {failed['rows=1']}")
    per: dict[str, list[float]] = {e.label: [] for e in engines}
    info: dict[str, dict] = {}
    try:
        for e in engines:  # warm-up
            e.generate([ctx], 4, ignore_eos=True)
        for r in range(args.repeats):
            shift = r % len(engines)
            for e in engines[shift:] + engines[:shift]:
                pre = e.generate([ctx], 1, ignore_eos=True)["wall"]
                if args.settle:
                    time.sleep(args.settle)
                res = e.generate([ctx], args.row_cost_steps, ignore_eos=True)
                if args.settle:
                    time.sleep(args.settle)
                c = res["counters"]
                steps = c["drafts"] if e.method.spec else len(res["outputs"][0]) - 1
                per[e.label].append(1000 * (res["wall"] - pre) / max(steps, 1))
                info[e.label] = {"decode_steps": steps, "accepted": c["accepted"],
                                 "prefill_s": pre}
    finally:
        stop_engines(engines)
    out = {}
    base = statistics.median(per["rows=1"]) if per.get("rows=1") else None
    for n in rows:
        xs = per.get(f"rows={n}")
        if not xs:
            continue
        med = statistics.median(xs)
        out[n] = {"ms": med, "ms_all": xs, "ratio": med / base if base else None,
                  **info.get(f"rows={n}", {})}
    return out


def row_cost_hf(args, rows: list[int], say=print) -> dict:
    """Time a transformers forward of N new query rows (causal among themselves) over a KV
    cache of --row-cost-context tokens, logits at every row; the cache is cropped back after
    each forward. No vLLM: model, attention and threading are torch's."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16}.get(
        args.dtype, torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    ctx = torch.tensor([_context_ids(args.model, args.row_cost_context, args.data_dir)])
    reps = max(5, args.row_cost_steps // 4)
    out = {}
    with torch.inference_mode():
        cache = model(ctx, use_cache=True).past_key_values
        times: dict[int, list[float]] = {n: [] for n in rows}
        for n in rows:  # warm-up of each shape
            model(ctx[:, -n:], past_key_values=cache, use_cache=True)
            cache.crop(-n)  # drop the n rows just added
        for _ in range(reps):
            for n in rows:  # interleaved so drift hits every size alike
                q = ctx[:, -n:]
                t0 = time.perf_counter()
                model(q, past_key_values=cache, use_cache=True)
                times[n].append(1000 * (time.perf_counter() - t0))
                cache.crop(-n)
    base = statistics.median(times[rows[0]]) if rows[0] == 1 else None
    for n in rows:
        med = statistics.median(times[n])
        out[n] = {"ms": med, "ms_all": times[n], "ratio": med / base if base else None}
    out["threads"] = torch.get_num_threads()
    return out


def run_row_cost(args) -> None:
    rows = sorted(set(args.row_cost))
    if rows[0] != 1:
        rows = [1] + rows
    backends = [b.strip() for b in args.row_cost_backend.split(",") if b.strip()]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"context": args.row_cost_context, "dtype": args.dtype, "model": args.model,
           "host": host_info()}
    lines = [f"# Cost of one forward against rows per step (context {args.row_cost_context}, "
             f"{args.dtype})", ""]
    for b in backends:
        if b == "vllm":
            r = row_cost_vllm(args, rows)
            what = (f"vLLM engine, batch 1, one decode step with N rows (N=1: plain decoding; N>1: "
                    f"a fixed drafter proposing N-1 tokens each step, verified by vLLM's rejection "
                    f"sampler), median over {args.repeats} repeat(s) of (generate of "
                    f"{args.row_cost_steps} tokens - a 1-token generate) / decode steps; "
                    f"includes the sampler and scheduler work each step")
        elif b == "hf":
            r = row_cost_hf(args, rows)
            what = (f"transformers forward (no vLLM) of N query rows over a {args.row_cost_context}-"
                    f"token KV cache, logits at every row, torch threads {r.pop('threads')}, "
                    f"median over interleaved repeats")
        else:
            raise SystemExit(f"unknown --row-cost-backend {b!r} (vllm, hf)")
        res[b] = {"what": what, "rows": {str(k): v for k, v in r.items()}}
        lines += [f"## {b}", "", what, "", "| rows | ms | ratio to 1 row |", "|---|---|---|"]
        for n in rows:
            if n in r:
                lines.append(f"| {n} | {r[n]['ms']:.2f} | {fmt(r[n]['ratio'])} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    (out_dir / "row_cost.md").write_text(text + "\n")
    (out_dir / "row_cost.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"[bench] wrote {out_dir / 'row_cost.md'} and row_cost.json")
