"""Kernels (vllm_ptd.kernels) against their torch twins, and the twins against references.

Three groups:
* twin tests (CPU, plain process): twins vs FlatTree / sequential copies / dense SDPA.
* ``test_interp_*``: the Triton kernels under Triton's CPU interpreter. They need
  ``TRITON_INTERPRET=1`` set before the kernels are imported, so in a normal run
  ``test_triton_interpreter_subprocess`` reruns just them in a fresh process with the variable
  set; they check that the dispatcher really picked Triton.
* ``test_kernels_compile_for_sm90``: every kernel compiled ahead of time for Hopper with
  Triton's bundled ptxas, which catches what the lenient interpreter lets through.
* ``test_cuda_*``: compiled kernels vs twins on a GPU (skipped without one).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vllm_ptd.kernels import (backend_name, build_tree_mask, build_tree_mask_torch, build_tree_positions,
                              build_tree_positions_torch, compact_kv, compact_kv_torch, tree_attention,
                              tree_attention_torch, write_node_positions, write_node_positions_torch)
from vllm_ptd.kernels import _backend
from vllm_ptd.tree import FlatTree, TreeBatch

INTERPRETED = _backend.INTERPRETED
HAS_CUDA = torch.cuda.is_available()
interp_only = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs a GPU and compiled kernels")


# ----------------------------------------------------------------------------------- builders

def random_tree(rng: random.Random, num_nodes: int) -> FlatTree:
    """Random tree mixing chains and bushy parts, with random num_verify / causal_from."""
    chain_bias = rng.random()
    parents = [(i - 1) if rng.random() < chain_bias else rng.randint(-1, i - 1) for i in range(num_nodes)]
    num_verify = rng.randint(0, num_nodes)
    causal_from = rng.choice([-1, rng.randint(num_verify, num_nodes)])
    return FlatTree(list(range(num_nodes)), parents, num_verify, causal_from)


def random_batch(rng: random.Random, max_trees: int, max_nodes: int, min_nodes: int = 1) -> list[FlatTree]:
    return [random_tree(rng, rng.randint(min_nodes, max_nodes)) for _ in range(rng.randint(1, max_trees))]


def to_device(batch: TreeBatch, device: str) -> TreeBatch:
    return TreeBatch(*(getattr(batch, f).to(device) for f in
                       ("tokens", "parents", "depths", "offsets", "num_verify", "causal_from")))


class PagedCase:
    """Random tree requests whose K/V live in a shuffled paged cache, plus their dense copies."""

    def __init__(self, rng: random.Random, trees: list[FlatTree], *, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, max_context: int, dtype: torch.dtype, device: str):
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        self.trees = trees
        self.batch = to_device(TreeBatch.from_trees(trees), device)
        self.contexts = [rng.randint(0, max_context) for _ in trees]
        self.seq_lens = [c + t.num_nodes + 1 for c, t in zip(self.contexts, trees)]
        blocks_per_req = [-(-n // block_size) for n in self.seq_lens]
        max_blocks = max(blocks_per_req)
        num_blocks = sum(blocks_per_req) + 2
        shuffled = torch.randperm(num_blocks, generator=gen).tolist()
        table = torch.zeros(len(trees), max_blocks, dtype=torch.int32)
        used = 0
        for b, nb in enumerate(blocks_per_req):
            table[b, :nb] = torch.tensor(shuffled[used:used + nb])
            used += nb
        self.block_table = table.to(device)
        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
        self.value_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
        # Query rows with a gap of unrelated rows between requests, as in a mixed vLLM batch.
        starts, row = [], 0
        for tree in trees:
            row += rng.randint(0, 3)
            starts.append(row)
            row += tree.num_nodes + 1
        self.query = torch.randn(row + 2, num_q_heads, head_dim, generator=gen).to(dtype).to(device)
        self.query_starts = torch.tensor(starts, dtype=torch.int32, device=device)
        self.context_lens = torch.tensor(self.contexts, dtype=torch.int32, device=device)
        self.scale = head_dim ** -0.5
        self.block_size = block_size

    def dense_kv(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request b's [seq_len, Hkv, D] K and V, read slot by slot in sequence order."""
        seq = torch.arange(self.seq_lens[b])
        blocks = self.block_table[b].cpu().long()[seq // self.block_size]
        return (self.key_cache.cpu()[blocks, seq % self.block_size],
                self.value_cache.cpu()[blocks, seq % self.block_size])

    def tree_mask(self):
        return build_tree_mask_torch(self.batch.parents, self.batch.offsets, self.batch.causal_from)

    def run(self, fn, **kwargs):
        return fn(self.query, self.key_cache, self.value_cache, self.block_table, self.context_lens,
                  self.query_starts, self.batch.offsets, self.tree_mask(), self.scale, **kwargs)

    def row_bounds(self, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        """Random [rows_from, rows_to) per request, some empty, some past the tree's end."""
        lo, hi = [], []
        for tree in self.trees:
            a = rng.randint(0, tree.num_nodes + 1)
            lo.append(a)
            hi.append(rng.randint(max(0, a - 1), tree.num_nodes + 3))
        dev = self.query.device
        return (torch.tensor(lo, dtype=torch.int32, device=dev),
                torch.tensor(hi, dtype=torch.int32, device=dev))


def assert_only_bounded_rows_written(case: PagedCase, got: torch.Tensor, full: torch.Tensor,
                                     bounds: tuple[torch.Tensor, torch.Tensor], sentinel: float,
                                     tol: float) -> None:
    """Rows inside each request's bounds equal the unbounded result; every other row keeps
    the sentinel the output was filled with."""
    written = torch.zeros(case.query.shape[0], dtype=torch.bool)
    for b, tree in enumerate(case.trees):
        start = int(case.query_starts[b])
        lo, hi = int(bounds[0][b]), min(int(bounds[1][b]), tree.num_nodes + 1)
        if lo < hi:
            written[start + lo:start + hi] = True
    got, full = got.float().cpu(), full.float().cpu()
    torch.testing.assert_close(got[written], full[written], atol=tol, rtol=tol)
    assert bool((got[~written] == sentinel).all())


def accepted_path_pairs(rng: random.Random, trees: list[FlatTree], block_size: int, num_blocks: int):
    """Slot pairs of the accepted-path compaction for a batch, under a shuffled block table.

    Tree row r of request b is at sequence index ctx_b + r; accepted node k (path order) moves
    from the slot of row path[k] + 1 to the slot of row k + 1."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))).tolist()
    src, dst, next_block = [], [], 0
    for tree in trees:
        ctx = rng.randint(0, 3 * block_size)
        need = -(-(ctx + tree.num_nodes + 1) // block_size)
        blocks = perm[next_block:next_block + need]
        next_block += need

        def slot(i: int) -> int:
            return blocks[i // block_size] * block_size + i % block_size

        if tree.num_nodes == 0:
            continue
        path = tree.path_to(rng.randrange(tree.num_nodes))
        for k, node in enumerate(path):
            src.append(slot(ctx + 1 + node))
            dst.append(slot(ctx + 1 + k))
    assert next_block <= num_blocks
    return torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)


def sequential_copy(cache_slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Expected result: every destination gets its source's *original* row."""
    original = cache_slots.clone()
    expected = cache_slots.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        if s >= 0 and d >= 0:
            expected[d] = original[s]
    return expected


def dense_tree_attention(case: PagedCase) -> torch.Tensor:
    """Reference from unpaged K/V: SDPA per request with prefix + FlatTree.ancestor_mask."""
    out = torch.zeros(case.query.shape, dtype=torch.float32)
    group = case.query.shape[1] // case.key_cache.shape[2]
    for b, tree in enumerate(case.trees):
        keys, values = case.dense_kv(b)
        rows = tree.num_nodes + 1
        start = int(case.query_starts[b])
        q = case.query.cpu()[start:start + rows].float().transpose(0, 1)  # [Hq, rows, D]
        k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)
        v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
        visible = torch.cat([torch.ones(rows, case.contexts[b], dtype=torch.bool), tree.ancestor_mask()], dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=case.scale)
        out[start:start + rows] = o.transpose(0, 1)
    return out


TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


# ------------------------------------------------------------------------------- twin tests

def test_mask_twin_matches_flat_tree():
    rng = random.Random(1)
    for _ in range(12):
        trees = random_batch(rng, 16, 128, min_nodes=0)
        batch = TreeBatch.from_trees(trees)
        tree_mask = build_tree_mask_torch(batch.parents, batch.offsets, batch.causal_from)
        assert tree_mask.mask.dtype == torch.bool
        assert tree_mask.mask.numel() == sum((t.num_nodes + 1) ** 2 for t in trees)
        for b, tree in enumerate(trees):
            assert torch.equal(tree_mask.request(b), tree.ancestor_mask()), (b, tree)


def test_positions_twin_matches_depths():
    rng = random.Random(2)
    for _ in range(10):
        trees = random_batch(rng, 16, 128, min_nodes=0)
        batch = TreeBatch.from_trees(trees)
        base = torch.tensor([rng.randint(0, 5000) for _ in trees], dtype=torch.int64)
        packed = build_tree_positions_torch(batch.depths, batch.offsets, base)
        expected = []
        for b, tree in enumerate(trees):
            expected += [int(base[b])] + [int(base[b]) + d for d in tree.depths()]
        assert packed.tolist() == expected

        root_rows, row = [], 0
        for tree in trees:
            row += rng.randint(0, 4)
            root_rows.append(row)
            row += tree.num_nodes + 1
        positions = torch.full((row + 3,), -1, dtype=torch.int64)
        write_node_positions_torch(positions, batch.depths, batch.offsets, base, torch.tensor(root_rows))
        want = torch.full_like(positions, -1)
        for b, tree in enumerate(trees):
            for j, d in enumerate(tree.depths()):
                want[root_rows[b] + 1 + j] = int(base[b]) + d
        assert torch.equal(positions, want)


@pytest.mark.parametrize("paged", [False, True])
def test_compact_kv_twin_overlapping_paths(paged):
    rng = random.Random(3)
    block_size, num_blocks = 8, 160
    for _ in range(8):
        trees = random_batch(rng, 8, 24)
        src, dst = accepted_path_pairs(rng, trees, block_size, num_blocks)
        assert bool((src >= 0).all())
        cache = torch.randn(num_blocks, block_size, 2, 4)
        expected = sequential_copy(cache.view(-1, 2, 4), src, dst)
        target = cache if paged else cache.view(-1, 2, 4)
        compact_kv_torch(target, src, dst, paged=paged)
        assert torch.equal(cache.view(-1, 2, 4), expected)


def test_compact_kv_twin_chain_overlap_and_padding():
    # Path nodes [1, 2, 3] under a root at slot 0 give (2->1), (3->2), (4->3): the writes to
    # slots 2 and 3 land on the sources of the pairs before them. The last two are padding.
    cache = torch.arange(10.0).view(10, 1)
    compact_kv_torch(cache, torch.tensor([2, 3, 4, -1, 7]), torch.tensor([1, 2, 3, 5, -1]))
    assert cache.view(-1).tolist() == [0, 2, 3, 4, 4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 4, 64), (8, 2, 128), (6, 2, 64), (4, 1, 64)])
