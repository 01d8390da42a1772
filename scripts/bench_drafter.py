#!/usr/bin/env python
"""What PCTree's drafter costs per step on this machine, apart from any engine: putting
--new-rows target rows per request into the drafter's context (what a proposal does first
with the rows of the steps since the last one), the block (backbone and output projection
over the block) and the tree expansion, for --requests requests drafting together with
contexts of random target rows, in torch's GEMM, in vLLM's prepacked CPU GEMM (fp32 and
bf16, where the CPU has bf16 units) and in its int8 GEMM (``drafter_gemm: "int8"``, the
rest in the dtype an engine would give the drafter), over the drafter's
draft vocabulary and over all words; the vLLM variants also take vLLM's RMS norm op, as in
an engine. --depth cuts the block to that many rows and the expansion to as many stages
(what the budget asks for at a batch size: ``TreeBudget.draft_depth``). Prints the median
ms per call over --calls calls (after two warm-up calls).

In an engine the target's forward runs between two drafting calls and leaves none of the
drafter's weights in the caches; ``--cold-mib N`` writes an N MiB buffer before every timed
call to do the same (600 MiB: about what SmolLM2-135M's fp32 forward reads). vLLM's CPU
engine binds its worker's threads to the cores it does not reserve for its front end (one
core per worker on x86: on a 2-core machine the forward and the drafter run on one core);
``--threads 1`` measures that.

  python scripts/bench_drafter.py [--context 300] [--requests 1,4] [--cold-mib 0,600]
      [--calls 20] [--draft-vocab 0,default] [--new-rows 3] [--threads 1] [--depth 3]
      [--drafters default,<folder or packaged name>]
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=300,
                    help="context rows of the first request (each next one 20 more)")
    ap.add_argument("--requests", default="1",
                    help="comma-separated numbers of requests drafting together")
    ap.add_argument("--cold-mib", default="0",
                    help="comma-separated sizes of the buffer written before each timed call "
                         "(0: warm caches)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's, i.e. every core; an engine's worker "
                         "on a 2-core machine: 1)")
    ap.add_argument("--new-rows", type=int, default=3,
                    help="context rows per request put in before each block (a request's last "
                         "step's root and accepted tokens; more after steps without drafting)")
    ap.add_argument("--draft-vocab", default="0,default",
                    help="draft-vocabulary sizes (speculative_config['draft_vocab']; 0: all words, "
                         "default: the drafter folder's)")
    ap.add_argument("--drafters", default="default",
                    help="comma-separated drafters (speculative_config['model']: a folder or a "
                         "packaged drafter's name; default: the default drafter)")
    ap.add_argument("--depth", type=int, default=None,
                    help="block rows and expansion stages (default: the drafter's block size)")
    args = ap.parse_args()

    import torch

    from vllm_ptd.hardware import cpu_has_fast_bf16
    from vllm_ptd.integration.proposer import (engine_int8_linear_kernel, engine_linear_kernel,
                                               engine_rms_norm_kernel)
    from vllm_ptd.model_store import ensure_default_model
    from vllm_ptd.pctree.config import PCTreeConfig
    from vllm_ptd.pctree.expand import expand_trees
    from vllm_ptd.pctree.method import PCTreeMethod

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def ms(fn, sweep: torch.Tensor | None) -> float:
        fn(), fn()
        times = []
        for _ in range(args.calls):
            if sweep is not None:
                sweep.fill_(1.0)
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)

    target = ensure_default_model()
    kernel = engine_linear_kernel(torch.device("cpu"))
    int8_kernel = engine_int8_linear_kernel(torch.device("cpu"))
    norm_kernel = engine_rms_norm_kernel(torch.device("cpu"))
    # the int8 variant in the dtype an engine gives the drafter beside it (``drafter_dtype:
    # "auto"``); vLLM's bf16 GEMM cannot be built on a CPU without bf16 units (oneDNN has no
    # primitive for it there)
    fast_bf16 = cpu_has_fast_bf16()
    auto = torch.bfloat16 if fast_bf16 else torch.float32
    variants = [("torch", None, torch.float32), ("vLLM oneDNN", kernel, torch.float32),
                ("vLLM oneDNN", kernel if fast_bf16 else None, torch.bfloat16),
                ("vLLM oneDNN int8", int8_kernel, auto)]
    sizes = [None if v.strip() == "default" else int(v) for v in args.draft_vocab.split(",")]
    counts = [int(v) for v in args.requests.split(",")]
    colds = [int(v) for v in args.cold_mib.split(",")]
    print(f"torch threads {torch.get_num_threads()}; context {args.context} rows (+20 per request); "
          f"block rows and stages: {args.depth or 'the block size'}\n")
    drafters = [None if v.strip() == "default" else v.strip() for v in args.drafters.split(",")]
    print(f"| drafter | GEMM | dtype | draft vocabulary | requests | caches | {args.new_rows} new "
          f"context rows ms | block ms | expansion ms | total ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for drafter, (name, make, dtype), size in (
            (d, v, s) for d in drafters for v in variants for s in sizes):
        label = drafter or "default"
        if make is None and name != "torch":
            print(f"| {label} | {name} | {str(dtype).replace('torch.', '')} | — | — | — | — | — "
                  f"| — | not available here |")
            continue
        m = PCTreeMethod(PCTreeConfig(model=drafter, draft_vocab=size), target, dtype=dtype,
                         linear_kernel=make, norm_kernel=None if make is None else norm_kernel)
        d, c = m.drafter, m.config
        depth = c.depth if args.depth is None else max(1, min(c.depth, args.depth))
        gen = torch.Generator().manual_seed(0)
        for n, cold in ((n, cold) for n in counts for cold in colds):
            ctxs = []
            for i in range(n):
                ctx = d.new_context(4096)
                rows = torch.randn(args.context + 20 * i, d.context_dim, generator=gen)
                d.append_context(ctx, rows, 0)
                ctxs.append(ctx)
            roots = [5 + i for i in range(n)]
            sweep = torch.empty(cold * 2 ** 20 // 4) if cold else None
            new_rows = [torch.randn(args.new_rows, d.context_dim, generator=gen) for _ in ctxs]

            def flush():
                # appended, then taken back, so that every call sees contexts of one size
                saved = [(context.length, context.next_position) for context in ctxs]
                d.append_contexts(ctxs, new_rows)
                for context, (length, pos) in zip(ctxs, saved):
                    context.length, context.next_position = length, pos

            with torch.no_grad():
                append = ms(flush, sweep) if args.new_rows else 0.0
                U, h = d.draft_block(ctxs, roots, rows=depth)
                block = ms(lambda: d.draft_block(ctxs, roots, rows=depth), sweep)
                expand = ms(lambda: expand_trees(U, roots, markov=d.markov_head, hidden=h,
                                                 k=c.branching, max_nodes=c.max_nodes,
                                                 depth=depth, mode=c.mode,
                                                 vocab_ids=d.draft_vocab), sweep)
            caches = f"cold ({cold} MiB written)" if cold else "warm"
            print(f"| {label} | {name} | {str(dtype).replace('torch.', '')} | {U.shape[-1]} | {n} | "
                  f"{caches} | {append:.1f} | {block:.1f} | {expand:.1f} | "
                  f"{append + block + expand:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
