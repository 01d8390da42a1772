#!/usr/bin/env python
"""Time the tree kernels against their torch twins (and tree attention against dense SDPA).

    python scripts/bench_kernels.py --out bench_kernels.json

On a GPU: for batches of 1 and 16 trees, checks each Triton kernel against its twin, times
both (triton.testing.do_bench, milliseconds) and prints twin/Triton ratios; tree attention is
also timed against torch SDPA over padded dense K/V with a dense boolean mask (the dense
baseline excludes the cost of building those dense tensors). Exit status 1 if a check fails.

Without a GPU: says so, runs a tiny check of every kernel under Triton's CPU interpreter and
exits 0 (1 if that check fails).

Standalone: needs only torch and triton. Uses the installed ``vllm_ptd.kernels`` or, when the
project is not installed, the repository's ``kernels/`` folder.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must precede the kernels' import: triton.jit picks the interpreter at decoration time.
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import vllm_ptd.kernels as K
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import kernels as K  # noqa: E402

from importlib import import_module  # noqa: E402

_mask_mod = import_module(K.__name__ + ".tree_mask")
_pos_mod = import_module(K.__name__ + ".tree_positions")
_kv_mod = import_module(K.__name__ + ".kv_compact")
_attn_mod = import_module(K.__name__ + ".tree_attention")


def random_trees(rng: random.Random, batch: int, max_nodes: int) -> list[list[int]]:
    """Parent lists (-1 = root, parents first), sizes between max_nodes/2 and max_nodes."""
    trees = []
    for _ in range(batch):
        n = rng.randint(max(1, max_nodes // 2), max_nodes)
        trees.append([rng.randint(max(-1, i - 4), i - 1) for i in range(n)])
    return trees


def depths_of(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


class Workload:
    def __init__(self, rng: random.Random, batch: int, max_nodes: int, context: int, *, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, device: str):
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        self.parent_lists = random_trees(rng, batch, max_nodes)
        sizes = [len(p) for p in self.parent_lists]
        i32 = dict(dtype=torch.int32, device=device)
        self.parents = torch.tensor([p for ps in self.parent_lists for p in ps], **i32)
        self.depths = torch.tensor([d for ps in self.parent_lists for d in depths_of(ps)], **i32)
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        self.offsets = torch.tensor(offsets, **i32)
        # Verify the first half of each tree, causal tail from there: a realistic PTD split.
        self.causal_from = torch.tensor([n // 2 for n in sizes], **i32)
        self.contexts = [context] * batch
        self.seq_lens = [context + n + 1 for n in sizes]
        self.max_rows = max(sizes) + 1
        blocks_per_req = [-(-s // block_size) for s in self.seq_lens]
        num_blocks = sum(blocks_per_req) + 1
        perm = torch.randperm(num_blocks, generator=gen)
        table = torch.zeros(batch, max(blocks_per_req), dtype=torch.int32)
        used = 0
        for b, nb in enumerate(blocks_per_req):
            table[b, :nb] = perm[used:used + nb]
            used += nb
        self.block_table = table.to(device)
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
        self.value_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
        self.query_starts = torch.tensor([offsets[b] + b for b in range(batch)], **i32)
        self.query = torch.randn(offsets[-1] + batch, num_q_heads, head_dim, generator=gen).to(dtype).to(device)
        self.context_lens = torch.tensor(self.contexts, **i32)
        self.base_positions = torch.tensor(self.contexts, dtype=torch.int64, device=device)
        self.scale = head_dim ** -0.5
        self.device = device
        # Accepted path per request: the chain from a random node up to the root.
        src, dst = [], []
        for b, ps in enumerate(self.parent_lists):
            node, path = rng.randrange(len(ps)), []
            while node >= 0:
                path.append(node)
                node = ps[node]
            for k, node in enumerate(reversed(path)):
                src.append(self.slot(b, context + 1 + node))
                dst.append(self.slot(b, context + 1 + k))
        self.src_slots = torch.tensor(src, dtype=torch.int64, device=device)
        self.dst_slots = torch.tensor(dst, dtype=torch.int64, device=device)

    def slot(self, b: int, index: int) -> int:
        return int(self.block_table[b, index // self.block_size]) * self.block_size + index % self.block_size

    def tree_mask(self, fn):
        return fn(self.parents, self.offsets, self.causal_from)

    def attention(self, fn, tree_mask):
        return fn(self.query, self.key_cache, self.value_cache, self.block_table, self.context_lens,
                  self.query_starts, self.offsets, tree_mask, self.scale, max_rows=self.max_rows)

    def dense_inputs(self, tree_mask):
        """Padded [B, Hq, L, D] K/V, [B, Hq, Q, D] queries and a [B, 1, Q, L] bool mask for SDPA."""
        batch = len(self.parent_lists)
        group = self.query.shape[1] // self.key_cache.shape[2]
        max_len, max_q = max(self.seq_lens), self.max_rows
        q = torch.zeros(batch, self.query.shape[1], max_q, self.query.shape[2], dtype=self.query.dtype,
                        device=self.device)
        k = torch.zeros(batch, self.query.shape[1], max_len, self.query.shape[2], dtype=self.query.dtype,
                        device=self.device)
        v = torch.zeros_like(k)
        mask = torch.zeros(batch, 1, max_q, max_len, dtype=torch.bool, device=self.device)
        mask[:, :, :, 0] = True  # padding query rows see one key, so SDPA never meets an empty row
        for b, ps in enumerate(self.parent_lists):
            rows, ctx, length = len(ps) + 1, self.contexts[b], self.seq_lens[b]
            seq = torch.arange(length, device=self.device)
            blocks = self.block_table[b].long()[seq // self.block_size]
            slots = (blocks, seq % self.block_size)
            k[b, :, :length] = self.key_cache[slots].repeat_interleave(group, 1).transpose(0, 1)
            v[b, :, :length] = self.value_cache[slots].repeat_interleave(group, 1).transpose(0, 1)
            start = int(self.query_starts[b])
            q[b, :, :rows] = self.query[start:start + rows].transpose(0, 1)
            mask[b, 0, :rows, :ctx] = True
            mask[b, 0, :rows, ctx:length] = tree_mask.request(b)
        return q, k, v, mask


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50))


def run_gpu(args) -> dict:
    import torch.nn.functional as F

    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": []}
    ok = True
    for batch in (1, 16):
        rng = random.Random(batch)
        w = Workload(rng, batch, args.max_nodes, args.context, num_q_heads=args.q_heads, num_kv_heads=args.kv_heads,
                     head_dim=args.head_dim, block_size=args.block_size, dtype=torch.bfloat16, device="cuda")
        case: dict = {"batch": batch, "nodes": int(w.offsets[-1]), "context": args.context}

        mask_tr = w.tree_mask(_mask_mod.build_tree_mask_triton)
        mask_tw = w.tree_mask(_mask_mod.build_tree_mask_torch)
        case["mask_equal"] = bool(torch.equal(mask_tr.mask, mask_tw.mask))
        case["mask_ms"] = {"triton": bench_ms(lambda: w.tree_mask(_mask_mod.build_tree_mask_triton)),
                           "torch": bench_ms(lambda: w.tree_mask(_mask_mod.build_tree_mask_torch))}

        pos_args = (w.depths, w.offsets, w.base_positions)
        case["positions_equal"] = bool(torch.equal(_pos_mod.build_tree_positions_triton(*pos_args),
                                                   _pos_mod.build_tree_positions_torch(*pos_args)))
        case["positions_ms"] = {"triton": bench_ms(lambda: _pos_mod.build_tree_positions_triton(*pos_args)),
                                "torch": bench_ms(lambda: _pos_mod.build_tree_positions_torch(*pos_args))}

        cache_tr, cache_tw = w.key_cache.clone(), w.key_cache.clone()
        _kv_mod.compact_kv_triton(cache_tr, w.src_slots, w.dst_slots, paged=True)
        _kv_mod.compact_kv_torch(cache_tw, w.src_slots, w.dst_slots, paged=True)
        case["compact_equal"] = bool(torch.equal(cache_tr, cache_tw))
        case["compact_pairs"] = int(w.src_slots.numel())
        case["compact_ms"] = {
            "triton": bench_ms(lambda: _kv_mod.compact_kv_triton(cache_tr, w.src_slots, w.dst_slots, paged=True)),
            "torch": bench_ms(lambda: _kv_mod.compact_kv_torch(cache_tw, w.src_slots, w.dst_slots, paged=True)),
        }

        out_tr = w.attention(_attn_mod.tree_attention_triton, mask_tw)
        out_tw = w.attention(_attn_mod.tree_attention_torch, mask_tw)
        q, k, v, dense_mask = w.dense_inputs(mask_tw)
        case["attention_max_err"] = float((out_tr.float() - out_tw.float()).abs().max())
        case["attention_ok"] = case["attention_max_err"] < 3e-2
        case["attention_ms"] = {
            "triton": bench_ms(lambda: w.attention(_attn_mod.tree_attention_triton, mask_tw)),
            "torch": bench_ms(lambda: w.attention(_attn_mod.tree_attention_torch, mask_tw)),
            "sdpa_dense": bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask,
                                                                          scale=w.scale)),
        }
        for name in ("mask", "positions", "compact", "attention"):
            t = case[f"{name}_ms"]
            case[f"{name}_torch_over_triton"] = t["torch"] / t["triton"]
        case["attention_sdpa_over_triton"] = case["attention_ms"]["sdpa_dense"] / case["attention_ms"]["triton"]
        ok &= case["mask_equal"] and case["positions_equal"] and case["compact_equal"] and case["attention_ok"]

        print(f"batch {batch:2d}: {case['nodes']} nodes, context {args.context}")
        for name in ("mask", "positions", "compact", "attention"):
            t = case[f"{name}_ms"]
            print(f"  {name:9s} triton {t['triton']:.4f} ms  torch {t['torch']:.4f} ms  "
                  f"torch/triton {case[f'{name}_torch_over_triton']:.1f}x")
        print(f"  attention sdpa-dense {case['attention_ms']['sdpa_dense']:.4f} ms  "
              f"sdpa/triton {case['attention_sdpa_over_triton']:.2f}x  max err {case['attention_max_err']:.2e}")
        results["cases"].append(case)
    results["ok"] = ok
    return results


def run_interpreter_check() -> dict:
    rng = random.Random(0)
    w = Workload(rng, 2, 12, 40, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                 dtype=torch.float32, device="cpu")
    started = time.perf_counter()
    mask_tr = w.tree_mask(_mask_mod.build_tree_mask_triton)
    mask_tw = w.tree_mask(_mask_mod.build_tree_mask_torch)
    pos_args = (w.depths, w.offsets, w.base_positions)
    cache_tr, cache_tw = w.key_cache.clone(), w.key_cache.clone()
    _kv_mod.compact_kv_triton(cache_tr, w.src_slots, w.dst_slots, paged=True)
    _kv_mod.compact_kv_torch(cache_tw, w.src_slots, w.dst_slots, paged=True)
    err = float((w.attention(_attn_mod.tree_attention_triton, mask_tw)
                 - w.attention(_attn_mod.tree_attention_torch, mask_tw)).abs().max())
    checks = {
        "mask_equal": bool(torch.equal(mask_tr.mask, mask_tw.mask)),
        "positions_equal": bool(torch.equal(_pos_mod.build_tree_positions_triton(*pos_args),
                                            _pos_mod.build_tree_positions_torch(*pos_args))),
        "compact_equal": bool(torch.equal(cache_tr, cache_tw)),
        "attention_max_err": err,
    }
    checks["ok"] = (checks["mask_equal"] and checks["positions_equal"] and checks["compact_equal"] and err < 1e-4)
    checks["seconds"] = time.perf_counter() - started
    return {"device": "cpu", "interpreter_check": checks, "ok": checks["ok"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--max-nodes", type=int, default=64, help="largest tree (trees have max/2..max nodes)")
    parser.add_argument("--context", type=int, default=2048, help="committed tokens before each root")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()

    if HAS_CUDA:
        results = run_gpu(args)
    else:
        print("no GPU: running a tiny check of the kernels under the Triton interpreter")
        results = run_interpreter_check()
        print(json.dumps(results["interpreter_check"], indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
