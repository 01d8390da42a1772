#!/usr/bin/env python
"""PCTree vs its controls in the reference engine (no vLLM): chain DSpark, Shared-Markov tree
and PCTree at an equal node budget, greedy decoding, on GSM8K, HumanEval, MBPP and MT-Bench
prompts (the project's benchmark sets, ``vllm_ptd.datasets``).

Per dataset and mode: tau (committed tokens per target forward, bonus included), rounds per
sample, survival S(d) = P[accepted >= d], verified-node utilisation (accepted draft tokens /
verified non-root nodes), tree rows per step, and whether the output equals plain decoding
(``--check-plain``). Prints a table, writes JSON (``--out``).

Example: ``nice python scripts/bench_pctree.py -n 5 --max-new-tokens 96``
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle threads sleep on a shared CPU

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_ptd.pctree.config import PCTreeConfig  # noqa: E402
from vllm_ptd.metrics import SpecMetrics  # noqa: E402
from vllm_ptd.pctree.method import PCTreeMethod  # noqa: E402

DATASETS = ("gsm8k", "humaneval", "mbpp", "mt_bench")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target HF folder (default: vllm_ptd.model_store)")
    ap.add_argument("--drafter", default=None, help="DSpark folder (default: packaged / $VLLM_PTD_DSPARK)")
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    ap.add_argument("-n", "--prompts", type=int, default=5, help="first n prompts of each set")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--modes", nargs="+", default=["chain", "shared", "pctree"],
                    choices=["chain", "shared", "pctree"])
    ap.add_argument("-k", "--branching", type=int, default=4)
    ap.add_argument("-N", "--max-nodes", type=int, default=16, help="verified nodes incl. the root (all modes)")
    ap.add_argument("--depth", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--check-plain", action="store_true", help="also decode plainly and compare outputs")
    ap.add_argument("--out", default="bench_pctree.json")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    from vllm_ptd.datasets import chat_prompt_ids, load_prompts
    from vllm_ptd.reference import ReferenceEngine

    target = args.target
    if target is None:
        from vllm_ptd.model_store import ensure_default_model
        target = ensure_default_model()
    dtype = getattr(torch, args.dtype)
    eng = ReferenceEngine(target, dtype=dtype)
    emb = (eng.model.get_input_embeddings().weight, eng.model.get_output_embeddings().weight)
    methods = {}
    for mode in args.modes:
        cfg = PCTreeConfig(model=args.drafter, branching=None if mode == "chain" else args.branching,
                           max_nodes=args.max_nodes, depth=args.depth, mode=mode)
        methods[mode] = PCTreeMethod(cfg, eng.model.config, emb)
    any_m = next(iter(methods.values()))
    print(f"target {target} ({args.dtype}); drafter {any_m.drafter_path}; block {any_m.drafter.block_size}, "
          f"taps {any_m.hidden_layer_ids}; k={args.branching} N={args.max_nodes}", flush=True)

    results: dict = {"config": {k: v for k, v in vars(args).items()}, "drafter": str(any_m.drafter_path),
                     "datasets": {}}
    t_all = time.time()
    for ds in args.datasets:
        prompts = load_prompts(ds, args.prompts)
        per_mode = {m: SpecMetrics() for m in methods}
        secs = {m: 0.0 for m in methods}
        same = {m: 0 for m in methods}
        samples = 0
        for i, pr in enumerate(prompts):
            ids = chat_prompt_ids(eng.tokenizer, pr.text)
            ids = ids[-(eng.max_model_len - args.max_new_tokens - 1):]
            plain = eng.generate(ids, args.max_new_tokens) if args.check_plain else None
            samples += 1
            for mode, m in methods.items():
                g = eng.generate(ids, args.max_new_tokens, m, req_id=f"{ds}-{i}-{mode}")
                per_mode[mode].merge(g.metrics)
                secs[mode] += g.seconds
                if plain is not None and g.tokens == plain.tokens:
                    same[mode] += 1
            print(f"  {ds} {i + 1}/{len(prompts)}: " + "  ".join(
                f"{m} tau {per_mode[m].tau:.2f}" for m in methods), flush=True)
        out = {}
        for mode, mt in per_mode.items():
            d = mt.as_dict()
            d.update(tau=mt.tau, rounds_per_sample=mt.steps / max(samples, 1), survival=mt.survival(),
                     utilisation=mt.utilisation, verify_per_step=mt.verify_per_step,
                     tokens_per_second=mt.committed / secs[mode] if secs[mode] else 0.0)
            if args.check_plain:
                d["equal_to_plain"] = f"{same[mode]}/{samples}"
            out[mode] = d
        results["datasets"][ds] = out

    # table
    modes = list(methods)
    print()
    hdr = f"{'dataset':10s} {'mode':7s} {'tau':>6s} {'rounds':>7s} {'util':>6s} {'rows':>5s} " + \
          " ".join(f"S({d})".rjust(5) for d in range(1, any_m.config.depth + 1))
    print(hdr)
    print("-" * len(hdr))
    for ds, res in results["datasets"].items():
        for mode in modes:
            r = res[mode]
            surv = r["survival"] + [0.0] * (any_m.config.depth + 1 - len(r["survival"]))
            print(f"{ds:10s} {mode:7s} {r['tau']:6.3f} {r['rounds_per_sample']:7.1f} {r['utilisation']:6.3f} "
                  f"{r['verify_per_step']:5.1f} " + " ".join(f"{s:5.2f}" for s in surv[1: any_m.config.depth + 1])
                  + (f"  plain-equal {r['equal_to_plain']}" if "equal_to_plain" in r else ""))
    overall = {}
    for mode in modes:
        steps = committed = accepted = verify = 0
        for res in results["datasets"].values():
            steps += res[mode]["steps"]
            committed += res[mode]["tokens"]
            accepted += res[mode]["accepted"]
            verify += res[mode]["verify_per_step"] * res[mode]["steps"]
        overall[mode] = {"tau": committed / max(steps, 1), "utilisation": accepted / max(verify, 1)}
    results["overall"] = overall
    print("overall: " + "  ".join(f"{m} tau {v['tau']:.3f} util {v['utilisation']:.3f}" for m, v in overall.items()))
    results["seconds"] = time.time() - t_all
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out} ({results['seconds'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
