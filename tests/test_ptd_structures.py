"""PTD's data structures (draft tree, candidate pool, seeding) and PTDMethod end to end."""
import gc
import random
import time

import pytest

from vllm_ptd.ptd.config import PTDConfig
from vllm_ptd.method import StepOutcome
from vllm_ptd.metrics import SpecMetrics
from vllm_ptd.ptd.candidate_pool import CandidatePool
from vllm_ptd.ptd.draft_tree import DraftTree
from vllm_ptd.ptd.method import PTDMethod
from vllm_ptd.ptd.seeding import EntitySeeding, RandomPromptSeeding, entity_like
from vllm_ptd.tree import FlatTree
from vllm_ptd.verify import greedy_walk

EOS = 99


def shape(tree: DraftTree):
    """Nested (token, [children]) of every subtree, for exact structure checks."""
    def rec(v):
        return (v.token, [rec(c) for c in v.children])
    return [rec(r) for r in tree.roots]


def grow_by(tree: DraftTree, table: dict):
    """Emit, then grow with argmax looked up by token (default: token + 1)."""
    tokens, _ = tree.emit()
    tree.grow([table.get(t, t + 1) for t in tokens])
    tree.check()


# ---------------------------------------------------------------------- draft tree
@pytest.mark.parametrize("width,depth,budget", [(4, 6, 12), (2, 3, 32), (1, 1, 5), (4, 6, 0), (3, 4, 7)])
def test_draft_tree_invariants_over_random_steps(width, depth, budget):
    rng = random.Random(width * 100 + depth * 10 + budget)
    t = DraftTree(width, depth, budget, eos_token_ids=[EOS])
    grew = 0
    for step in range(400):
        if t.empty:
            t.seed([[rng.randrange(30) for _ in range(rng.randint(1, 3))] for _ in range(2)])
        tokens, parents = t.emit()
        assert len(tokens) == t.num_nodes <= budget
        assert all(p < i for i, p in enumerate(parents))
        # small vocabulary: duplicates everywhere; EOS now and then; rows cut short now and then
        argmax = [EOS if rng.random() < 0.03 else rng.randrange(12) for _ in tokens]
        if rng.random() < 0.2:
            argmax = argmax[: rng.randint(0, len(argmax))]
        t.grow(argmax)
        grew += [v.token for v in t.nodes()] != tokens  # the tree moved
        t.check()  # width, depth, budget, distinct roots, no EOS, bookkeeping
    assert budget == 0 or grew > 100


def test_expansion_width_and_dedup():
    t = DraftTree(width=2, depth=6, max_nodes=50)
    t.seed([[10]])
    for a in (11, 11, 12, 13):  # 11 twice: one child; 13: width 2 reached, refused
        t.emit()
        t.grow([a] + [0] * (t.num_nodes - 1))
        t.check()
    assert [c.token for c in t.roots[0].children] == [11, 12]


def test_stepping_prune_keeps_earliest_child():
    t = DraftTree(width=4, depth=3, max_nodes=50, max_roots=1)
    t.seed([[10, 11]])
    grow_by(t, {10: 20, 11: 12})  # 10 -> {11 -> 12, 20}
    assert shape(t) == [(10, [(11, [(12, [])]), (20, [])])]
    grow_by(t, {10: 20, 11: 12, 12: 13, 20: 21})  # depth 4 -> step to 11's subtree
    assert shape(t) == [(11, [(12, [(13, [])])])]
    assert t.max_depth() == 3


def test_stepping_drops_subtree_duplicating_a_root():
    t = DraftTree(width=4, depth=2, max_nodes=50, max_roots=2)
    t.seed([[10, 11], [11]])
    # 10 -> 11 -> 12 exceeds depth 2: its new root 11 duplicates the root 11: dropped
    grow_by(t, {11: 12, 10: 30})
    # then the top level refills from the newest root's argmax (11 predicted 12)
    assert shape(t) == [(11, [(12, [])]), (12, [])]


def test_eos_branches_removed():
    t = DraftTree(width=4, depth=6, max_nodes=50, eos_token_ids=[EOS, 98], max_roots=2)
    t.seed([[10, 11, 12], [20]])
    # 11 predicts EOS: 11 and 12 go, and 10's prediction 11 is not re-added this step
    grow_by(t, {11: EOS, 12: 13, 10: 11, 20: 21})
    assert shape(t)[0] == (10, [])
    grow_by(t, {10: 98, 20: 21, 21: 22})  # a root predicting EOS: its subtree goes
    assert shape(t) == [(20, [(21, [(22, [])])]), (21, [])]  # (and the top level refills)
    t.seed([[EOS, 1], [98]])  # EOS tokens never enter as seeds
    assert all(v.token not in (EOS, 98) for v in t.nodes())


def test_top_level_filled_from_newest_root_and_capped():
    t = DraftTree(width=3, depth=6, max_nodes=50)
    t.seed([[10]])
    grow_by(t, {10: 11})
    assert [r.token for r in t.roots] == [10, 11]  # 11 also becomes a new subtree root
    grow_by(t, {10: 11, 11: 12})
    grow_by(t, {})
    assert len(t.roots) == 3  # never more than w