def test_tree_attention_twin_matches_dense(num_q_heads, num_kv_heads, head_dim):
    rng = random.Random(num_q_heads * 100 + head_dim)
    for _ in range(2):
        case = PagedCase(rng, random_batch(rng, 5, 40, min_nodes=0), num_q_heads=num_q_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16, max_context=80,
                         dtype=torch.float32, device="cpu")
        got = case.run(tree_attention_torch)
        torch.testing.assert_close(got, dense_tree_attention(case), atol=2e-5, rtol=1e-4)


def test_tree_attention_twin_writes_only_the_rows_asked():
    rng = random.Random(5)
    for _ in range(3):
        case = PagedCase(rng, random_batch(rng, 6, 30, min_nodes=0), num_q_heads=4,
                         num_kv_heads=2, head_dim=64, block_size=16, max_context=60,
                         dtype=torch.float32, device="cpu")
        bounds = case.row_bounds(rng)
        got = case.run(tree_attention_torch, out=torch.full_like(case.query, 7.0),
                       rows_from=bounds[0], rows_to=bounds[1])
        assert_only_bounded_rows_written(case, got, case.run(tree_attention_torch), bounds, 7.0,
                                         1e-6)


@pytest.mark.skipif(INTERPRETED, reason="with the interpreter every call picks Triton")
def test_dispatch_uses_twin_for_cpu_tensors():
    assert backend_name(torch.zeros(1)) == "torch"
    trees = [FlatTree([1, 2], [-1, 0])]
    batch = TreeBatch.from_trees(trees)
    assert torch.equal(build_tree_mask(batch.parents, batch.offsets, batch.causal_from).request(0),
                       trees[0].ancestor_mask())


