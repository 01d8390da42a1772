"""PCTree on a DSpark drafter: fast checks on random-init tiny drafters (no target model).

k = 1 reproduces chain DSpark step by step (against a cache-free re-implementation), the
expansion matches a naive per-node implementation, trees are prefix-closed with the
documented tie-breaking, the global top-N keeps the root, batched = per-request (expansion
and drafter block), the loader round-trips and refuses checkpoints that do not fit.
"""
import json
import math
import struct

import pytest
import torch

from vllm_ptd.budget import kept_branching
from vllm_ptd.pctree.config import PCTreeConfig
from vllm_ptd.method import StepOutcome
from vllm_ptd.tree import FlatTree
from vllm_ptd.pctree.checkpoint import (check_drafter_fits, expected_tensor_shapes, load_drafter,
                                        read_tensor_shapes, save_drafter)
from vllm_ptd.pctree.drafter import (DSparkConfig, DSparkDrafter, MarkovHead,
                                     hidden_layer_ids_from_target_layer_ids, tap_hidden_states)
from vllm_ptd.pctree.expand import expand_trees, pool_capacity, rank_nodes
from vllm_ptd.pctree.method import PCTreeMethod

V, D, NL = 96, 32, 6
TARGET = dict(vocab_size=V, hidden_size=D, num_hidden_layers=NL, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, intermediate_size=64, rms_norm_eps=1e-6,
              rope_theta=10000.0, model_type="llama", architectures=["LlamaForCausalLM"],
              hidden_act="silu", tie_word_embeddings=True)
LAYERS = [0, 2, 4]  # DeepSpec ids -> HF hidden_states 1, 3, 5


def make_drafter(seed=0, block=5, rank=8, kind="vanilla", conf=False, shared=True, std=0.5):
    cfg = DSparkConfig.for_target(TARGET, num_layers=2, block_size=block, target_layer_ids=LAYERS,
                                  mask_token_id=V - 1, markov_rank=rank, markov_head_type=kind,
                                  enable_confidence_head=conf, confidence_head_with_markov=conf,
                                  shared_embeddings=shared)
    g = torch.Generator().manual_seed(seed)
    dr = DSparkDrafter(cfg)
    with torch.no_grad():
        for p in dr.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return dr.eval()


def rows(n, seed):
    return torch.randn(n, len(LAYERS) * D, generator=torch.Generator().manual_seed(seed)) * 2


def contexts(dr, seed, counts=(4, 9)):
    """One drafter context per count, of that many random target rows (seeds seed, seed+1, ...)."""
    out = []
    for i, n in enumerate(counts):
        c = dr.new_context()
        dr.append_context(c, rows(n, seed + i), 0)
        out.append(c)
    return out


# ---------------------------------------------------------------------------------------
# reference implementations (cache-free, per node, plain Python)
# ---------------------------------------------------------------------------------------


def block_from_scratch(dr, ctx_rows, root, pos):
    """U, h of one block computed from all context rows at once (training layout)."""
    T = ctx_rows.shape[0]
    ids = torch.zeros(1, T + 1, dtype=torch.long)
    ids[0, T] = root
    full = torch.cat([ctx_rows, torch.zeros(1, ctx_rows.shape[1])]).unsqueeze(0)
    assert pos == T
    with torch.no_grad():
        _, _, h = dr.forward_train(ids, full, torch.tensor([[T]]))
        h = h[0, 0]
        return dr.lm_head(h).float(), h


def dspark_chain(dr, U, h, root):
    """Chain DSpark greedy: x_k = argmax(U_k + W1[x_{k-1}] . W2)."""
    W1 = dr.markov_head.markov_w1.weight
    W2 = dr.markov_head.markov_w2.weight
    prev, out = root, []
    for k in range(U.shape[0]):
        prev = int((U[k] + W2 @ W1[prev]).argmax())
        out.append(prev)
    return out


def naive_expand(U, root, markov, k, N, depth=None, mode="pctree"):
    """Seed 001 PCTree, one node at a time."""
    depth = U.shape[0] if depth is None else depth

    def logp(d, parent_tok):
        lg = U[d].float().clone()
        if markov is not None:
            lg = lg + markov.bias(torch.tensor([parent_tok]))[0].float()
        return torch.log_softmax(lg, -1)

    nodes = [dict(tok=root, par=None, score=0.0, depth=0, id=0)]
    frontier = [0]
    chain_q, prev = [], root
    for d in range(depth):
        q = logp(d, prev)
        chain_q.append(q)
        prev = int(q.argmax())
    for d in range(depth):
        new = []
        for f in frontier:
            lp = chain_q[d] if mode == "shared" else logp(d, nodes[f]["tok"])
            vals, idx = lp.topk(k)
            for v, t in zip(vals.tolist(), idx.tolist()):
                n = dict(tok=t, par=f, score=nodes[f]["score"] + min(v, 0.0), depth=d + 1, id=len(nodes))
                nodes.append(n)
                new.append(n)
        new.sort(key=lambda n: (-n["score"], n["id"]))
        frontier = [n["id"] for n in new[:k]]
    ranked = sorted(nodes, key=lambda n: (-n["score"], n["depth"], n["id"]))
    ranked = [n for n in ranked if math.isfinite(n["score"])][:N]
    pos = {n["id"]: i - 1 for i, n in enumerate(ranked)}
    return [n["tok"] for n in ranked[1:]], [pos[n["par"]] for n in ranked[1:]]


# ---------------------------------------------------------------------------------------
# hidden-state convention
# ---------------------------------------------------------------------------------------


def test_hidden_layer_ids_convention():
    assert hidden_layer_ids_from_target_layer_ids([-1, 0, 2, 27]) == (0, 1, 3, 28)
    dr = make_drafter()
    assert dr.hidden_layer_ids == (1, 3, 5)
    hs = tuple(torch.full((1, 4, D), float(i)) for i in range(NL + 1))
    tapped = tap_hidden_states(hs, dr.hidden_layer_ids)
    assert tapped.shape == (1, 4, 3 * D)
    assert tapped[0, 0, :D].eq(1).all() and tapped[0, 0, 2 * D:].eq(5).all()