def test_budget_prefers_main_lines():
    t = DraftTree(width=4, depth=6, max_nodes=5, max_roots=1)
    t.seed([[10, 11]])
    grow_by(t, {10: 20, 11: 12})  # 10 -> {11 -> 12, 20}: 4 nodes
    grow_by(t, {10: 30, 11: 40, 12: 13, 20: 21})
    # 12 -> 13 extends the main line; the side additions compete for the one free slot
    main = []
    v = t.roots[0]
    while v is not None:
        main.append(v.token)
        v = v.children[0] if v.children else None
    assert main == [10, 11, 12, 13]
    assert t.num_nodes == 5
    for _ in range(10):  # the main line keeps moving (stepping early) at full budget
        grow_by(t, {})
        assert t.num_nodes <= 5
    assert t.roots[0].token > 11


def test_to_flat_layout():
    t = DraftTree(width=4, depth=6, max_nodes=50)
    t.seed([[7, 8], [9]])
    cand = FlatTree([1, 2, 3], [-1, 0, -1])
    f = t.to_flat(cand, causal=False)
    assert f.tokens == [1, 2, 3, 7, 8, 9] and f.parents == [-1, 0, -1, -1, 3, -1]
    assert f.num_verify == 3 and f.causal_from == 6
    c = t.to_flat(([1, 2], [-1, 0]), causal=True)
    assert c.parents == [-1, 0, -1, 2, -1] and c.num_verify == 2 and c.causal_from == 2
    assert t.to_flat(FlatTree(), causal=True).num_verify == 0


def test_subtrees_cover_every_node():
    t = DraftTree(width=4, depth=6, max_nodes=50)
    t.seed([[1, 2, 3], [4]])
    subs = list(t.subtrees())
    assert [k for k, _ in subs] == [1, 2, 3, 4]
    assert all(k == v.token for k, v in subs)


# ---------------------------------------------------------------------- candidate pool
class Src:
    """A plain source tree for merges."""

    def __init__(self, token, *children):
        self.token = token
        self.children = list(children)


def test_recursive_merge_is_union():
    p = CandidatePool(key_max_nodes=100, max_nodes=1000)
    p.merge(5, Src(5, Src(1, Src(2, Src(3))), Src(4)))
    p.merge(5, Src(5, Src(1, Src(2, Src(6)), Src(7)), Src(8)))
    assert p.paths(5) == {(1,), (1, 2), (1, 2, 3), (1, 2, 6), (1, 7), (4,), (8,)}
    assert p.count(5, [1]) == 2 and p.count(5, [4]) == 1 and p.count(5, [1, 2, 6]) == 1
    p.merge(5, Src(5))  # a lone root adds nothing
    p.merge(6, Src(6))
    assert 6 not in p
    p.check()


def test_per_key_cap_evicts_oldest_first_level_branch():
    p = CandidatePool(key_max_nodes=5, max_nodes=1000)
    p.insert_path(1, [10, 11])
    p.insert_path(1, [20, 21])
    p.insert_path(1, [10, 12])  # refreshes branch 10: branch 20 is now the oldest
    assert p.key_size(1) == 5
    p.insert_path(1, [30])
    assert p.paths(1) == {(10,), (10, 11), (10, 12), (30,)}
    p.check()
    # one branch alone at the cap: nothing else to evict, extra nodes are refused
    p2 = CandidatePool(key_max_nodes=3, max_nodes=1000)
    p2.insert_path(1, [1, 2, 3, 4, 5])
    assert p2.paths(1) == {(1,), (1, 2), (1, 2, 3)}
    p2.check()


def test_total_cap_evicts_oldest_key():
    p = CandidatePool(key_max_nodes=10, max_nodes=5)
    p.insert_path(1, [2, 3])
    p.insert_path(4, [5, 6])
    p.retrieve(4, 4)  # reading is not writing: key 1 stays the oldest...
    p.insert_path(1, [7])  # ...until it is written: now key 4 is the oldest
    p.insert_path(8, [9])  # total would be 6: key 4 goes
    assert set(p.keys()) == {1, 8}
    p.check()


def test_insert_ngrams():
    p = CandidatePool()
    p.insert_ngrams([1, 2, 3, 4, 1, 2, 5], 3)
    assert p.paths(1) == {(2,), (2, 3), (2, 5)}
    assert p.paths(2) == {(3,), (3, 4), (5,)}
    assert p.paths(4) == {(1,), (1, 2)}
    assert 5 not in p
    p.check()


def _assert_valid_candidate(tree: FlatTree, pool: CandidatePool, key: int, budget: int):
    assert tree.num_nodes <= budget and tree.num_verify == tree.num_nodes
    paths = pool.paths(key)
    for i in range(tree.num_nodes):
        assert tree.parents[i] < i
        path = tuple(tree.tokens[j] for j in tree.path_to(i))
        assert path in paths  # every node is a real trie path; parents precede children
    sib = {}
    for i, p in enumerate(tree.parents):
        assert tree.tokens[i] not in sib.setdefault(p, set())
        sib[p].add(tree.tokens[i])