# ------------------------------------------------------------------ Triton under the interpreter

def _assert_triton_chosen(*tensors):
    assert backend_name(*tensors) == "triton", "the dispatcher did not pick the Triton kernel"


@interp_only
def test_interp_tree_mask():
    rng = random.Random(11)
    batches = [random_batch(rng, 4, 24, min_nodes=0) for _ in range(2)]
    batches.append([random_tree(rng, 128), random_tree(rng, 1), random_tree(rng, 0)])
    for trees in batches:
        batch = TreeBatch.from_trees(trees)
        _assert_triton_chosen(batch.parents, batch.offsets, batch.causal_from)
        got = build_tree_mask(batch.parents, batch.offsets, batch.causal_from)
        want = build_tree_mask_torch(batch.parents, batch.offsets, batch.causal_from)
        assert torch.equal(got.offsets, want.offsets)
        assert torch.equal(got.mask, want.mask)
        for b, tree in enumerate(trees):
            assert torch.equal(got.request(b), tree.ancestor_mask())


@interp_only
def test_interp_tree_positions():
    rng = random.Random(12)
    for _ in range(3):
        trees = random_batch(rng, 16, 128, min_nodes=0)
        batch = TreeBatch.from_trees(trees)
        base = torch.tensor([rng.randint(0, 5000) for _ in trees], dtype=torch.int64)
        _assert_triton_chosen(batch.depths, batch.offsets, base)
        assert torch.equal(build_tree_positions(batch.depths, batch.offsets, base),
                           build_tree_positions_torch(batch.depths, batch.offsets, base))
        root_rows = torch.cumsum(torch.tensor([0] + [t.num_nodes + 1 + rng.randint(0, 3) for t in trees]), 0)[:-1]
        got = torch.full((int(root_rows[-1]) + 200,), -1, dtype=torch.int64)
        want = got.clone()
        write_node_positions(got, batch.depths, batch.offsets, base, root_rows.to(torch.int32))
        write_node_positions_torch(want, batch.depths, batch.offsets, base, root_rows)
        assert torch.equal(got, want)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_interp_compact_kv(dtype):
    rng = random.Random(13)
    block_size, num_blocks = 8, 64
    trees = random_batch(rng, 4, 20)
    src, dst = accepted_path_pairs(rng, trees, block_size, num_blocks)
    # Padding pairs must be ignored.
    src, dst = torch.cat([src, torch.tensor([-1, 3])]), torch.cat([dst, torch.tensor([5, -1])])
    for paged in (False, True):
        # A [num_blocks, 2, block_size, H, D] cache unbound along dim 1, as vLLM's GPU backends do.
        full = torch.randn(num_blocks, 2, block_size, 2, 8).to(dtype)
        value_before = full[:, 1].clone()
        key_cache = full[:, 0]
        target = key_cache if paged else key_cache.contiguous().view(-1, 2, 8)
        slots_before = key_cache.reshape(-1, 2, 8).clone() if paged else target.clone()
        _assert_triton_chosen(target, src, dst)
        compact_kv(target, src, dst, paged=paged)
        after = key_cache.reshape(-1, 2, 8) if paged else target
        expected = sequential_copy(slots_before.view(torch.uint8), src, dst)
        assert torch.equal(after.view(torch.uint8), expected)
        assert torch.equal(full[:, 1].view(torch.uint8), value_before.view(torch.uint8))


