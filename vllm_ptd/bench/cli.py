"""Offline benchmark of speculative-decoding methods in vLLM (PTD, PCTree, vLLM ngram).

All methods run in ONE invocation, each in its own long-lived engine process (all loaded at
once), and they take turns on every batch of prompts, the order rotating from one batch to
the next. A shared, drifting machine therefore affects every method alike, and the speedup
(tok/s of a method / tok/s of plain decoding, per dataset, batch size and repeat) cancels the
drift; it is reported as mean +- sample standard deviation over repeats.

  python scripts/benchmark.py --out results/bench                       # everything
  python scripts/benchmark.py --datasets gsm8k,mbpp --num-prompts 20 --batch-sizes 1 \
      --methods none,ngram:3,ptd --max-tokens 128 --repeats 3 --out results/small
  python scripts/benchmark.py --dtype float32 ...    # token identity to plain decoding
  python scripts/benchmark.py --row-cost 1,8,16,32,64 --out results/rowcost
  python scripts/benchmark.py --online ...           # = scripts/bench_serving.py ...

Methods (``--methods``, comma separated; ``name:key=value:...``):
  none                       plain decoding (always run: the reference of every ratio)
  ngram:K[:key=value...]     vLLM's prompt-lookup drafter, K draft tokens per step:
                             {"method": "ngram", "num_speculative_tokens": K,
                              "prompt_lookup_min": 2, "prompt_lookup_max": 5} (the values of
                             vLLM's examples/offline_inference/spec_decode.py); keys override
  ptd[:key=value...]         {"method": "ptd", "history_same_prompt": false, key: value, ...}
                             (vllm_ptd.ptd.config.PTDConfig): earlier requests' texts, but
                             not those of the same prompt, which a repeat would copy
  pctree[:key=value...]      {"method": "pctree", key: value, ...}  (vllm_ptd.pctree.config)
  suffix[:key=value...]      vLLM's suffix decoding (needs arctic-inference: scripts/setup.sh
                             --with-suffix; skipped with a note when it is missing), with
                             its global cache of earlier responses off
                             (suffix_decoding_max_cached_requests=0): repeats would
                             otherwise be served from the previous repeat's outputs
A method whose engine fails to start (e.g. PCTree before its drafter exists) is skipped with
the reason; the others run. Engine logs go to OUT/logs/<method>.log.

Measured per method: tok/s = generated tokens / wall time of its generate calls (prompts of
one batch are submitted together, greedy, stop at EOS or --max-tokens; with --batching
continuous all of a dataset's prompts go in one call, at most the batch size running at
once); speedup vs none;
token identity vs none (the same prompt, batch and repeat). Speculation metrics come from
the proposer trace (VLLM_PTD_TRACE, one line per request and tree step) for ptd/pctree and
from vLLM's spec-decode counters for ngram; both are kept for every method as a cross-check.
  DE, AL, HR, tau, Dft/Ver   per speculative step (vllm_ptd.metrics definitions)
  DE_all                     generated tokens / request-steps over all steps, prefill and
                             steps without a draft included; request-steps =
                             max(gen - accepted, speculative steps + requests), exact unless
                             a request's last step was cut at EOS / --max-tokens
  rows/step                  extra rows (draft + verify) per request-step over all steps
For the tree methods the report also shows where a step's time goes (the proposer's
StepClock: forward, tree attention, verification, drafting, budget, vLLM's host work).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vllm_ptd.bench.host import REPO, resolve_common_args
from vllm_ptd.bench.methods import DEFAULT_METHODS, int_list, parse_methods
from vllm_ptd.bench.offline import replot, run_benchmark
from vllm_ptd.bench.row_cost import run_row_cost


DEFAULT_DATASETS = "mt_bench,spec_bench,gsm8k,humaneval,mbpp"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", default=None, help="HF model folder (default: the embedded model)")
    ap.add_argument("--methods", default=DEFAULT_METHODS,
                    help="comma separated: none, ngram:K, suffix, ptd, pctree, each with "
                         "optional :key=value; <method>@<tag> runs a method again in its own "
                         "engine (none@2: a second plain engine, the run's noise control)")
    ap.add_argument("--datasets", default=DEFAULT_DATASETS)
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="prompts per dataset (default: all; gsm8k/mbpp: their 100-sample)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--min-tokens-limit", type=int, default=None,
                    help="each prompt's own limit on new tokens, drawn from [this, --max-tokens] "
                         "(fixed per prompt, the same for every method and repeat): requests "
                         "that end at different steps, as a service's do, instead of every "
                         "request running to --max-tokens in the same step (default: "
                         "--max-tokens for all)")
    ap.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16])
    ap.add_argument("--batching", choices=["closed", "continuous"], default="closed",
                    help="closed: each batch of --batch-sizes prompts is submitted together and "
                         "ends with its slowest request; continuous: each dataset's prompts in "
                         "one call to engines with max_num_seqs = the batch size, a waiting "
                         "request starting whenever one finishes (one batch size per run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto",
                    help="auto (bf16 on GPUs and CPUs with native bf16, else fp32) | bfloat16 | "
                         "float16 | float32 (fp32)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no torch.compile (faster engine start, slower decoding)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="enable vLLM's prefix cache (off by default: repeats would skip prefill, "
                         "and pctree turns it off for itself)")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="KV cache per engine (default 0.5 GiB, 1 GiB in float32); an "
                         "environment VLLM_CPU_KVCACHE_SPACE (integer GiB) overrides it")
    ap.add_argument("--start-jobs", type=int, default=2, help="engines loading at the same time")
    ap.add_argument("--settle", type=float, default=1.2,
                    help="seconds of pause after each generate call, not timed: vLLM's idle "
                         "worker busy-polls for 1 s after its last step")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--out", default=None, help="output folder (default results/bench-<time>)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--row-cost", type=int_list, default=None, metavar="N,N,...",
                    help="instead of the benchmark: cost of one forward against rows per step")
    ap.add_argument("--row-cost-backend", default="vllm,hf", help="vllm, hf or both")
    ap.add_argument("--row-cost-context", type=int, default=256)
    ap.add_argument("--row-cost-steps", type=int, default=64)
    ap.add_argument("--replot", default=None, metavar="RESULTS_JSON",
                    help="rewrite results.md and the plots of an earlier run from its "
                         "results.json (with --row-cost-json: add the break-even curve)")
    ap.add_argument("--row-cost-json", default=None, metavar="PATH",
                    help="row_cost.json of a --row-cost run on the same machine: the DE plot "
                         "then shows the break-even line (DE needed to pay for the rows)")
    ap.add_argument("--online", action="store_true",
                    help="serving benchmark: the remaining arguments go to scripts/bench_serving.py")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--online" in argv:
        argv.remove("--online")
        from vllm_ptd.bench import serving

        return serving.main(argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.replot:
        replot(Path(args.replot), args.row_cost_json)
        return 0
    resolve_common_args(args)
    if args.out is None:
        args.out = str(REPO / "results" / time.strftime("bench-%Y%m%d-%H%M%S"))
    if args.row_cost:
        run_row_cost(args)
        return 0
    try:
        methods = parse_methods(args.methods)
    except ValueError as e:
        ap.error(str(e))
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    from vllm_ptd.datasets import DATASETS

    bad = [d for d in datasets if d not in DATASETS]
    if bad:
        ap.error(f"unknown dataset(s) {bad}; choose from {', '.join(DATASETS)}")
    if args.batching == "continuous" and len(args.batch_sizes) != 1:
        ap.error(f"--batching continuous runs one batch size (the engines' max_num_seqs), "
                 f"got --batch-sizes {','.join(map(str, args.batch_sizes))}")
    result = run_benchmark(args, methods, datasets)
    return 0 if result else 1