def test_retrieve_best_first_prefix_closed_within_budget():
    p = CandidatePool()
    for _ in range(5):
        p.insert_path(1, [2, 3, 4])
    p.insert_path(1, [7, 8])
    p.insert_path(1, [2, 9])
    t = p.retrieve(1, 3)
    assert t.tokens == [2, 3, 4]  # the most visited line first
    t = p.retrieve(1, 100)
    assert sorted(t.tokens) == [2, 3, 4, 7, 8, 9]
    _assert_valid_candidate(t, p, 1, 100)
    assert p.retrieve(1, 0).num_nodes == 0 and p.retrieve(42, 5).num_nodes == 0


def test_add_verified_extends_with_target_argmax():
    p = CandidatePool()
    p.insert_path(1, [2, 3])
    tree = FlatTree([2, 3, 5, 6], [-1, 0, -1, 2], num_verify=3)  # node 3 is a draft row
    p.add_verified(tree, [3, 4, 0], root_token=1, root_argmax=2)
    assert p.paths(1) == {(2,), (2, 3), (2, 3, 4), (5,), (5, 0)}
    assert p.count(1, [2]) == 2  # insert + the root argmax confirmed it
    assert p.count(1, [2, 3]) == 2 and p.count(1, [5]) == 0 and p.count(1, [5, 0]) == 1
    p.check()


def test_pool_random_stress_keeps_caps_and_valid_retrieval():
    rng = random.Random(5)
    p = CandidatePool(key_max_nodes=15, max_nodes=120)
    for step in range(1500):
        p.tick()
        op = rng.random()
        key = rng.randrange(12)
        if op < 0.4:
            p.insert_path(key, [rng.randrange(8) for _ in range(rng.randint(1, 6))])
        elif op < 0.7:
            def rnd(d):
                return Src(rng.randrange(8), *[rnd(d + 1) for _ in range(rng.randint(0, 2 if d < 4 else 0))])
            p.merge(key, Src(key, *[rnd(1) for _ in range(rng.randint(1, 3))]))
        elif op < 0.85:
            n = rng.randint(0, 8)
            t = FlatTree([rng.randrange(8) for _ in range(n)],
                         [rng.randrange(-1, i) if i else -1 for i in range(n)])
            p.add_verified(t, [rng.randrange(8) for _ in range(n)], key, rng.randrange(8))
        else:
            budget = rng.randint(0, 20)
            _assert_valid_candidate(p.retrieve(key, budget), p, key, budget)
        if step % 50 == 0:
            p.check()
    p.check()
    assert p.total > 60


# ---------------------------------------------------------------------- seeding
def test_random_seeding():
    rng = random.Random(0)
    ctx = [5, 6, 7, 8, 5, 6]
    for _ in range(50):
        seeds = RandomPromptSeeding().seeds(ctx, rng, 2)
        assert len(seeds) == 2 and seeds[0][0] != seeds[1][0]
        assert all(1 <= len(s) <= 2 and set(s) <= set(ctx) for s in seeds)
    assert RandomPromptSeeding().seeds([], rng, 2) == []
    assert len(RandomPromptSeeding().seeds([3], rng, 4)) == 1


def test_entity_heuristic_and_seeding():
    for text in ("\u0120Paris", "42", "\u2581max_len", "getValue", "x1", " 3.14", "Natalia"):
        assert entity_like(text), text
    for text in ("\u0120the", "\u0120The", ",", "\u0120", "ing", "(", "\u0120and", "I"):
        assert not entity_like(text), text
    vocab = {1: " the", 2: " Paris", 3: " is", 4: " 42", 5: " big", 6: " Paris"}
    s = EntitySeeding(decode=lambda t: vocab.get(t, ""))
    seeds = s.seeds([1, 2, 3, 4, 1, 2, 5], random.Random(0), 2)
    assert [c[0] for c in seeds] == [2, 4]  # recurring entity first
    assert all(len(c) <= 2 for c in seeds)
    seeds = s.seeds([1, 3, 5, 4], random.Random(0), 3)  # one entity, random fill-up
    assert seeds[0][0] == 4 and len({c[0] for c in seeds}) == len(seeds) == 3
    strings = EntitySeeding(token_strings=["a", "Bob", "7"]).seeds([0, 1, 2], random.Random(1), 2)
    assert {c[0] for c in strings} == {1, 2}
    with pytest.raises(ValueError):
        EntitySeeding()


# ---------------------------------------------------------------------- PTDMethod
VOCAB = 50


def fake_next(ctx) -> int:
    """A deterministic 'target': a function of the last two tokens, periodic enough that
    self-drafting can learn it, with an EOS-ish token now and then."""
    a = ctx[-1]
    b = ctx[-2] if len(ctx) > 1 else 0
    if (a * 13 + b) % 23 == 0:
        return EOS
    return (a * 7 + b * 3 + (len(ctx) % 5 == 0)) % VOCAB