@interp_only
@pytest.mark.parametrize("dtype,num_q_heads,num_kv_heads,head_dim", [
    (torch.float32, 4, 2, 64),
    (torch.float32, 6, 2, 128),
    (torch.float16, 4, 4, 64),
    (torch.bfloat16, 8, 1, 64),
])
def test_interp_tree_attention(dtype, num_q_heads, num_kv_heads, head_dim):
    rng = random.Random(14 + head_dim + num_q_heads)
    case = PagedCase(rng, random_batch(rng, 3, 20, min_nodes=0), num_q_heads=num_q_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16, max_context=70,
                     dtype=dtype, device="cpu")
    _assert_triton_chosen(case.query, case.key_cache)
    got = case.run(tree_attention).float()
    want = case.run(tree_attention_torch).float()
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # Rows outside the trees stay untouched (zeros here).
    covered = torch.zeros(case.query.shape[0], dtype=torch.bool)
    for b, tree in enumerate(case.trees):
        start = int(case.query_starts[b])
        covered[start:start + tree.num_nodes + 1] = True
    assert bool((got[~covered] == 0).all())
    # with row bounds, the rows asked and no other
    bounds = case.row_bounds(rng)
    bounded = case.run(tree_attention, out=torch.full_like(case.query, 7.0),
                       rows_from=bounds[0], rows_to=bounds[1])
    assert_only_bounded_rows_written(case, bounded, want, bounds, 7.0, TOLERANCE[dtype])


