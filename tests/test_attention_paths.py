"""The CPU tree-attention path against vLLM's own C++ ops, without an engine.

* ``gather_kv_vec`` (the tests' torch twin of the cache) reads back exactly what vLLM's cache
  writer stored (``vec`` layout);
* the torch reference, ``grouped_masked_attention``, equals vLLM's C++ attention wherever the
  tree mask is causal (a chain), and a dense masked softmax for a real tree;
* the backend's path requests give every tree row of random batches of trees what the torch
  reference gives it, and leave every other row alone, in every cache layout vLLM picks on
  this CPU (``vec``; ``vec16``; ``amx`` for bf16 where the CPU has AMX tiles);
* re-writing rows through the cache writer (KV compaction) moves exactly those rows.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm")
from vllm import _custom_ops as ops  # noqa: E402

from vllm_ptd.tree import FlatTree  # noqa: E402

KVH, D, BS = 2, 64, 32


def gather_kv_vec(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of one request, each [num_kv_heads, seq_len, head_dim], from a ``vec``-layout
    cache [num_blocks, num_kv_heads, block_size, 2 * head_dim]: K column-major [D, bs] and V
    row-major [bs, D] per block and head."""
    _, kvh, bs, two_d = kv_cache.shape
    d = two_d // 2
    pages = kv_cache[block_ids].reshape(len(block_ids), kvh, 2, bs * d)
    k = pages[:, :, 0].reshape(-1, kvh, d, bs).transpose(-1, -2)  # [nb, kvh, bs, d]
    v = pages[:, :, 1].reshape(-1, kvh, bs, d)
    k = k.permute(1, 0, 2, 3).reshape(kvh, -1, d)[:, :seq_len]
    v = v.permute(1, 0, 2, 3).reshape(kvh, -1, d)[:, :seq_len]
    return k, v


def grouped_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of m query rows [m, Hq, D] over keys/values [Hkv, s, D] with a [m, s] bool
    mask (True = may attend); fp32 softmax; returns [m, Hq, D]."""
    m, hq, d = q.shape
    hkv = k.shape[0]
    rep = hq // hkv
    qg = q.float().reshape(m, hkv, rep, d).permute(1, 2, 0, 3).reshape(hkv, rep * m, d)
    scores = torch.bmm(qg, k.float().transpose(1, 2)) * scale  # [hkv, rep*m, s]
    scores = scores.view(hkv, rep, m, -1).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(hkv, rep * m, -1)
    o = torch.bmm(probs, v.float())  # [hkv, rep*m, d]
    return o.view(hkv, rep, m, d).permute(2, 0, 1, 3).reshape(m, hq, d)


def _impl(num_heads: int, dtype=torch.float32, isa: str = "vec", **features):
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_ptd.integration.cpu_attention import TreeCPUAttentionImpl

    config = VllmConfig()
    config.model_config = SimpleNamespace(dtype=dtype)  # all the impl reads of it
    args = {"num_heads": num_heads, "head_size": D, "scale": D ** -0.5, "num_kv_heads": KVH,
            "alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": "auto", **features}
    with set_current_vllm_config(config):
        impl = TreeCPUAttentionImpl(**args)
    return impl, SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)


@pytest.mark.parametrize("features,named", [({"sliding_window": 128}, "a sliding window"),
                                            ({"logits_soft_cap": 30.0}, "soft-cap")])
def test_cpu_tree_attention_refuses_what_its_paths_leave_out(features, named):
    with pytest.raises(ValueError, match=f"^vllm-ptd tree attention .*{named}"):
        _impl(4, **features)


def _caches(num_blocks, dtype):
    kv = torch.zeros(num_blocks, KVH, BS, 2 * D, dtype=dtype)
    key_cache, value_cache = kv.view(num_blocks, KVH, 2 * BS, D).chunk(2, dim=2)
    return kv, key_cache, value_cache


def _write(kv_parts, k, v, slots, isa="vec"):
    _, key_cache, value_cache = kv_parts
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)


def _isas() -> list[str]:
    """The cache layouts vLLM's CPU attention may pick on this machine."""
    found = ["vec", "vec16"]
    if torch.cpu._is_amx_tile_supported():
        found.append("amx")
    return found


