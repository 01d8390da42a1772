#!/usr/bin/env python
"""PTD in the reference engine next to plain decoding, on MT-Bench + GSM8K prompts.

Prints one row per method: tokens/s, speedup over plain decoding, DE, AL, HR, Dft/Ver, and how
many outputs are token-identical to plain greedy decoding. ``--out`` writes the same as JSON
(with per-dataset figures and per-prompt details).

    python scripts/bench_reference.py                        # PTD w=4 d=6, the CPU budgets (4/2)
    python scripts/bench_reference.py --budgets 12/12,24/32  # and two more verify/draft budgets
    python scripts/bench_reference.py --dtype bf16 --out results/ref_bf16.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from vllm_ptd.ptd.config import PTDConfig
from vllm_ptd.datasets import chat_prompt_ids, load_prompts
from vllm_ptd.metrics import SpecMetrics
from vllm_ptd.model_store import ensure_default_model
from vllm_ptd.ptd.method import PTDMethod
from vllm_ptd.reference import ReferenceEngine

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_budgets(text: str) -> list[tuple[int, int]]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            nv, nd = (int(x) for x in part.split("/"))
        except ValueError:
            raise SystemExit(f"--budgets: {part!r} is not VERIFY/DRAFT, e.g. 12/12")
        out.append((nv, nd))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF model folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--mt-bench", type=int, default=10, help="MT-Bench prompts (first turns)")
    ap.add_argument("--gsm8k", type=int, default=10, help="GSM8K prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--budgets", default="", help="extra VERIFY/DRAFT node budgets, "
                    "comma-separated (the default run uses the CPU defaults)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steady "
                    "figures on a shared machine; 0 keeps torch's default)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or ensure_default_model()
    engine = ReferenceEngine(model, dtype=DTYPES[args.dtype])
    tok = engine.tokenizer
    if tok is None:
        raise SystemExit(f"{model} has no tokenizer: the chat prompts need one")
    prompts = [(p.dataset, p.id, chat_prompt_ids(tok, p.text))
               for name, n in (("mt_bench", args.mt_bench), ("gsm8k", args.gsm8k)) if n > 0
               for p in load_prompts(name, n)]

    configs = [("ptd", None, None)] + [(f"ptd {nv}/{nd}", nv, nd)
                                       for nv, nd in parse_budgets(args.budgets)]
    print(f"# {len(prompts)} prompts x {args.max_new_tokens} new tokens, {args.dtype}, "
          f"{torch.get_num_threads()} threads, w={args.width} d={args.depth}", file=sys.stderr)

    engine.generate(prompts[0][2], 4)  # warm-up: first-call allocations stay out of timings
    plain = []
    for ds, pid, ids in prompts:
        g = engine.generate(ids, args.max_new_tokens)
        plain.append(g)
        print(f"  plain {pid}: {len(g.tokens)} tokens {g.tokens_per_second:.1f} tok/s",
              file=sys.stderr)
    plain_s = sum(g.seconds for g in plain)
    plain_tokens = sum(len(g.tokens) for g in plain)
    rows = [dict(method="plain", tokens=plain_tokens, seconds=plain_s,
                 tok_per_s=plain_tokens / plain_s, speedup=1.0, identical=len(plain))]
    details = {"plain": [dict(id=pid, output_tokens=len(g.tokens), seconds=g.seconds)
                         for (_, pid, _), g in zip(prompts, plain)]}

    for name, nv, nd in configs:
        cfg = PTDConfig(width=args.width, depth=args.depth, max_verify_nodes=nv,
                        max_draft_nodes=nd).resolved(str(engine.device))
        gens = []
        for (ds, pid, ids), ref in zip(prompts, plain):
            g = engine.generate(ids, args.max_new_tokens, PTDMethod(cfg, engine.eos_token_ids))
            gens.append(g)
            print(f"  {name} {pid}: DE {g.metrics.decoding_efficiency:.2f} "
                  f"{g.tokens_per_second:.1f} tok/s same={g.tokens == ref.tokens}",
                  file=sys.stderr)
        total = SpecMetrics.merged(g.metrics for g in gens)
        secs = sum(g.seconds for g in gens)
        toks = sum(len(g.tokens) for g in gens)
        by_ds = {}
        for ds in dict.fromkeys(d for d, _, _ in prompts):
            m = SpecMetrics.merged(g.metrics for (d, _, _), g in zip(prompts, gens) if d == ds)
            by_ds[ds] = m.as_dict()
        rows.append(dict(method=name, seconds=secs, tok_per_s=toks / secs,
                         speedup=(toks / secs) / (plain_tokens / plain_s),
                         identical=sum(g.tokens == r.tokens for g, r in zip(gens, plain)),
                         max_verify_nodes=cfg.max_verify_nodes,
                         max_draft_nodes=cfg.max_draft_nodes, **total.as_dict(),
                         datasets=by_ds))
        details[name] = [dict(id=pid, output_tokens=len(g.tokens), seconds=g.seconds,
                              **g.metrics.as_dict())
                         for (_, pid, _), g in zip(prompts, gens)]

    head = f"{'method':<14}{'tok/s':>8}{'speedup':>9}{'DE':>7}{'AL':>7}{'HR':>7}{'Dft/Ver':>12}{'same':>8}"
    print(head)
    for r in rows:
        spec = r["method"] != "plain"
        figs = (f"{r['DE']:>7.3f}{r['AL']:>7.3f}{r['HR']:>7.3f}"
                f"{r['Dft']:>6.1f}/{r['Ver']:<5.1f}" if spec else f"{'1.000':>7}{'-':>7}{'-':>7}{'-':>12}")
        print(f"{r['method']:<14}{r['tok_per_s']:>8.1f}{r['speedup']:>8.2f}x{figs}"
              f"{r['identical']:>5}/{len(prompts)}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        info = dict(model=model, dtype=args.dtype, threads=torch.get_num_threads(),
                    prompts=len(prompts), max_new_tokens=args.max_new_tokens,
                    width=args.width, depth=args.depth, machine=platform.processor() or
                    platform.machine(), time=time.strftime("%Y-%m-%dT%H:%M:%S"))
        with open(args.out, "w") as f:
            json.dump(dict(setup=info, results=rows, per_prompt=details), f, indent=1)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