def run_fake(method: PTDMethod, req_id: str, prompt, max_new: int, rng=None, metrics=None,
             check=False):
    """Greedy decoding of ``fake_next`` through the method; returns the output tokens.
    Rows see what the FlatTree says: tree rows their ancestors, causal rows all earlier rows."""
    seq = list(prompt)
    seq.append(fake_next(seq))  # the prefill's token
    method.start(req_id, list(prompt))
    while len(seq) - len(prompt) < max_new:
        tree = method.propose([req_id], [seq[-1]])[0]
        c = method.config
        assert tree.num_verify <= c.max_verify_nodes
        assert tree.num_nodes - tree.num_verify <= c.max_draft_nodes
        assert tree.num_nodes <= method.max_tree_nodes
        if rng is not None and rng.random() < 0.2:  # the scheduler cuts the tree short
            tree = tree.truncated(rng.randint(0, tree.num_nodes))
        argmax = []
        for i in range(tree.num_nodes):
            if i >= tree.causal_from:
                ctx = seq + tree.tokens[: i + 1]
            else:
                ctx = seq + [tree.tokens[j] for j in tree.path_to(i)]
            argmax.append(fake_next(ctx))
        root = fake_next(seq)
        acc, com = greedy_walk(tree, root, argmax)
        seq += com
        method.observe([req_id], [StepOutcome(tree, root, argmax, acc, com)])
        if metrics is not None:
            metrics.record(len(com), len(acc), tree.num_nodes - tree.num_verify, tree.num_verify)
        if check:
            st = method.state(req_id)
            st.draft.check()
            st.pool.check()
    method.finish(req_id)
    return seq[len(prompt):]


def plain_greedy(prompt, n):
    seq = list(prompt)
    while len(seq) - len(prompt) < n:
        seq.append(fake_next(seq))
    return seq[len(prompt):]


PROMPT = [(i * 11) % 50 for i in range(40)]


@pytest.mark.parametrize("device,attention", [("cpu", None), ("cuda", None), ("cpu", "tree"),
                                              ("cuda", "causal")])
def test_ptd_end_to_end_greedy_is_lossless_and_drafts(device, attention):
    cfg = PTDConfig(draft_attention=attention).resolved(device)
    m = PTDMethod(cfg, eos_token_ids=[EOS])
    met = SpecMetrics()
    out = run_fake(m, "r1", PROMPT, 300, rng=random.Random(1), metrics=met, check=True)
    assert out[: len(plain_greedy(PROMPT, len(out)))] == plain_greedy(PROMPT, len(out))
    assert len(out) >= 300 and EOS in out  # the target itself emits EOS now and then
    assert met.decoding_efficiency > 1.8, met.summary()  # drafting actually pays off
    assert met.draft_per_step > 0
    assert not m.has("r1") and m.num_requests() == 0


def test_ptd_is_reproducible_per_request():
    cfg = PTDConfig(seed=3).resolved("cpu")

    def trees(req_id):
        m = PTDMethod(cfg, [EOS])
        m.start(req_id, PROMPT)
        return m.propose([req_id], [PROMPT[-1]])[0]

    a, b = trees("x"), trees("x")
    assert (a.tokens, a.parents) == (b.tokens, b.parents)
    assert a.num_nodes - a.num_verify > 0  # seeds exist


def test_ptd_state_is_bounded_and_dropped():
    cfg = PTDConfig(pool_max_nodes=300, pool_key_nodes=20).resolved("cpu")
    m = PTDMethod(cfg, [EOS])
    rng = random.Random(0)
    for r in range(30):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        run_fake(m, f"req-{r}", prompt, 40, rng=rng)
    assert m.num_requests() == 0
    # many live requests: each pool stays under its caps
    for r in range(20):
        m.start(f"live-{r}", PROMPT)
    for step in range(30):
        ids = [f"live-{r}" for r in range(20)]
        trees = m.propose(ids, [step % VOCAB] * 20)
        outs = [StepOutcome(t, 1, [2] * t.num_nodes, [], [1]) for t in trees]
        m.observe(ids, outs)
    for r in range(20):
        st = m.state(f"live-{r}")
        st.pool.check()
        assert st.pool.total <= 300
        m.finish(f"live-{r}")
    m.finish("never-started")
    assert m.num_requests() == 0


def test_ptd_observe_handles_empty_and_cut_trees():
    m = PTDMethod(PTDConfig().resolved("cpu"), [EOS])
    m.start("a", PROMPT)
    tree = m.propose(["a"], [3])[0]
    m.observe(["a"], [StepOutcome(FlatTree(), 4, [], [], [4])])  # ran without a tree
    m.propose(["a"], [4])
    m.observe(["a"], [StepOutcome(tree.truncated(1), 4, [0], [], [4])])
    m.observe(["zzz"], [StepOutcome(FlatTree(), 4, [], [], [4])])  # unknown: ignored
    st = m.state("a")
    st.draft.check()
    st.pool.check()
    assert st.history[-3:] == [3, 4, 4]