# ---------------------------------------------------------------------------------------
# drafter: cache and batching
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_cached_block_equals_block_from_scratch(kind):
    dr = make_drafter(kind=kind)
    ctx = dr.new_context()
    r = rows(12, 1)
    dr.append_context(ctx, r[:7], 0)
    dr.append_context(ctx, r[7:9])  # continues at position 7
    dr.append_context(ctx, r[9:12], [9, 10, 11])
    assert ctx.length == 12 and ctx.next_position == 12
    U, h = dr.draft_block(ctx, 5)
    U2, h2 = block_from_scratch(dr, r, 5, 12)
    torch.testing.assert_close(h, h2, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(U, U2, rtol=1e-4, atol=1e-3)
    assert ctx.length == 12  # the block is dropped


def test_contexts_appended_together_equal_contexts_appended_one_by_one():
    """Rows of several requests projected in one padded call give each context the K/V
    that appending them alone gives (at each context's own next positions)."""
    dr = make_drafter(kind="gated")
    firsts, news = [5, 9, 2, 4], [3, 0, 6, 1]
    alone, together = [], []
    for i, (p, n) in enumerate(zip(firsts, news)):
        a, t = dr.new_context(), dr.new_context()
        for c in (a, t):
            dr.append_context(c, rows(p, 40 + i), 0)
        dr.append_context(a, rows(n, 50 + i))
        alone.append(a)
        together.append(t)
    dr.append_contexts(together, [rows(n, 50 + i) for i, n in enumerate(news)])
    for a, t in zip(alone, together):
        assert (t.length, t.next_position) == (a.length, a.next_position)
        for layer in range(len(a.k)):
            torch.testing.assert_close(t.k[layer][:, : t.length], a.k[layer][:, : a.length])
            torch.testing.assert_close(t.v[layer][:, : t.length], a.v[layer][:, : a.length])


def test_batched_block_equals_single_and_training_layout():
    """A batch of requests with contexts of different lengths, drafted between appends (each
    block's K/V go into the rows after its context, which the next append overwrites), gives
    each request the block that its context alone gives and that the training layout (all
    rows at once, padded and masked) gives."""
    dr = make_drafter()
    lens, more, roots = [3, 11, 7], [2, 1, 4], [4, 9, 17]
    ctxs, all_rows = [], []
    for i, n in enumerate(lens):
        c = dr.new_context()
        all_rows.append(rows(n + more[i], 10 + i))
        dr.append_context(c, all_rows[i][:n], 0)
        ctxs.append(c)
    dr.draft_block(ctxs, [1, 2, 3])
    for c, r, n in zip(ctxs, all_rows, lens):
        dr.append_context(c, r[n:])
    U, h = dr.draft_block(ctxs, roots)
    for i, c in enumerate(ctxs):
        u1, h1 = dr.draft_block(c, roots[i])
        torch.testing.assert_close(U[i], u1, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(h[i], h1, rtol=1e-4, atol=1e-4)
        u2, h2 = block_from_scratch(dr, all_rows[i], roots[i], c.length)
        torch.testing.assert_close(h[i], h2, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(U[i], u2, rtol=1e-4, atol=1e-3)


def test_context_window_bounds_state():
    dr = make_drafter()
    c = dr.new_context(max_rows=8)
    r = rows(20, 3)
    for s in range(0, 20, 3):
        dr.append_context(c, r[s: s + 3], s)
    assert c.length == 8 and c.next_position == 20
    assert c.capacity <= 64
    U, _ = dr.draft_block(c, 1)
    assert torch.isfinite(U).all()
    # a window wider than the first allocation grows its buffers up to the window, not past it
    c = dr.new_context(max_rows=100)
    r = rows(300, 4)
    for s in range(0, 300, 7):
        dr.append_context(c, r[s: s + 7], s)
    assert c.length == 100 and c.capacity == 100


# ---------------------------------------------------------------------------------------
# expansion
# ---------------------------------------------------------------------------------------


def test_k1_equals_chain_dspark_step_by_step():
    """PCTree with k = 1 (and mode chain) proposes exactly chain DSpark's greedy block at every
    step of a decode, with the context grown by [root, *accepted] rows."""
    dr = make_drafter(seed=3)
    B = dr.block_size
    outs = {}
    for mode, k in (("pctree", 1), ("chain", None), ("shared", 1)):
        m = PCTreeMethod(PCTreeConfig(branching=k, max_nodes=B + 1, mode=mode), TARGET, drafter=dr)
        outs[mode] = m
    all_rows = rows(40, 7)
    P = 6
    for m in outs.values():
        m.start("r", list(range(P)), all_rows[:P])
    pos, root = P, 11
    for step in range(6):
        U, h = block_from_scratch(dr, all_rows[:pos], root, pos)
        chain = dspark_chain(dr, U, h, root)
        for mode, m in outs.items():
            t = m.propose(["r"], [root])[0]
            assert t.tokens == chain, (mode, step)
            assert t.parents == list(range(-1, B - 1))
        acc = step % 3  # pretend `acc` nodes were accepted
        out = StepOutcome(tree=t, root_argmax=0, node_argmax=[0] * t.num_nodes,
                          accepted=list(range(acc)), committed=chain[:acc] + [root],
                          hidden=all_rows[pos: pos + acc + 1])
        for m in outs.values():
            m.observe(["r"], [out])
        pos += acc + 1
        root = (root * 7 + step) % (V - 1)


@pytest.mark.parametrize("mode", ["pctree", "shared"])
@pytest.mark.parametrize("k,N", [(2, 6), (3, 10), (4, 16), (4, 200)])
def test_expansion_matches_naive(mode, k, N):
    dr = make_drafter(seed=5, std=0.8)
    g = torch.Generator().manual_seed(k * 100 + N)
    U = torch.randn(dr.block_size, V, generator=g) * 3
    tree, = expand_trees(U.unsqueeze(0), [7], markov=dr.markov_head, k=k, max_nodes=N, mode=mode)
    toks, pars = naive_expand(U, 7, dr.markov_head, k, N, mode=mode)
    assert tree.tokens == toks and tree.parents == pars
    assert tree.num_nodes == min(N, pool_capacity(k, dr.block_size)) - 1


@pytest.mark.parametrize("mode", ["pctree", "shared"])
def test_expansion_stops_once_no_stage_can_change_the_top_n(mode, monkeypatch):
    """Stages after the frontier has fallen out of every request's top N are skipped, and
    the trees are those of all stages (the naive expansion runs them all). Peaked rows make
    the shallow nodes certain and the deep ones unlikely, so the stop comes early."""
    import vllm_ptd.pctree.expand as expand_mod

    calls = []
    real = expand_mod.frontier_is_out

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(expand_mod, "frontier_is_out", spy)
    dr = make_drafter(seed=5, std=0.3)
    g = torch.Generator().manual_seed(11)
    U = torch.randn(3, dr.block_size, V, generator=g)
    U[:, 2:] *= 0.1  # flat from the third stage on: its nodes score below the shallow ones
    U[:, :2] *= 6
    roots = [7, 30, 7]
    trees = expand_trees(U, roots, markov=dr.markov_head, k=3, max_nodes=8, mode=mode)
    # checked after stages 2, 3 and 4 of 5 (once the pool holds 8 nodes): stopped at the
    # first check that found the frontier out, before the last
    assert calls.count(True) == 1 and calls[-1] and len(calls) < 3
    for i, t in enumerate(trees):
        toks, pars = naive_expand(U[i], roots[i], dr.markov_head, 3, 8, mode=mode)
        assert t.tokens == toks and t.parents == pars


def test_global_top_n_keeps_root_and_best_nodes():
    dr = make_drafter(seed=9, std=0.8)
    U = torch.randn(3, dr.block_size, V, generator=torch.Generator().manual_seed(1)) * 3
    res = expand_trees(U, [1, 2, 3], markov=dr.markov_head, k=3, max_nodes=9, return_scores=True)
    full = expand_trees(U, [1, 2, 3], markov=dr.markov_head, k=3, max_nodes=10_000, return_scores=True)
    for t, s, ft, fs in zip(res.trees, res.scores, full.trees, full.scores):
        assert t.num_nodes == 8  # N counts the root
        assert s == sorted(s, reverse=True) and all(x <= 0 for x in s)
        assert s == fs[:8] and t.tokens == ft.tokens[:8]  # the best 8 of all candidates
        assert t.parents == ft.parents[:8]
        for i, p in enumerate(t.parents):
            assert p < i
            if p >= 0:
                assert s[p] >= s[i]


def test_prefix_closed_under_score_ties():
    """Probability-1 children tie with their parents (and the root) on score: depth breaks
    the tie, so parents come first and the root is always kept; -inf nodes are never kept."""
    inf = float("-inf")
    U = torch.full((3, 4), inf)
    U[0, 2] = 0.0
    U[1, 1] = 0.0
    U[2, 3] = 0.0
    for N in (1, 2, 3, 4, 50):
        t = expand_trees(U, 0, k=2, max_nodes=N)[0]
        assert t.tokens == [2, 1, 3][: N - 1]
        assert t.parents == [-1, 0, 1][: N - 1]


def test_rank_nodes_tie_breaking():
    scores = torch.tensor([[0.0, -1.0, -2.0, -1.0, -1.0, 0.0, -2.0]])
    depths = torch.tensor([[0, 1, 1, 2, 1, 3, 2]])
    # score desc; then depth asc; then id asc
    assert rank_nodes(scores, depths).tolist() == [[0, 5, 1, 4, 3, 2, 6]]


def test_equal_scores_frontier_and_selection_by_stable_id():
    """Two siblings with exactly equal probability: the frontier and the final ranking keep
    the earlier pool id first, and the result does not depend on the batch."""
    inf = float("-inf")
    U = torch.full((2, 5), inf)
    U[0, 1] = U[0, 3] = 0.0  # two equally likely root children
    U[1, 4] = 0.0
    t = expand_trees(U, 0, k=1, max_nodes=10)[0]
    assert t.tokens == [1, 4] and t.parents == [-1, 0]  # argmax: the first maximal token
    t2 = expand_trees(U, 0, k=2, max_nodes=10)[0]
    assert sorted(t2.tokens[:2]) == [1, 3] and t2.parents == [-1, -1, 0, 1]
    assert t2.tokens[2:] == [4, 4]


@pytest.mark.parametrize("mode", ["pctree", "shared", "chain"])
def test_batched_expansion_equals_per_request(mode):
    dr = make_drafter(seed=2, kind="gated")
    g = torch.Generator().manual_seed(4)
    U = torch.randn(4, dr.block_size, V, generator=g) * 2
    h = torch.randn(4, dr.block_size, D, generator=g)
    roots = [3, 50, 3, 77]
    k = 1 if mode == "chain" else 3
    batched = expand_trees(U, roots, markov=dr.markov_head, hidden=h, k=k, max_nodes=12, mode=mode)
    for i in range(4):
        single = expand_trees(U[i], roots[i], markov=dr.markov_head, hidden=h[i], k=k, max_nodes=12,
                              mode=mode)[0]
        assert batched[i].tokens == single.tokens and batched[i].parents == single.parents


def test_shared_mode_uses_chain_distribution():
    dr = make_drafter(seed=6, std=1.0)
    U = torch.randn(dr.block_size, V, generator=torch.Generator().manual_seed(8)) * 2
    t = expand_trees(U, 5, markov=dr.markov_head, k=3, max_nodes=40, mode="shared")[0]
    depths = t.depths()
    kids: dict[int, set] = {}
    for i, p in enumerate(t.parents):
        if p >= 0 and sum(1 for q in t.parents if q == p) == 3:
            kids.setdefault(depths[i], set()).add(tuple(sorted(t.tokens[j] for j, q in enumerate(t.parents) if q == p)))
    assert kids and all(len(v) == 1 for v in kids.values())  # same children under every parent
    chain = expand_trees(U, 5, markov=dr.markov_head, k=1, max_nodes=40, mode="chain")[0]
    # the chain itself is in the shared tree (top-1 child at every depth)
    cur, path = -1, []
    for tok in chain.tokens:
        nxt = [i for i, p in enumerate(t.parents) if p == cur and t.tokens[i] == tok]
        if not nxt:
            break
        cur = nxt[0]
        path.append(tok)
    assert len(path) >= 2


def test_depth_limits_stages():
    dr = make_drafter()
    U = torch.randn(dr.block_size, V)
    t = expand_trees(U, 1, markov=dr.markov_head, k=2, max_nodes=100, depth=2)[0]
    assert max(t.depths()) == 2 and t.num_nodes == pool_capacity(2, 2) - 1
    with pytest.raises(ValueError, match="exceeds the block size"):
        expand_trees(U, 1, markov=dr.markov_head, k=2, max_nodes=10, depth=dr.block_size + 1)


# ---------------------------------------------------------------------------------------
# checkpoint
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("compact", [True, False])
def test_loader_round_trip(tmp_path, compact):
    dr = make_drafter(conf=True, shared=compact)
    save_drafter(dr, tmp_path, dtype=None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["vllm_ptd_shared_embeddings"] is compact
    names = set(read_tensor_shapes(tmp_path))
    assert ("embed_tokens.weight" in names) is (not compact)
    assert {"fc.weight", "hidden_norm.weight", "markov_head.markov_w1.weight",
            "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "layers.1.self_attn.k_norm.weight", "layers.0.mlp.down_proj.weight"} <= names
    assert check_drafter_fits(tmp_path, TARGET).block_size == dr.block_size
    emb = (dr.embed_tokens.weight.detach().clone(), dr.lm_head.weight.detach().clone())
    dr2 = load_drafter(tmp_path, TARGET, emb if compact else None)
    for (k1, a), (k2, b) in zip(dr.state_dict().items(), dr2.state_dict().items()):
        assert k1 == k2 and torch.equal(a, b), k1
    c1, c2 = dr.new_context(), dr2.new_context()
    r = rows(9, 2)
    dr.append_context(c1, r, 0)
    dr2.append_context(c2, r, 0)
    torch.testing.assert_close(dr.draft_block(c1, 3)[0], dr2.draft_block(c2, 3)[0])
    assert dr2.confidence(dr2.draft_block(c2, 3)[1], torch.zeros(dr.block_size, dtype=torch.long)).shape == (dr.block_size,)


def test_compact_needs_target_embeddings(tmp_path):
    save_drafter(make_drafter(), tmp_path)
    with pytest.raises(ValueError, match="compact"):
        load_drafter(tmp_path, TARGET)


def _rewrite(tmp_path, cfg_update=None, drop=None):
    from safetensors.torch import load_file, save_file
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(cfg_update or {})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if drop:
        t = load_file(str(tmp_path / "model.safetensors"))
        t.pop(drop)
        save_file(t, str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("change,target_change,message", [
    (None, {"vocab_size": V + 1}, "vocabulary size: drafter 96, target 97"),
    (None, {"hidden_size": 48}, "hidden size: drafter 32, target 48"),
    ({"target_layer_ids": [0, 2, 9]}, None, "out of range"),
    ({"target_layer_ids": [0, 2, 5]}, None, "final layer 5"),
    (None, {"num_hidden_layers": 8}, "target layer count"),
    ({"architectures": ["LlamaForCausalLM"]}, None, "Qwen3DSparkModel"),
    ({"markov_rank": 16}, None, "markov_head.markov_w1.weight has shape [96, 8], expected [96, 16]"),
    ({"markov_head_type": "rnn"}, None, "markov_head_type='rnn' is not supported"),
    ({"vllm_ptd_shared_embeddings": False}, None, "missing tensors: ['embed_tokens.weight', 'lm_head.weight']"),
    ({"mask_token_id": 500}, None, "mask_token_id 500"),
])
def test_mismatched_checkpoint_refused(tmp_path, change, target_change, message):
    dr = make_drafter()
    save_drafter(dr, tmp_path)
    _rewrite(tmp_path, change)
    target = dict(TARGET, **(target_change or {}))
    emb = dr.embed_tokens.weight.detach()
    with pytest.raises(ValueError) as e1:
        check_drafter_fits(tmp_path, target)
    with pytest.raises(ValueError) as e2:
        load_drafter(tmp_path, target, emb)
    assert message in str(e1.value) and message in str(e2.value)


def test_missing_tensor_refused(tmp_path):
    dr = make_drafter()
    save_drafter(dr, tmp_path)
    _rewrite(tmp_path, drop="layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing tensors: \['layers.1.mlp.up_proj.weight'\]"):
        load_drafter(tmp_path, TARGET, dr.embed_tokens.weight.detach())


def test_check_reads_headers_only(tmp_path):
    dr = make_drafter()
    save_drafter(dr, tmp_path)
    f = tmp_path / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    f.write_bytes(raw[: 8 + n])  # header only: the cheap check must not need the data
    assert check_drafter_fits(tmp_path, TARGET).markov_rank == 8
    assert set(read_tensor_shapes(tmp_path)) == set(expected_tensor_shapes(dr.config))


# ---------------------------------------------------------------------------------------
# method
# ---------------------------------------------------------------------------------------


def test_method_bounds_rows_waiting_for_the_drafter(tmp_path):
    from vllm_ptd.pctree.method import PENDING_FLUSH_ROWS

    dr = make_drafter(seed=4)
    save_drafter(dr, tmp_path)
    m = PCTreeMethod(PCTreeConfig(model=str(tmp_path)), TARGET, dr.embed_tokens.weight.detach())
    n = PENDING_FLUSH_ROWS
    m.max_context = n + 1
    # a prompt waits for its request's first step; beyond the drafter's window it never goes in
    m.start("long", list(range(n + 5)), rows(n + 3, 1))
    m.start("short", list(range(8)), rows(8, 2))
    st, short = m._requests["long"], m._requests["short"]
    assert (st.ctx.length, st.ctx.next_position, st.pending_rows) == (0, 4, n + 1)
    assert (short.ctx.length, short.ctx.next_position, short.pending_rows) == (0, 0, 8)
    tree = FlatTree()
    for step in range(n - 8):  # steps without a tree: one row each, until the bound
        m.observe(["short"], [StepOutcome(tree, 1, [], [], [1], hidden=rows(1, 3 + step))])
    assert (short.ctx.length, short.ctx.next_position, short.pending_rows) == (n, n, 0)


def test_method_skips_what_a_paused_request_would_catch_up_on(tmp_path):
    """A request that does not draft keeps only its last ``catch_up_rows`` rows queued: when
    it drafts again its context goes on from those, at their true positions, and the
    drafter is exactly where a request that drafted all along would be for those rows."""
    dr = make_drafter(seed=4)
    save_drafter(dr, tmp_path)
    emb = dr.embed_tokens.weight.detach()
    m = PCTreeMethod(PCTreeConfig(model=str(tmp_path), catch_up_rows=6), TARGET, emb)
    every = PCTreeMethod(PCTreeConfig(model=str(tmp_path), catch_up_rows=None), TARGET, emb)
    prompt = rows(10, 1)
    for meth in (m, every):
        meth.start("a", list(range(10)), prompt)
        meth.skip(["a"], [3])
    st, all_rows = m._requests["a"], every._requests["a"]
    assert (st.pending_rows, st.ctx.next_position) == (6, 4)
    assert (all_rows.pending_rows, all_rows.ctx.next_position) == (10, 0)
    tree = FlatTree()
    later = rows(3, 2)
    for meth in (m, every):
        for i in range(3):
            meth.observe(["a"], [StepOutcome(tree, 1, [], [], [1], hidden=later[i: i + 1])])
        meth.skip(["a"], [1])
    assert (st.pending_rows, st.ctx.next_position) == (6, 7)
    assert m.propose(["a"], [5])[0].num_nodes > 0
    every.propose(["a"], [5])
    assert (st.ctx.length, st.ctx.next_position) == (6, 13)
    assert all_rows.ctx.next_position == 13
    # the kept rows are the last six, at positions 7..12, as in the full context
    for k, k_all in zip(st.ctx.k, all_rows.ctx.k):
        torch.testing.assert_close(k[:, :6], k_all[:, 7:13])
    # 0: a paused request keeps nothing; its next proposal starts from what it had
    none_kept = PCTreeMethod(PCTreeConfig(model=str(tmp_path), catch_up_rows=0), TARGET, emb)
    none_kept.start("a", list(range(10)), prompt)
    none_kept.skip(["a"], [3])
    z = none_kept._requests["a"]
    assert (z.pending, z.pending_rows, z.ctx.next_position) == ([], 0, 10)
    assert none_kept.propose(["a"], [3])[0].num_nodes > 0 and z.ctx.length == 0
    with pytest.raises(ValueError, match="catch_up_rows"):
        PCTreeConfig(catch_up_rows=-1)


def test_queue_keeps_the_last_rows_of_its_pieces_without_holding_the_rest():
    """``keep_recent`` over queues of pieces of random sizes: the rows kept are the last
    ``limit`` rows of the whole queue, positions move by the rows dropped, and a piece cut
    in two is copied where its storage holds more than ``limit`` rows, so a long prompt's
    dropped rows are not held alive by a view."""
    from vllm_ptd.pctree.method import _Request

    class Ctx:
        next_position = 0

    gen = torch.Generator().manual_seed(11)
    for trial in range(50):
        st = _Request(Ctx())
        sizes = torch.randint(1, 9, (int(torch.randint(1, 7, (1,), generator=gen)),),
                              generator=gen).tolist()
        pieces = [torch.randn(n, 5, generator=gen) for n in sizes]
        for piece in pieces:
            st.add_pending(piece)
        limit = int(torch.randint(0, sum(sizes) + 3, (1,), generator=gen))
        st.keep_recent(limit)
        kept = min(limit, sum(sizes))
        assert st.pending_rows == kept and st.ctx.next_position == sum(sizes) - kept
        got = torch.cat(st.pending) if st.pending else torch.empty(0, 5)
        torch.testing.assert_close(got, torch.cat(pieces)[sum(sizes) - kept:])
        originals = {p.untyped_storage().data_ptr(): p.shape[0] for p in pieces}
        for piece in st.pending:
            ptr = piece.untyped_storage().data_ptr()
            held = piece.untyped_storage().nbytes() // (5 * piece.element_size())
            assert originals.get(ptr) == piece.shape[0] or held <= limit


def test_a_paused_queue_is_not_copied_every_step():
    """A paused request adds one row a step and drops one: the prompt's last rows are
    copied once, when the prompt is cut, and later steps cut that copy without copying it
    again (a copy every step was most of the proposer's time at 16 requests), while the
    rows kept stay the last ``limit`` of the queue."""
    from vllm_ptd.pctree.method import _Request

    class Ctx:
        next_position = 0

    st, limit = _Request(Ctx()), 8
    prompt = torch.randn(100, 5)
    st.add_pending(prompt)
    st.keep_recent(limit)
    copy = st.pending[0].untyped_storage().data_ptr()
    assert copy != prompt.untyped_storage().data_ptr()
    assert st.pending[0].untyped_storage().nbytes() == limit * 5 * prompt.element_size()
    everything = [prompt]
    for step in range(limit - 1):
        row = torch.randn(1, 5)
        everything.append(row)
        st.add_pending(row)
        st.keep_recent(limit)
        assert st.pending[0].untyped_storage().data_ptr() == copy
        torch.testing.assert_close(torch.cat(st.pending), torch.cat(everything)[-limit:])
    assert st.ctx.next_position == 100 - limit + limit - 1


def two_requests(folder, **config) -> tuple[DSparkDrafter, PCTreeMethod]:
    """A drafter saved in ``folder`` and a method over it (branching 3) with requests "a"
    and "b" started."""
    dr = make_drafter(seed=4)
    save_drafter(dr, folder)
    m = PCTreeMethod(PCTreeConfig(model=str(folder), branching=3, **config), TARGET,
                     dr.embed_tokens.weight.detach())
    for rid, n in (("a", 6), ("b", 9)):
        m.start(rid, list(range(n)), rows(n, n))
    return dr, m


def test_max_depth_cuts_the_drafter_block_and_the_trees(tmp_path, monkeypatch):
    """``propose(..., max_depth=d)`` drafts a block of d rows (no more than the drafter's)
    and trees no deeper than d; the block is the drafter's own for that many rows."""
    dr, m = two_requests(tmp_path, max_nodes=9)
    blocks = []
    real = DSparkDrafter.draft_block

    def spy(self, ctxs, last_tokens, positions=None, rows=None):
        blocks.append(rows)
        return real(self, ctxs, last_tokens, positions, rows=rows)

    monkeypatch.setattr(DSparkDrafter, "draft_block", spy)
    for limit, want in ((2, 2), (1, 1), (99, dr.block_size), (None, dr.block_size)):
        trees = m.propose(["a", "b"], [7, 8], max_depth=limit)
        assert blocks[-1] == want == m.drafted_depth  # what the trace records
        assert all(t.num_nodes > 0 and max(t.depths()) <= want for t in trees)
    ctx = m._requests["a"].ctx
    U, h = real(m.drafter, ctx, 7, rows=2)
    assert U.shape[0] == h.shape[0] == 2
    with pytest.raises(ValueError, match="block of 0 rows"):
        real(m.drafter, ctx, 7, rows=0)


def test_max_branching_narrows_the_expansion(tmp_path):
    """``propose(..., max_branching=b)`` expands with k = min(branching, b): no node of a
    tree has more than k children nor a depth more than k parents (``kept_branching``),
    the trace records k, and b at or above ``branching`` gives the trees of no limit."""
    dr, m = two_requests(tmp_path, max_nodes=12)

    def shape(trees):
        return [(t.tokens, t.parents) for t in trees]

    def branching(t):
        return kept_branching(t.parents, t.depths(), list(range(t.num_nodes)))

    free = m.propose(["a", "b"], [7, 8])
    assert m.drafted_branching == 3
    assert max(branching(t) for t in free) > 1  # not chains
    for limit, k in ((1, 1), (2, 2), (3, 3), (9, 3)):
        trees = m.propose(["a", "b"], [7, 8], max_branching=limit)
        assert m.drafted_branching == k
        assert all(branching(t) <= k for t in trees)
        if k == 3:
            assert shape(trees) == shape(free)
        if k == 1:  # DSpark's greedy chain
            assert all(t.parents == list(range(-1, t.num_nodes - 1)) for t in trees)
    # draft_shape "full": the budget's limits are not asked for
    _, full = two_requests(tmp_path / "full", max_nodes=12, draft_shape="full")
    trees = full.propose(["a", "b"], [7, 8], max_depth=1, max_branching=1)
    assert (full.drafted_depth, full.drafted_branching) == (dr.block_size, 3)
    assert shape(trees) == shape(free)
    with pytest.raises(ValueError, match="draft_shape"):
        PCTreeConfig(draft_shape="wide")


def test_method_lifecycle_and_batching(tmp_path):
    dr = make_drafter(seed=4)
    save_drafter(dr, tmp_path)
    emb = dr.embed_tokens.weight.detach()
    m = PCTreeMethod(PCTreeConfig(model=str(tmp_path), branching=3, max_nodes=9), TARGET, emb)
    assert m.needs_hidden and m.hidden_layer_ids == (1, 3, 5)
    assert m.max_tree_nodes == 8
    m.start("a", list(range(5)), rows(5, 1))
    m.start("b", list(range(9)), rows(9, 2))
    m.start("c", list(range(12)), rows(4, 3))  # only the last rows (cached prefix)
    # the prompt rows wait for the request's first proposal: no drafter work before it
    assert [m._requests[r].ctx.length for r in "abc"] == [0, 0, 0]
    assert [m._requests[r].pending_rows for r in "abc"] == [5, 9, 4]
    trees = m.propose(["a", "zzz", "b", "c"], [7, 1, 8, 9])
    assert [m._requests[r].ctx.length for r in "abc"] == [5, 9, 4]
    # putting those rows in was catch-up, which the budget does not charge to these trees
    assert m.catch_up_ms > 0.0
    assert trees[1].num_nodes == 0
    for i, rid in ((0, "a"), (2, "b"), (3, "c")):
        assert trees[i].num_nodes == 8
        assert m.propose([rid], [[7, 1, 8, 9][i]])[0].tokens == trees[i].tokens
        assert m.catch_up_ms == 0.0  # nothing was waiting
    with pytest.raises(ValueError, match="rows"):
        m.observe(["a"], [StepOutcome(tree=trees[0], root_argmax=0, node_argmax=[], accepted=[0],
                                      committed=[1, 2], hidden=rows(1, 5))])
    with pytest.raises(ValueError, match="StepOutcome.hidden"):
        m.observe(["a"], [StepOutcome(tree=trees[0], root_argmax=0, node_argmax=[], accepted=[],
                                      committed=[1])])
    m.observe(["a"], [StepOutcome(tree=trees[0], root_argmax=0, node_argmax=[], accepted=[0],
                                  committed=[1, 2], hidden=rows(2, 5).view(2, 3, D).transpose(0, 1))])
    # observed rows join the drafter's context when the request next drafts
    assert m._requests["a"].pending and m._requests["a"].ctx.next_position == 5
    m.propose(["a", "c"], [2, 9])
    assert m._requests["a"].ctx.next_position == 7 and m._requests["c"].ctx.next_position == 12
    assert not m._requests["a"].pending
    assert m.num_requests() == 3 and m.has("b")
    m.finish("b")
    m.finish("nope")
    assert m.num_requests() == 2 and not m.has("b")
    with pytest.raises(ValueError, match="prompt's hidden states"):
        m.start("d", [1, 2, 3])


def test_catch_up_on_a_pauses_rows_is_told_apart_from_a_new_prompts(tmp_path):
    """``paused_ms`` is the share of the catch-up spent on rows that waited through steps
    without a tree: none for a request drafting from its prompt, all but the last step's
    rows for one whose drafting paused."""
    _, m = two_requests(tmp_path, max_nodes=9)
    m.propose(["a"], [7])  # "a" drafts at once: its prompt rows are not a pause's
    assert m.catch_up_ms > 0.0 and m.paused_ms == 0.0
    m.skip(["b"], [8])  # "b" sends no tree for three steps, then drafts
    for step in range(3):
        outcome = StepOutcome(tree=FlatTree(), root_argmax=0, node_argmax=[], accepted=[],
                              committed=[1], hidden=rows(1, 20 + step))
        m.observe(["b"], [outcome])
        if step < 2:
            m.skip(["b"], [1])
    st = m._requests["b"]
    assert (st.pending_rows, st.paused_rows) == (12, 11)
    m.propose(["b"], [1])
    assert m.paused_ms == pytest.approx(m.catch_up_ms * 11 / 12)
    assert st.paused_rows == 0 and not st.pending


def test_warm_up_leaves_no_trace(tmp_path):
    """``warm_up`` drafts for made-up requests and forgets them: no request is left, and
    the trees that follow are those of a method that never warmed up."""
    _, cold = two_requests(tmp_path / "cold", max_nodes=9)
    _, warm = two_requests(tmp_path / "warm", max_nodes=9)
    warm.warm_up()
    assert warm.num_requests() == 2 and warm.catch_up_ms == warm.paused_ms == 0.0
    for a, b in zip(cold.propose(["a", "b"], [7, 8]), warm.propose(["a", "b"], [7, 8])):
        assert (a.tokens, a.parents) == (b.tokens, b.parents)


def test_method_refuses_depth_beyond_block():
    with pytest.raises(ValueError, match="block size"):
        PCTreeMethod(PCTreeConfig(depth=9), TARGET, drafter=make_drafter())


def test_missing_drafter_says_how_to_train(monkeypatch, tmp_path):
    import vllm_ptd.pctree.method as pm
    monkeypatch.delenv(pm.ENV_DRAFTER, raising=False)
    monkeypatch.setattr(pm, "PACKAGED_DRAFTERS", tmp_path / "none")
    with pytest.raises(ValueError, match="train_dspark.py"):
        PCTreeMethod(PCTreeConfig(), TARGET)
    dr = make_drafter()
    save_drafter(dr, tmp_path / "d")
    monkeypatch.setenv(pm.ENV_DRAFTER, str(tmp_path / "d"))
    m = PCTreeMethod(PCTreeConfig(), TARGET, dr.embed_tokens.weight.detach())
    assert m.drafter_path == tmp_path / "d" and m.config.depth == dr.block_size


def test_markov_head_bias_is_low_rank_product():
    mh = MarkovHead(V, 4)
    p = torch.tensor([[3, 5]])
    b = mh.bias(p)
    torch.testing.assert_close(b[0, 1], mh.markov_w2.weight @ mh.markov_w1.weight[5])


def _fused_ids(dr) -> set[int]:
    """The layers that run stacked with others once ``use_linear_kernel`` ran."""
    return {id(getattr(layer.self_attn, name)) for layer in dr.layers
            for name in ("q_proj", "k_proj", "v_proj")} | \
        {id(getattr(layer.mlp, name)) for layer in dr.layers for name in ("gate_proj", "up_proj")}


@pytest.mark.parametrize("bias", [False, True])
def test_stacked_projections_equal_the_layers_one_by_one(bias):
    """``use_linear_kernel`` runs q, k and v (k and v for context rows) and gate and up as one
    GEMM over their stacked weights: with torch's matmul as the kernel the drafter's
    context K/V, logits and hidden states are those of its layers one by one, with and
    without biases (a stacked bias that lost a layer's part, or a split at the wrong
    width, would not be)."""
    import torch.nn.functional as F

    calls = []

    def make(weight, b):
        calls.append(tuple(weight.shape))
        return lambda x: F.linear(x, weight, b)

    plain, fused = make_drafter(seed=4), make_drafter(seed=4)
    if bias:
        for a, b in zip(plain.layers, fused.layers):
            for name in ("q_proj", "k_proj", "v_proj"):
                lin = getattr(a.self_attn, name)
                lin.bias = torch.nn.Parameter(torch.randn(lin.out_features))
                getattr(b.self_attn, name).bias = torch.nn.Parameter(lin.bias.detach().clone())
    fused.use_linear_kernel(make)
    cfg = fused.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    assert (q + 2 * kv, cfg.hidden_size) in calls and (2 * kv, cfg.hidden_size) in calls
    assert (2 * cfg.intermediate_size, cfg.hidden_size) in calls
    outs = []
    for dr in (plain, fused):
        ctxs = contexts(dr, 30)
        outs.append((*dr.draft_block(ctxs, [5, 8]), ctxs[1].k[1][:, :9], ctxs[1].v[0][:, :9]))
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_engine_rms_norm_kernel_is_torchs_norm():
    """vLLM's RMS norm op (the engine's ``norm_kernel``) gives the drafter's norm, on a
    contiguous input and on a view of a wider tensor (a head's slice of a stacked
    projection: the op itself reads such a view wrongly, so the kernel must copy it), and a
    drafter on it drafts what the torch norms draft."""
    pytest.importorskip("vllm")
    from vllm_ptd.integration.proposer import engine_rms_norm_kernel
    from vllm_ptd.pctree.drafter import RMSNorm

    make = engine_rms_norm_kernel(torch.device("cpu"))
    if make is None:
        pytest.skip("this vLLM build has no RMS norm op")
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16, generator=g) + 0.5)
    wide = torch.randn(2, 3, 5 * 16, generator=g) * 3
    for x in (wide[..., :16].contiguous(), wide[..., 32:].reshape(2, 3, 3, 16)):
        want = norm(x)
        got = make(norm.weight.detach(), norm.eps)(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain, fast = make_drafter(seed=5), make_drafter(seed=5)
    fast.use_norm_kernel(make)
    assert all(m.kernel is not None for m in fast.modules() if isinstance(m, RMSNorm))
    outs = []
    for dr in (plain, fast):
        c = dr.new_context()
        dr.append_context(c, rows(7, 40), 0)
        outs.append(dr.draft_block(c, 5))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_engine_linear_kernel_keeps_drafts_and_parameter_names(kind):
    """The drafter's layers on vLLM's prepacked CPU GEMM (what the engine gives it) draft
    the same trees, and its state dict keeps DeepSpec's tensor names."""
    pytest.importorskip("vllm")
    from vllm_ptd.integration.proposer import engine_linear_kernel

    make = engine_linear_kernel(torch.device("cpu"))
    if make is None:
        pytest.skip("this vLLM build has no oneDNN GEMM")
    plain, fast = make_drafter(seed=3, kind=kind), make_drafter(seed=3, kind=kind)
    names = list(plain.state_dict())
    fast.use_linear_kernel(make)
    assert list(fast.state_dict()) == names
    # every layer runs on the kernel: alone, or stacked with the layers that read its input
    assert {id(m) for m in fast.modules() if isinstance(m, torch.nn.Linear)} == _fused_ids(fast)
    outs = []
    for dr in (plain, fast):
        ctxs = contexts(dr, 20)
        U, h = dr.draft_block(ctxs, [5, 8])
        trees = expand_trees(U, [5, 8], markov=dr.markov_head, hidden=h, k=3, max_nodes=9)
        outs.append((U, h, [(t.tokens, t.parents) for t in trees]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-4)
    assert outs[1][2] == outs[0][2]


def test_engine_linear_kernel_runs_every_dtype_this_cpu_has():
    """A bf16 weight gets a GEMM on any CPU: oneDNN's where it builds one, torch's where it
    does not (a CPU without bf16 units, where it stopped a bf16 PCTree engine at start)."""
    pytest.importorskip("vllm")
    from vllm_ptd.integration.proposer import engine_linear_kernel

    make = engine_linear_kernel(torch.device("cpu"))
    if make is None:
        pytest.skip("this vLLM build has no oneDNN GEMM")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(48, 32, generator=g).to(dtype)
        b = torch.randn(48, generator=g).to(dtype)
        run = make(w, b)
        x = torch.randn(5, 32, generator=g).to(dtype)
        y = run(x)
        assert y.dtype == dtype and y.shape == (5, 48)
        ref = x.float() @ w.float().t() + b.float()
        assert float((y.float() - ref).norm() / ref.norm()) < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_kernel_is_close_to_the_float_layer(dtype):
    """vLLM's int8 CPU GEMM (``drafter_gemm``): each layer's output within a few per cent of
    the float layer's, in the input's dtype, also after the weight it was made from is gone
    (the handler reads the quantized copy, which the kernel must keep alive), and a drafter
    on it drafts logits close to the float drafter's."""
    import gc

    from vllm_ptd.hardware import cpu_has_fast_bf16, cpu_has_fast_int8

    pytest.importorskip("vllm")
    from vllm_ptd.integration.proposer import engine_int8_linear_kernel

    make = engine_int8_linear_kernel(torch.device("cpu"))
    if make is None:
        pytest.skip("this vLLM build has no oneDNN int8 GEMM")
    if dtype == torch.bfloat16 and not cpu_has_fast_bf16():
        pytest.skip("oneDNN builds no bf16 GEMM on a CPU without bf16 units")
    # without int8 dot-product units (``cpu_has_fast_int8``; there "auto" keeps the drafter
    # off this GEMM) oneDNN's int8 path is coarser: 2.6-6.4 % per layer on an AVX2-only AMD
    # EPYC, against under 3 % with AVX512-VNNI, and a drafter's logits 44 % off the float
    # drafter's there, so only the layers are checked
    fast = cpu_has_fast_int8()
    layer_tol = 0.03 if fast else 0.1
    g = torch.Generator().manual_seed(0)
    for n_out, n_in, bias in ((40, 24, True), (576, 576, False), (96, 64, False)):
        w = (torch.randn(n_out, n_in, generator=g) * 0.05).to(dtype)
        b = torch.randn(n_out, generator=g).to(dtype) if bias else None
        run = make(w.clone(), None if b is None else b.clone())
        gc.collect()
        x = torch.randn(2, 3, n_in, generator=g).to(dtype)
        y = run(x)
        ref = x.float() @ w.float().t() + (0 if b is None else b.float())
        assert y.shape == (2, 3, n_out) and y.dtype == dtype
        assert float((y.float() - ref).norm() / ref.norm()) < layer_tol
    if not fast:
        return
    plain, quantized = make_drafter(seed=3), make_drafter(seed=3)
    quantized.use_linear_kernel(make)
    Us = []
    for dr in (plain, quantized):
        c = dr.new_context()
        dr.append_context(c, rows(9, 21), 0)
        Us.append(dr.draft_block(c, 5)[0])
    assert float((Us[1] - Us[0]).norm() / Us[0].norm()) < 0.05


def test_tied_target_embeddings_are_converted_once():
    """Two views of one tied embedding (as the engine passes them) become one tensor in the
    drafter's dtype; untied ones stay apart."""
    dr = make_drafter(shared=True)
    tied = torch.randn(V + 4, D, dtype=torch.float64)
    dr.set_target_embeddings(tied[:V], tied[:V])
    assert dr.embed_tokens.weight is dr.lm_head.weight
    assert dr.embed_tokens.weight.dtype == torch.float32
    torch.testing.assert_close(dr.lm_head.weight, tied[:V].float())
    dr.set_target_embeddings(torch.randn(V, D), torch.randn(V, D))
    assert dr.embed_tokens.weight is not dr.lm_head.weight


@pytest.mark.parametrize("mode,k", [("pctree", 3), ("shared", 3), ("chain", 1)])
@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_draft_vocabulary_equals_masking_the_other_words(mode, k, kind):
    """Drafting from a draft vocabulary gives the trees (and scores) of drafting from all
    words with every other word's logit at -inf: the restricted output projection, Markov
    bias and column-to-token mapping change nothing else."""
    dr = make_drafter(seed=6, kind=kind)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:40]
    ctxs = []
    for i, n in enumerate([6, 11]):
        c = dr.new_context()
        dr.append_context(c, rows(n, 30 + i), 0)
        ctxs.append(c)
    roots = [int(ids[3]), 17]  # a root need not be in the draft vocabulary
    U, h = dr.draft_block(ctxs, roots)
    masked = torch.full_like(U, float("-inf"))
    masked[..., ids] = U[..., ids]

    class MaskedMarkov:  # the full head's bias, -inf outside the draft vocabulary
        def bias(self, prev, hidden=None):
            b = dr.markov_head.bias(prev, hidden)
            out = torch.full_like(b, float("-inf"))
            out[..., ids] = b[..., ids]
            return out

    want = expand_trees(masked, roots, markov=MaskedMarkov(), hidden=h, k=k, max_nodes=12,
                        mode=mode, return_scores=True)
    dr.restrict_vocab(ids)
    U_sub, h_sub = dr.draft_block(ctxs, roots)
    assert U_sub.shape[-1] == len(ids)
    torch.testing.assert_close(U_sub, U[..., ids])
    got = expand_trees(U_sub, roots, markov=dr.markov_head, hidden=h_sub, k=k, max_nodes=12,
                       mode=mode, return_scores=True, vocab_ids=dr.draft_vocab)
    assert [(t.tokens, t.parents) for t in got.trees] == [(t.tokens, t.parents) for t in want.trees]
    assert all(set(t.tokens) <= set(ids.tolist()) for t in got.trees)
    for a, b in zip(got.scores, want.scores):
        assert a == pytest.approx(b, abs=1e-5)
    dr.restrict_vocab(None)
    torch.testing.assert_close(dr.draft_block(ctxs, roots)[0], U)


def test_draft_vocabulary_file_and_key(tmp_path):
    from vllm_ptd.pctree.draft_vocab import draft_vocab_ids, rank_tokens, write_draft_vocab

    assert rank_tokens([[5, 9, 9, 3], [3, 9]]) == [9, 3, 5]
    assert draft_vocab_ids(tmp_path, None, V) is None  # no file: every word
    assert draft_vocab_ids(tmp_path, 4, V) == [0, 1, 2, 3]  # no ranking: id order
    write_draft_vocab(tmp_path, [9, 3, 5], 6, "test")
    assert draft_vocab_ids(tmp_path, None, V) == [9, 3, 5, 0, 1, 2]  # the folder's default
    assert draft_vocab_ids(tmp_path, 2, V) == [9, 3]
    assert draft_vocab_ids(tmp_path, 0, V) is None
    assert draft_vocab_ids(tmp_path, V, V) is None
    with pytest.raises(ValueError, match=r"'draft_vocab'\] = 97 exceeds"):
        draft_vocab_ids(tmp_path, V + 1, V)
    with pytest.raises(ValueError, match="draft_vocab"):
        PCTreeConfig(draft_vocab=-1)
    dr = make_drafter(seed=4)
    save_drafter(dr, tmp_path)
    emb = dr.embed_tokens.weight.detach()
    m = PCTreeMethod(PCTreeConfig(model=str(tmp_path), max_nodes=9), TARGET, emb)
    assert m.drafter.draft_vocab.tolist() == [9, 3, 5, 0, 1, 2]
    m.start("a", list(range(5)), rows(5, 1))
    assert set(m.propose(["a"], [7])[0].tokens) <= {9, 3, 5, 0, 1, 2}
    m = PCTreeMethod(PCTreeConfig(model=str(tmp_path), draft_vocab=0), TARGET, emb)
    assert m.drafter.draft_vocab is None
