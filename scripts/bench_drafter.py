#!/usr/bin/env python
"""What PCTree's drafter costs per step on this machine, apart from any engine: the block
(backbone and output projection over the block) and the tree expansion, for one request
with a context of random target rows, in torch's GEMM and in vLLM's prepacked CPU GEMM
(fp32 and bf16). Prints ms per call (mean of --calls after two warm-up calls).

  python scripts/bench_drafter.py [--context 300] [--calls 20]
"""
from __future__ import annotations

import argparse
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=300, help="context rows of the request")
    ap.add_argument("--calls", type=int, default=20)
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
    print(f"torch threads {torch.get_num_threads()}; context {args.context} rows\n")
    print("| GEMM | dtype | block ms | expansion ms | total ms |")
    print("|---|---|---|---|---|")
    for name, make, dtype in variants:
        if make is None and name != "torch":
            print(f"| {name} | {dtype} | — | — | not available |")
            continue
        m = PCTreeMethod(PCTreeConfig(), target, dtype=dtype, linear_kernel=make)
        d, c = m.drafter, m.config
        ctx = d.new_context(4096)
        d.append_context(ctx, torch.randn(args.context, d.context_dim,
                                          generator=torch.Generator().manual_seed(0)), 0)
        with torch.no_grad():
            U, h = d.draft_block([ctx], [5])
            block = ms(lambda: d.draft_block([ctx], [5]))
            expand = ms(lambda: expand_trees(U, [5], markov=d.markov_head, hidden=h,
                                             k=c.branching, max_nodes=c.max_nodes,
                                             depth=c.depth, mode=c.mode))
        print(f"| {name} | {str(dtype).replace('torch.', '')} | {block:.1f} | {expand:.1f} | "
              f"{block + expand:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