def test_ptd_entity_needs_decode():
    with pytest.raises(ValueError, match="seeding"):
        PTDMethod(PTDConfig(seeding="entity").resolved("cpu"), [EOS])
    with pytest.raises(ValueError, match="resolved"):
        PTDMethod(PTDConfig(), [EOS])
    m = PTDMethod(PTDConfig(seeding="entity").resolved("cpu"), [EOS], decode_token=lambda t: f" X{t}")
    assert run_fake(m, "e", PROMPT, 20)[:20] == plain_greedy(PROMPT, 20)


def test_ptd_python_overhead_per_step():
    """propose + observe per request and step on the CPU budgets. The bound is loose (the
    test machine is shared); the design target is well under 0.5 ms."""
    m = PTDMethod(PTDConfig().resolved("cpu"), [EOS])
    m.start("p", PROMPT)
    seq = list(PROMPT) + [fake_next(PROMPT)]
    spent, steps = 0.0, 0
    gc.collect()
    gc.freeze()  # the rest of the test process' heap is not this code's cost
    try:
        for _ in range(150):
            t0 = time.process_time()
            tree = m.propose(["p"], [seq[-1]])[0]
            spent += time.process_time() - t0
            argmax = [fake_next(seq + [tree.tokens[j] for j in tree.path_to(i)])
                      for i in range(tree.num_nodes)]
            root = fake_next(seq)
            acc, com = greedy_walk(tree, root, argmax)
            seq += com
            t0 = time.process_time()
            m.observe(["p"], [StepOutcome(tree, root, argmax, acc, com)])
            spent += time.process_time() - t0
            steps += 1
    finally:
        gc.unfreeze()
    assert spent / steps < 2e-3, f"{spent / steps * 1e3:.3f} ms per step"


# ---------------------------------------------------------------------- metrics
def test_metrics_definitions():
    m = SpecMetrics()
    for committed, accepted in [(1, 0), (3, 2), (4, 3), (1, 0), (2, 1)]:
        m.record(committed=committed, accepted=accepted, draft_rows=10, verify_rows=6)
    assert m.hit_rate == pytest.approx(3 / 5)
    assert m.accept_length == pytest.approx((3 + 4 + 2) / 3)  # bonus included
    assert m.decoding_efficiency == pytest.approx(11 / 5) == m.tau
    assert m.decoding_efficiency == pytest.approx(m.hit_rate * m.accept_length + 1 - m.hit_rate)
    assert (m.draft_per_step, m.verify_per_step) == (10, 6)
    assert m.survival() == pytest.approx([1.0, 3 / 5, 2 / 5, 1 / 5])
    assert m.utilisation == pytest.approx(6 / 30)
    other = SpecMetrics()
    other.record_outcome(StepOutcome(FlatTree([1, 2, 3], [-1, 0, -1], num_verify=2), 1,
                                     [2, 0, 0], [0, 1], [1, 2, 0]))
    total = SpecMetrics.merged([m, other])
    assert total.steps == 6 and total.committed == 14 and total.draft_rows == 51
    assert total.survival()[2] == pytest.approx(3 / 6)
    d = total.as_dict()
    assert {"HR", "AL", "DE", "tau", "Dft", "Ver", "survival"} <= set(d)
    assert SpecMetrics().as_dict()["DE"] == 0.0 and SpecMetrics().survival() == []
    with pytest.raises(ValueError):
        m.record(committed=-1, accepted=0)


def test_causal_emission_puts_first_child_after_parent():
    t = DraftTree(width=4, depth=6, max_nodes=50)
    t.seed([[1, 2, 3], [4, 5]])
    grow_by(t, {1: 9})
    assert shape(t) == [(1, [(2, [(3, [(4, [])])]), (9, [])]), (4, [(5, [(6, [])])]), (5, [])]
    tokens, parents = t.emit()
    assert tokens == [1, 2, 3, 4, 9, 4, 5, 6, 5]
    assert parents == [-1, 0, 1, 2, 0, -1, 5, 6, -1]  # preorder: main-line child right after


# ---------------------------------------------------------------------------- suffix matching
def test_suffix_index_finds_the_longest_earlier_match():
    from vllm_ptd.ptd.suffix_index import SuffixIndex

    idx = SuffixIndex(max_match=4, min_match=2)
    idx.extend([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])
    m = idx.continuations(depth=3)
    # the suffix [1, 2, 3] occurred at the start, followed by 4 9 2; [2, 3] also before 5
    assert m.length == 3 and m.root.count == 1
    assert list(m.root.children) == [4]
    assert [c.token for c in m.root.children[4].children.values()] == [9]
    idx.extend([8])  # suffix ...3 8: no earlier [3, 8] -> no match of length >= 2
    assert idx.continuations(depth=3) is None
    short = SuffixIndex(max_match=4, min_match=2)
    short.extend([5, 6, 0, 5, 6, 1, 5, 6])
    m = short.continuations(depth=2)
    # [6, 5, 6]? no; [5, 6] twice before, followed by 0 and 1: a branch with counts
    assert m.length == 2 and m.root.count == 2
    assert {t: c.count for t, c in m.root.children.items()} == {0: 1, 1: 1}