@pytest.mark.skipif(INTERPRETED or not _backend.HAVE_TRITON, reason="this is the launcher")
def test_triton_interpreter_subprocess():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "test_interp_"],
        env=env, capture_output=True, text=True, timeout=600)
    report = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0, report
    assert "skipped" not in result.stdout.splitlines()[-1], report  # every interpreter test ran


# ------------------------------------------------------- compiling for a GPU without one

def _can_compile_for_cuda() -> bool:
    if INTERPRETED or not _backend.HAVE_TRITON:
        return False
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _can_compile_for_cuda(), reason="needs compiled (not interpreted) kernels and ptxas")
def test_kernels_compile_for_sm90():
    """The interpreter accepts code the compiler rejects; compile each kernel ahead of time for
    Hopper (Triton's bundled ptxas, no GPU needed) with the argument types the launchers pass."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_kernel(kernel, types: dict[str, str], constants: dict, **options):
        signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                                  options=options or None)
        assert compiled.asm["cubin"]

    mask_mod = importlib.import_module("vllm_ptd.kernels.tree_mask")
    positions_mod = importlib.import_module("vllm_ptd.kernels.tree_positions")
    compact_mod = importlib.import_module("vllm_ptd.kernels.kv_compact")
    attention_mod = importlib.import_module("vllm_ptd.kernels.tree_attention")
    compile_kernel(mask_mod._tree_mask_kernel, dict(parents_ptr="*i32", offsets_ptr="*i32", causal_from_ptr="*i32",
                                                    mask_offsets_ptr="*i64", mask_ptr="*u8"), {"BLOCK_COLS": 256})
    for include_roots in (True, False):
        compile_kernel(positions_mod._tree_positions_kernel,
                       dict(depths_ptr="*i32", offsets_ptr="*i32", base_ptr="*i64", root_rows_ptr="*i64",
                            out_ptr="*i64", num_items="i32", batch="i32"),
                       {"INCLUDE_ROOTS": include_roots, "SEARCH_STEPS": 5, "BLOCK": 256})
    for gather in (True, False):
        compile_kernel(compact_mod._copy_rows_kernel,
                       dict(cache_ptr="*i16", scratch_ptr="*i16", slots_ptr="*i64", other_slots_ptr="*i64",
                            row_size="i32", block_size="i32", stride_block="i64", stride_offset="i32"),
                       {"GATHER": gather, "BLOCK": 1024})
    kernel = attention_mod._tree_attention_kernel
    types = {name: "i32" for name in kernel.arg_names if name.startswith("stride_") or name == "block_size"}
    types.update(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16", block_table_ptr="*i32",
                 context_lens_ptr="*i32", query_starts_ptr="*i32", node_offsets_ptr="*i32", mask_ptr="*u8",
                 mask_offsets_ptr="*i64", rows_from_ptr="*i32", rows_to_ptr="*i32", scale_log2="fp32")
    # 28 q heads over 4 kv heads: a group of 7 padded to 8, the least regular case.
    compile_kernel(kernel, types, dict(HEAD_DIM=128, HEAD_DIM_PAD=128, GROUP=7, GROUP_PAD=8, BLOCK_ROWS=8,
                                       BLOCK_KEYS=64, DOT_FP32=False), num_warps=4)


# -------------------------------------------------------------------------------- CUDA tests

@cuda_only
def test_cuda_tree_mask_and_positions():
    rng = random.Random(21)
    for _ in range(20):
        trees = random_batch(rng, 16, 128, min_nodes=0)
        batch = to_device(TreeBatch.from_trees(trees), "cuda")
        assert backend_name(batch.parents) == "triton"
        got = build_tree_mask(batch.parents, batch.offsets, batch.causal_from)
        want = build_tree_mask_torch(batch.parents.cpu(), batch.offsets.cpu(), batch.causal_from.cpu())
        assert torch.equal(got.mask.cpu(), want.mask)
        base = torch.randint(0, 5000, (len(trees),), device="cuda")
        assert torch.equal(build_tree_positions(batch.depths, batch.offsets, base).cpu(),
                           build_tree_positions_torch(batch.depths.cpu(), batch.offsets.cpu(), base.cpu()))
        root_rows = torch.cumsum(torch.tensor([0] + [t.num_nodes + 1 for t in trees]), 0)[:-1]
        got_rows = torch.full((int(root_rows[-1]) + 130,), -1, dtype=torch.int64, device="cuda")
        want_rows = got_rows.cpu()
        write_node_positions(got_rows, batch.depths, batch.offsets, base, root_rows.cuda())
        write_node_positions_torch(want_rows, batch.depths.cpu(), batch.offsets.cpu(), base.cpu(), root_rows)
        assert torch.equal(got_rows.cpu(), want_rows)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_compact_kv(dtype):
    rng = random.Random(22)
    block_size, num_blocks = 16, 2048
    for _ in range(5):
        trees = random_batch(rng, 16, 128)
        src, dst = accepted_path_pairs(rng, trees, block_size, num_blocks)
        full = torch.randn(num_blocks, 2, block_size, 8, 128, device="cuda").to(dtype)
        key_cache = full[:, 0]
        before = key_cache.reshape(-1, 8, 128).cpu()
        compact_kv(key_cache, src.cuda(), dst.cuda(), paged=True)
        assert torch.equal(key_cache.reshape(-1, 8, 128).cpu(), sequential_copy(before, src, dst))


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(32, 8, 128), (16, 16, 64), (28, 4, 128)])
def test_cuda_tree_attention(dtype, num_q_heads, num_kv_heads, head_dim):
    rng = random.Random(23 + head_dim)
    for _ in range(3):
        case = PagedCase(rng, random_batch(rng, 16, 128), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, block_size=16, max_context=1500, dtype=dtype, device="cuda")
        got = case.run(tree_attention).float()
        want = case.run(tree_attention_torch).float()
        torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
