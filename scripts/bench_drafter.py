#!/usr/bin/env python
"""What PCTree's drafter costs per step on this machine, apart from any engine: the block
(backbone and output projection over the block) and the tree expansion, for one request
with a context of random target rows, in torch's GEMM and in vLLM's prepacked CPU GEMM
(fp32 and bf16), over the drafter's draft vocabulary and over all words. Prints ms per call
(mean of --calls after two warm-up calls).

  python scripts/bench_drafter.py [--context 300] [--calls 20] [--draft-vocab 0,8192]
"""
from __future__ import annotations

import argparse
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=300, help="context rows of the request")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--draft-vocab", default="0,default",
                    help="draft-vocabulary sizes (speculative_config['draft_vocab']; 0: all words, "
                         "default: the drafter folder's)")
    args = ap.parse_args()

    import torch

    from vllm_ptd.integration.proposer import engine_linear_kernel
    from vllm_ptd.model_store import ensure_default_model
    from vllm_ptd.pctree.config import PCTreeConfig
    from vllm_ptd.pctree.expand import expand_trees
    from vllm_ptd.pctree.method import PCTreeMethod

    def ms(fn) -> float:
        fn(), fn()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        return 1000 * (time.perf_counter() - t0) / args.calls

    target = ensure_default_model()
    kernel = engine_linear_kernel(torch.device("cpu"))
    variants = [("torch", None, torch.float32), ("vLLM oneDNN", kernel, torch.float32),
                ("vLLM oneDNN", kernel, torch.bfloat16)]
    sizes = [None if v.strip() == "default" else int(v) for v in args.draft_vocab.split(",")]
    print(f"torch threads {torch.get_num_threads()}; context {args.context} rows\n")
    print("| GEMM | dtype | draft vocabulary | block ms | expansion ms | total ms |")
    print("|---|---|---|---|---|---|")
    for (name, make, dtype), size in ((v, s) for v in variants for s in sizes):
        if make is None and name != "torch":
            print(f"| {name} | {dtype} | — | — | — | not available |")
            continue
        m = PCTreeMethod(PCTreeConfig(draft_vocab=size), target, dtype=dtype, linear_kernel=make)
        d, c = m.drafter, m.config
        ctx = d.new_context(4096)
        d.append_context(ctx, torch.randn(args.context, d.context_dim,
                                          generator=torch.Generator().manual_seed(0)), 0)
        with torch.no_grad():
            U, h = d.draft_block([ctx], [5])
            block = ms(lambda: d.draft_block([ctx], [5]))
            expand = ms(lambda: expand_trees(U, [5], markov=d.markov_head, hidden=h,
                                             k=c.branching, max_nodes=c.max_nodes,
                                             depth=c.depth, mode=c.mode, vocab_ids=d.draft_vocab))
        words = U.shape[-1]
        print(f"| {name} | {str(dtype).replace('torch.', '')} | {words} | {block:.1f} | "
              f"{expand:.1f} | {block + expand:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