def test_suffix_index_uses_the_most_recent_occurrences_and_stays_bounded():
    from vllm_ptd.ptd.suffix_index import SuffixIndex

    idx = SuffixIndex(max_match=2, min_match=2, max_occurrences=3)
    idx.extend([7, 1, 5] * 10 + [7, 1])
    m = idx.continuations(depth=1)
    assert m.length == 2 and m.root.count == 3  # only the 3 most recent occurrences
    idx.extend([3, 4] * 500)
    assert max(len(v) for v in idx._ends.values()) <= 2 * SuffixIndex.SCAN
    assert idx.nbytes() < 200 * len(idx)


def test_candidates_merge_suffix_and_pool_with_scores_and_groups():
    from vllm_ptd.ptd.candidate_pool import CandidatePool
    from vllm_ptd.ptd.candidates import POOL_GROUP, build_candidates
    from vllm_ptd.ptd.suffix_index import SuffixIndex

    pool = CandidatePool(60, 1000)
    pool.insert_path(3, [4, 5])       # text evidence: 3 -> 4 -> 5
    pool.insert_path(3, [8])
    idx = SuffixIndex(max_match=4, min_match=2)
    idx.extend([2, 3, 4, 6, 2, 3])    # suffix [2, 3] seen before, followed by 4 6
    cand = build_candidates(pool, 3, idx.continuations(depth=3), budget=8)
    tree = FlatTree(cand.tokens, cand.parents)
    paths = {tuple(tree.tokens[j] for j in tree.path_to(i)): (cand.scores[i], cand.groups[i])
             for i in range(tree.num_nodes)}
    # the suffix match's continuation, group = length; seen once: (1 + 1) / (1 + 2)
    assert paths[(4,)] == (pytest.approx(2 / 3), 2)
    assert paths[(4, 6)] == (pytest.approx(2 / 3), 2)
    assert paths[(8,)][1] == POOL_GROUP     # only in the pool
    assert paths[(4, 5)][1] == POOL_GROUP   # under a suffix node, but only the pool has it
    assert cand.tokens[0] == 4              # the suffix path ranks first
    assert not any(cand.draft_only)
    assert build_candidates(pool, 3, None, budget=0).tokens == []


def test_select_reindexes_verify_and_draft_nodes():
    t = FlatTree([1, 2, 3, 4, 7, 8], [-1, 0, -1, 2, -1, 4], num_verify=4, causal_from=4,
                 scores=[0.9, 0.8, 0.5, 0.4], groups=[2, 2, 0, 0], draft_value=0.1)
    s = t.select([0, 2, 3], num_draft=1)
    assert s.tokens == [1, 3, 4, 7] and s.parents == [-1, -1, 1, -1]
    assert (s.num_verify, s.causal_from) == (3, 3)
    assert s.scores == [0.9, 0.5, 0.4] and s.groups == [2, 0, 0] and s.draft_value == 0.1
    s = t.select([], num_draft=2)
    assert s.tokens == [7, 8] and s.parents == [-1, 0] and s.num_verify == 0
    with pytest.raises(ValueError, match="without its parent"):
        t.select([1], 0)


def test_engine_pool_bound_shrinks_the_coldest_requests_first():
    from vllm_ptd.method import StepOutcome

    rng = random.Random(5)
    cfg = PTDConfig(engine_pool_nodes=6000, pool_max_nodes=100_000).resolved("cpu")
    m = PTDMethod(cfg, [0])
    prompts = {f"r{i}": [rng.randrange(1, 3000) for _ in range(600)] for i in range(8)}
    for rid, p in prompts.items():
        m.start(rid, p)
        m.propose([rid], [p[-1]])  # its prompt's n-grams reach the pool here
        assert m.pool_nodes() <= cfg.engine_pool_nodes
    # r7 just started and decodes on: it keeps its pool, the oldest ones gave theirs up
    for _ in range(3):
        tree = m.propose(["r7"], [5])[0]
        m.observe(["r7"], [StepOutcome(tree, 6, [6] * tree.num_nodes, [], [6])])
    assert m.state("r7").pool.total > m.state("r0").pool.total
    assert m.pool_nodes() <= cfg.engine_pool_nodes
    assert m.nbytes() > 0


def _pool_counts(pool: CandidatePool) -> dict:
    """Every trie path of the pool (key, tokens...) with its visit count."""
    out, stack = {}, [((key,), root) for key, root in pool._keys.items()]
    while stack:
        path, n = stack.pop()
        for c in pool._children(n):
            p = path + (pool._tok[c],)
            out[p] = pool._cnt[c]
            stack.append((p, c))
    return out