def _causal_rows(parts, isa, query, block_table_row, seq_len, scale):
    """vLLM's causal attention of query rows [m, Hq, D], the last m of a sequence of
    ``seq_len`` in the cache (one request, its blocks ``block_table_row``)."""
    m, hq, _ = query.shape
    out = torch.empty_like(query)
    qsl = torch.tensor([0, m], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=hq, num_kv_heads=KVH, head_dim=D, seq_lens=seq_lens,
        dtype=query.dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=parts[1], value_cache=parts[2], output=out,
        query_start_loc=qsl, seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=block_table_row.view(1, -1), softcap=0,
        scheduler_metadata=meta, s_aux=None)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_reads_back_what_the_writer_stored(dtype):
    g = torch.Generator().manual_seed(0)
    parts = _caches(6, dtype)
    seq_len = 77
    blocks = torch.tensor([4, 1, 5])  # a request's pages, out of order
    slots = blocks[torch.arange(seq_len) // BS] * BS + torch.arange(seq_len) % BS
    k = torch.randn(seq_len, KVH, D, generator=g).to(dtype)
    v = torch.randn(seq_len, KVH, D, generator=g).to(dtype)
    _write(parts, k, v, slots)
    gk, gv = gather_kv_vec(parts[0], blocks, seq_len)
    assert torch.equal(gk, k.transpose(0, 1))
    assert torch.equal(gv, v.transpose(0, 1))


def test_tree_rows_match_cpp_attention_on_a_chain():
    """A chain's ancestor mask is causal: the torch rows must equal vLLM's C++ causal rows."""
    g = torch.Generator().manual_seed(1)
    hq, ctx, n = 6, 40, 9
    seq_len = ctx + 1 + n
    parts = _caches(4, torch.float32)
    blocks = torch.tensor([2, 0])
    slots = blocks[torch.arange(seq_len) // BS] * BS + torch.arange(seq_len) % BS
    k = torch.randn(seq_len, KVH, D, generator=g)
    v = torch.randn(seq_len, KVH, D, generator=g)
    _write(parts, k, v, slots)
    q = torch.randn(n + 1, hq, D, generator=g)
    scale = D ** -0.5
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(hq // KVH, 0),
        v.transpose(0, 1).repeat_interleave(hq // KVH, 0),
        attn_mask=torch.ones(n + 1, seq_len, dtype=torch.bool).tril(ctx), scale=scale).transpose(0, 1)
    tree = FlatTree(list(range(n)), list(range(-1, n - 1)))
    mask = torch.zeros(n, seq_len, dtype=torch.bool)
    mask[:, : ctx + 1] = True
    mask[:, ctx + 1:] = tree.ancestor_mask()[1:, 1:]
    gk, gv = gather_kv_vec(parts[0], blocks, seq_len)
    ours = grouped_masked_attention(q[1:], gk, gv, mask, scale)
    assert torch.allclose(ours, ref[1:], atol=1e-5)

    # vLLM's own C++ op over the same cache agrees on every row
    out = _causal_rows(parts, "vec", q, blocks.to(torch.int32), seq_len, scale)
    assert torch.allclose(out[1:], ours, atol=1e-4)


def test_tree_rows_match_dense_reference_on_a_tree():
    g = torch.Generator().manual_seed(2)
    hq, ctx = 4, 20
    tree = FlatTree([5, 6, 7, 8, 9, 10], [-1, -1, 0, 0, 2, 1])
    n = tree.num_nodes
    seq_len = ctx + 1 + n
    k = torch.randn(KVH, seq_len, D, generator=g)
    v = torch.randn(KVH, seq_len, D, generator=g)
    q = torch.randn(n, hq, D, generator=g)
    mask = torch.zeros(n, seq_len, dtype=torch.bool)
    mask[:, : ctx + 1] = True
    mask[:, ctx + 1:] = tree.ancestor_mask()[1:, 1:]
    ours = grouped_masked_attention(q, k, v, mask, 0.1)
    for i in range(n):  # node i sees the prefix, the root, its ancestors and itself
        seen = list(range(ctx + 1)) + [ctx + 1 + a for a in tree.path_to(i)]
        kk = k[:, seen].repeat_interleave(hq // KVH, 0)
        vv = v[:, seen].repeat_interleave(hq // KVH, 0)
        w = torch.softmax(q[i].unsqueeze(1) @ kk.transpose(1, 2) * 0.1, -1)
        assert torch.allclose(ours[i], (w @ vv).squeeze(1), atol=1e-5)


def _random_tree(g: torch.Generator, n: int, causal_tail: int) -> FlatTree:
    """n nodes: a random chain prefix, then random parents (parents first), the last
    ``causal_tail`` of them a causal tail."""
    chain = int(torch.randint(0, n + 1, (1,), generator=g))
    parents = [i - 1 for i in range(chain)]
    for i in range(chain, n):
        parents.append(int(torch.randint(-1, i, (1,), generator=g)))
    nv = max(0, n - causal_tail)
    return FlatTree(list(range(n)), parents, num_verify=nv, causal_from=nv)


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("seed", range(12))
def test_path_requests_give_every_tree_row_its_ancestor_attention(seed, isa):
    """A random batch (a prefill row, then tree requests with random contexts around block
    boundaries, chains, causal tails, depth first or not, fp32 and bf16; ``amx`` in bf16
    only, as vLLM picks it): each tree row needing the tree mask gets the dense masked
    reference over prefix + root + ancestors; every other row keeps what the causal op
    wrote; the cache keeps what must stay."""
    from vllm_ptd.integration.cpu_attention import path_requests
    from vllm_ptd.integration.step import build_step, chain_prefix

    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if seed % 3 == 2 or isa == "amx" else torch.float32
    hq = KVH * int(torch.randint(1, 4, (1,), generator=g))
    impl, layer = _impl(hq, dtype, isa)
    num_trees = int(torch.randint(1, 4, (1,), generator=g))
    trees = [_random_tree(g, int(torch.randint(1, 13, (1,), generator=g)),
                          int(torch.randint(0, 3, (1,), generator=g)) * (seed % 2))
             for _ in range(num_trees)]
    if seed % 4 == 3:  # as the proposer sends them
        trees = [t.depth_first() for t in trees]
    contexts = [int(torch.randint(0, 3 * BS, (1,), generator=g)) for _ in trees]
    max_blocks = (3 * BS + 14) // BS + 1
    num_blocks = 1 + max_blocks * num_trees
    block_table = torch.zeros(num_trees + 1, max_blocks, dtype=torch.int32)
    block_table[1:] = (1 + torch.randperm(num_blocks - 1, generator=g)[: num_trees * max_blocks]
                       ).view(num_trees, max_blocks).to(torch.int32)
    row_start, rows = [], 1  # row 0: another request's prefill row
    for t in trees:
        row_start.append(rows)
        rows += 1 + t.num_nodes
    step = build_step([str(i) for i in range(num_trees)], list(range(1, num_trees + 1)), trees,
                      row_start, contexts, torch.zeros(rows, dtype=torch.int64))
    parts = _caches(num_blocks, dtype)
    key = torch.randn(rows, KVH, D, generator=g).to(dtype)
    value = torch.randn(rows, KVH, D, generator=g).to(dtype)
    query = torch.randn(rows, hq, D, generator=g).to(dtype)
    slot_mapping = torch.full((rows,), -1, dtype=torch.int64)
    prefix_k, prefix_v = [], []
    for i, (t, c) in enumerate(zip(trees, contexts)):
        seq_len = c + 1 + t.num_nodes
        slots = block_table[i + 1].long()[torch.arange(seq_len) // BS] * BS \
            + torch.arange(seq_len) % BS
        pk = torch.randn(c, KVH, D, generator=g).to(dtype)
        pv = torch.randn(c, KVH, D, generator=g).to(dtype)
        r0 = row_start[i]
        _write(parts, torch.cat([pk, key[r0: r0 + 1 + t.num_nodes]]),
               torch.cat([pv, value[r0: r0 + 1 + t.num_nodes]]), slots, isa)
        slot_mapping[r0: r0 + 1 + t.num_nodes] = slots[c:]
        prefix_k.append(pk)
        prefix_v.append(pv)

    def request_kv(i):  # [KVH, s, D] each: what the forward left in request i's slots
        t, r0 = trees[i], row_start[i]
        return (torch.cat([prefix_k[i], key[r0: r0 + 1 + t.num_nodes]]).transpose(0, 1),
                torch.cat([prefix_v[i], value[r0: r0 + 1 + t.num_nodes]]).transpose(0, 1))

    output = torch.randn(rows, hq * D, generator=g).to(dtype)
    before = output.clone()
    refs = {}
    for i, (t, c) in enumerate(zip(trees, contexts)):
        seq_len = c + 1 + t.num_nodes
        k, v = request_kv(i)
        if isa == "vec":  # the cache holds exactly that
            gk, gv = gather_kv_vec(parts[0], block_table[i + 1].long(), seq_len)
            assert torch.equal(gk, k) and torch.equal(gv, v)
        for j in range(chain_prefix(t), t.causal_from):
            row = row_start[i] + 1 + j
            mask = torch.zeros(1, seq_len, dtype=torch.bool)
            mask[0, : c + 1] = True
            mask[0, [c + 1 + a for a in t.path_to(j)]] = True
            refs[row] = grouped_masked_attention(query[row: row + 1], k, v, mask, D ** -0.5)[0]
    paths = path_requests(step, block_table, slot_mapping, rows)
    if paths is not None:
        impl._attend_paths(paths, layer, query, key, value, parts[0], output)
    out = output.view(rows, hq, D).float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for row, ref in refs.items():
        torch.testing.assert_close(out[row], ref, atol=tol, rtol=tol)
    others = [r for r in range(rows) if r not in refs]
    assert torch.equal(output[others], before[others])
    assert paths is None or sorted(torch.cat([rd.query_rows for rd in paths.rounds]).tolist()) \
        == sorted(refs)
    # the GPU backend's tree kernel rewrites the same rows (its row bounds, 0 = the root)
    assert sorted(row_start[i] + r for i, (lo, hi) in enumerate(step.masked_rows)
                  for r in range(lo, hi)) == sorted(refs)
    assert step.has_masked_rows == bool(refs)
    bounds = step.on_device("cpu")
    assert list(zip(bounds.rows_from.tolist(), bounds.rows_to.tolist())) == step.masked_rows
    # the prefix is never written; the leading chain's slots hold their own rows again (an
    # accepted node there is not moved); other tree slots are free once the forward is done
    for i, (t, c) in enumerate(zip(trees, contexts)):
        r0, lead = row_start[i], chain_prefix(t)
        if isa == "vec":
            k, _ = gather_kv_vec(parts[0], block_table[i + 1].long(), c + 1 + t.num_nodes)
            k = k.transpose(0, 1)
            assert torch.equal(k[:c], prefix_k[i]) and torch.equal(k[c], key[r0])
            assert torch.equal(k[c + 1: c + 1 + lead], key[r0 + 1: r0 + 1 + lead])
            continue
        # a layout the test cannot read back: a causal probe over prefix, root and leading
        # chain must see exactly their K/V
        seen = c + 1 + lead
        k, v = request_kv(i)
        probe = torch.randn(1, hq, D, generator=g).to(dtype)
        got = _causal_rows(parts, isa, probe, block_table[i + 1], seen, D ** -0.5)
        want = grouped_masked_attention(probe, k[:, :seen], v[:, :seen],
                                        torch.ones(1, seen, dtype=torch.bool), D ** -0.5)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_rewriting_rows_moves_exactly_those_slots():
    g = torch.Generator().manual_seed(3)
    parts = _caches(2, torch.float32)
    n = 40
    slots = torch.arange(n)
    k = torch.randn(n, KVH, D, generator=g)
    v = torch.randn(n, KVH, D, generator=g)
    _write(parts, k, v, slots)
    src, dst = torch.tensor([33, 35, 38]), torch.tensor([31, 32, 33])  # accepted path rows
    _write(parts, k[src], v[src], dst)
    expect_k, expect_v = k.clone(), v.clone()
    expect_k[dst], expect_v[dst] = k[src], v[src]
    gk, gv = gather_kv_vec(parts[0], torch.tensor([0, 1]), n)
    assert torch.equal(gk, expect_k.transpose(0, 1)) and torch.equal(gv, expect_v.transpose(0, 1))


def test_accepted_rows_move_from_a_copy_not_the_forward_buffer():
    """Regression (compiled mode): the K/V the forward hands to the cache writer live in
    buffers that torch.compile's generated code reuses once the op returns. The rows the walk
    later moves must be the ones the forward computed, even after the caller's ``key`` /
    ``value`` buffers were overwritten."""
    from vllm_ptd.integration.proposer import accepted_kv_moves, move_kv
    from vllm_ptd.integration.step import StepChannel, build_step

    g = torch.Generator().manual_seed(4)
    impl, layer = _impl(num_heads=4)
    # two tree requests after one prefill row: request rows [root, nodes...]
    trees = [FlatTree([1, 2, 3, 4], [-1, -1, 1, 2]), FlatTree([5, 6, 7], [-1, 0, -1])]
    row_start, context = [1, 6], [30, 50]
    num_rows = 10
    positions = torch.arange(num_rows, dtype=torch.int64)
    step = build_step(["a", "b"], [1, 2], trees, row_start, context, positions)
    parts = _caches(4, torch.float32)
    slot_mapping = torch.tensor([3] + list(range(30, 35)) + list(range(82, 86)))
    k = torch.randn(num_rows, KVH, D, generator=g)
    v = torch.randn(num_rows, KVH, D, generator=g)
    key, value = k.clone(), v.clone()
    impl.tree_channel = StepChannel()
    impl.tree_channel.open(step)
    impl.do_kv_cache_update(layer, key, value, parts[0], slot_mapping)
    impl.tree_channel.close()
    assert step._mask is None  # the stash builds no tree masks (only the GPU kernel reads them)
    key.fill_(float("nan"))    # what a compiled graph does with a freed buffer
    value.fill_(float("nan"))
    paths = [[1, 2, 3], [2]]   # a: nodes 1 -> 2 -> 3; b: node 2 (a child of the root)
    src, dst = accepted_kv_moves(step, paths)
    move_kv(step, src, dst)
    expect_k, expect_v = torch.zeros(128, KVH, D), torch.zeros(128, KVH, D)
    expect_k[slot_mapping], expect_v[slot_mapping] = k, v
    for (r0, path) in zip(row_start, paths):
        for j, node in enumerate(path):  # node j of the path now sits in row j's slot
            expect_k[slot_mapping[r0 + 1 + j]] = k[r0 + 1 + node]
            expect_v[slot_mapping[r0 + 1 + j]] = v[r0 + 1 + node]
    gk, gv = gather_kv_vec(parts[0], torch.arange(4), 128)
    assert torch.equal(gk, expect_k.transpose(0, 1)) and torch.equal(gv, expect_v.transpose(0, 1))


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [2, 3, 4], [0, 2, 3, 7], [5, 1], [4]])
def test_gather_rows_copies_the_rows_a_method_keeps(rows):
    """``gather_rows`` gives ``hidden[rows]`` whether the rows lie next to each other (sliced)
    or not (gathered), and never a view of a larger step tensor: a queued row must not keep
    a long prompt's rows alive."""
    from vllm_ptd.integration.proposer import gather_rows

    hidden = torch.randn(8, 6)
    got = gather_rows(hidden, rows)
    assert torch.equal(got, hidden[rows])
    assert got.untyped_storage().nbytes() == len(rows) * 6 * hidden.element_size()
    whole = gather_rows(hidden[:4].clone(), [0, 1, 2, 3])  # all of the step's rows: no copy
    assert whole.shape == (4, 6)