def _pool_every_key(m: PTDMethod, st) -> bool:
    """Write every key's noted n-grams into the pool, in the order they were noted."""
    paths = sorted((stamp, key, start, end) for key in list(st.unpooled._positions)
                   for stamp, start, end in st.unpooled.take(key, st.pool))
    for stamp, key, start, end in paths:
        st.pool.insert_path(key, st.history[start:end], stamp=stamp)
    return bool(paths)


class _PoolsTextAtOnce(PTDMethod):
    """PTD with the committed text pooled as it comes, every key."""

    def start(self, req_id, prompt_token_ids, prompt_hidden=None):
        super().start(req_id, prompt_token_ids, prompt_hidden)
        _pool_every_key(self, self.state(req_id))

    def _commit(self, st, tokens):
        super()._commit(st, tokens)
        _pool_every_key(self, st)


class _PoolsEveryKeyWhenItProposes(PTDMethod):
    """PTD as it was before ``PendingNgrams``: a proposal wrote the n-grams of every key
    committed since the last one, not only those of the key it reads."""

    def _pool_text(self, st, key):
        return _pool_every_key(self, st)


def test_ptd_pools_committed_text_only_when_it_proposes():
    """A request that sends no tree pays nothing for its text's n-grams and keeps its text
    whole; when it proposes again, the key it reads holds what pooling the text as it came
    would have put there, and the keys it does not read are still not written."""
    from vllm_ptd.method import StepOutcome

    rng = random.Random(3)
    # caps out of reach: which branch a full key evicts depends on when it was written
    cfg = PTDConfig(pool_key_nodes=100_000).resolved("cpu")
    prompt = [rng.randrange(1, 60) for _ in range(80)]
    every, at_once, paused = PTDMethod(cfg, [0]), _PoolsTextAtOnce(cfg, [0]), PTDMethod(cfg, [0])
    for m in (every, at_once, paused):
        m.start("r", prompt)
    assert paused.state("r").pool.total == 0  # the prompt is not pooled yet
    last = rng.randrange(1, 60)  # the token the prefill sampled
    for step in range(12):
        committed = [rng.randrange(1, 60) for _ in range(1 + step % 3)]
        every.propose(["r"], [last])
        for m in (at_once, paused):
            m.skip(["r"], [last])  # what the proposer calls when the budget sends none
        # all ran without a tree: the committed text is all they learn
        for m in (every, at_once, paused):
            m.observe(["r"], [StepOutcome(FlatTree(), committed[-1], [], [], committed)])
        last = committed[-1]
    assert paused.state("r").history == every.state("r").history
    # nothing of the text pooled (a merged seed subtree at most)
    assert paused.state("r").pool.total < 5 < at_once.state("r").pool.total
    pending = len(paused.state("r").unpooled)
    assert pending > 0
    a, b = at_once.propose(["r"], [last])[0], paused.propose(["r"], [last])[0]
    key_counts = [{p: c for p, c in _pool_counts(m.state("r").pool).items() if p[0] == last}
                  for m in (at_once, paused)]
    assert key_counts[0] and key_counts[0] == key_counts[1]
    # the keys it did not read hold at most a merged seed subtree
    assert paused.state("r").pool.total - len(key_counts[1]) < 5
    assert 0 < len(paused.state("r").unpooled) < pending  # the other keys wait
    assert (a.tokens, a.parents, a.scores) == (b.tokens, b.parents, b.scores)


@pytest.mark.parametrize("key_cap", [100_000, 60])
def test_ptd_reading_one_key_proposes_what_writing_every_key_did(key_cap):
    """PTD decoding ``fake_next`` with trees, a cut tree and a paused step now and then:
    writing only the key a proposal reads proposes, step for step, the trees that writing
    every key's n-grams at each proposal did, the same counts, recency and scores (with a
    key's cap in reach, which branch a full key evicts may differ: nearly every tree is
    still the same)."""
    cfg = PTDConfig(pool_key_nodes=key_cap).resolved("cpu")
    new, old = PTDMethod(cfg, [EOS]), _PoolsEveryKeyWhenItProposes(cfg, [EOS])
    rng = random.Random(11)
    same = steps = 0
    for r in range(4):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(20, 120))]
        seq = list(prompt) + [fake_next(prompt)]
        for m in (new, old):
            m.start(f"r{r}", list(prompt))
        while len(seq) - len(prompt) < 150:
            if rng.random() < 0.25:  # the budget sends no tree this step
                for m in (new, old):
                    m.skip([f"r{r}"], [seq[-1]])
                tree = FlatTree()
            else:
                a, b = (m.propose([f"r{r}"], [seq[-1]])[0] for m in (new, old))
                steps += 1
                same += (a.tokens, a.parents, a.scores, a.groups) == \
                    (b.tokens, b.parents, b.scores, b.groups)
                if key_cap > 1000:
                    assert (a.tokens, a.parents, a.scores, a.groups) == \
                        (b.tokens, b.parents, b.scores, b.groups), len(seq)
                tree = a if rng.random() < 0.8 else a.truncated(rng.randint(0, a.num_nodes))
            argmax = [fake_next(seq + (tree.tokens[: i + 1] if i >= tree.causal_from else
                                       [tree.tokens[j] for j in tree.path_to(i)]))
                      for i in range(tree.num_nodes)]
            root = fake_next(seq)
            acc, com = greedy_walk(tree, root, argmax)
            seq += com
            for m in (new, old):
                m.observe([f"r{r}"], [StepOutcome(tree, root, argmax, acc, com)])
        for m in (new, old):
            m.state(f"r{r}").pool.check()
            m.finish(f"r{r}")
    assert steps > 250
    assert same >= 0.9 * steps, (same, steps)


def test_pool_shrink_frees_oldest_keys():
    pool = CandidatePool(60, 10_000)
    for k in range(10):
        pool.insert_path(k, [k + 100, k + 200])
    assert pool.total == 20
    freed = pool.shrink(5)
    assert freed >= 5 and 0 not in pool and 9 in pool
    pool.check()


def test_finished_requests_leave_no_heap_behind():
    """Rounds of requests that start, decode and finish (a server's rounds of clients): the
    heap PTD keeps after a round does not grow round over round."""
    from vllm_ptd.bench.state_memory import measure_churn

    rng = random.Random(5)
    texts = [[rng.randrange(3, 400) for _ in range(rng.randrange(40, 120))] for _ in range(12)]
    # the history of finished texts grows by design up to its cap (its own test below)
    left = measure_churn(PTDConfig(history_tokens=0).resolved("cpu"), texts, requests=6,
                         gen_tokens=24, rounds=5)
    assert max(left[1:]) <= left[0] + 8 * 1024, left


# ---------------------------------------------------------------------------- history
def test_history_matches_earlier_texts_without_reading_across_them():
    from vllm_ptd.ptd.history import TextHistory

    h = TextHistory(max_tokens=1000, max_match=4)
    assert h.find([1, 2], 4, 9) is None
    h.add(9, [5, 1, 2, 3, 4])
    h.add(8, [7, 7, 1, 2])  # [1, 2] again at its end: nothing follows it
    m = h.find([6, 1, 2], 4, 7)
    # only the first text continues [1, 2]; the second's ends at the separator
    assert m.length == 2 and m.root.count == 1
    assert list(m.root.children) == [3] and list(m.root.children[3].children) == [4]
    assert h.find([5, 1, 2], 4, 0).length == 3  # the longest match wins
    one = h.find([42, 3], 4, 0)  # no earlier [42, 3]: what followed 3 alone
    assert one.length == 1 and list(one.root.children) == [4]


def test_history_leaves_out_texts_of_the_same_prompt_when_asked():
    from vllm_ptd.ptd.history import TextHistory

    for same_prompt, expect in ((True, {3: 1, 4: 1}), (False, {4: 1})):
        h = TextHistory(1000, 4, same_prompt=same_prompt)
        h.add(1, [1, 2, 3])
        h.add(9, [1, 2, 4])
        m = h.find([0, 1, 2], 2, 1)
        assert {t: c.count for t, c in m.root.children.items()} == expect


def test_history_keeps_the_newest_texts_under_its_cap():
    from vllm_ptd.ptd.history import TextHistory

    rng = random.Random(3)
    h = TextHistory(max_tokens=500, max_match=8)
    sizes = []
    for k in range(200):
        h.add(k, [rng.randrange(3, 60) for _ in range(rng.randrange(20, 90))]
              + [1000 + k, 5000, 5001])
        sizes.append((len(h.index), h.nbytes()))
    assert max(n for n, _ in sizes) <= 2 * 500 + 100  # the index is rebuilt at twice the cap
    assert max(b for _, b in sizes[100:]) <= 1.5 * max(b for _, b in sizes[:100])
    assert h.find([1000 + 199, 5000], 2, -1).length == 2  # the newest text
    assert h.find([1000 + 2, 5000], 2, -1).length == 1    # long dropped: 5000 alone matches
    assert h.find([5000, 5001], 2, -1) is None            # nothing followed any text's end


def test_ptd_candidates_come_from_finished_requests():
    cfg = PTDConfig(max_verify_nodes=6, max_draft_nodes=0).resolved("cpu")
    m = PTDMethod(cfg, [0])
    m.start("a", [11, 12, 13, 14, 15, 16])
    m.finish("a")
    m.start("b", [20, 21, 13])  # the prefill samples 14: [13, 14] is new to its own text
    tree = m.propose(["b"], [14])[0]
    from vllm_ptd.ptd.candidates import HISTORY_GROUPS

    assert tree.tokens[:2] == [15, 16] and tree.groups[:2] == [HISTORY_GROUPS + 2] * 2
    off = PTDMethod(PTDConfig(max_verify_nodes=6, max_draft_nodes=0, history_tokens=0)
                    .resolved("cpu"), [0])
    off.start("a", [11, 12, 13, 14, 15, 16])
    off.finish("a")
    off.start("b", [20, 21, 13])
    assert off.propose(["b"], [14])[0].num_verify == 0
