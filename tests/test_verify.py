"""Greedy and sampling tree walks."""

import pytest
import torch

from vllm_ptd.tree import FlatTree
from vllm_ptd.verify import greedy_walk, row_argmax, sampling_walk, target_probs

# root -> 0:5 -> {2:7, 3:8 -> 4:9}; root -> 1:6
CRAFTED = FlatTree([5, 6, 7, 8, 9], [-1, -1, 0, 0, 3])


def test_greedy_follows_argmax_path():
    argmax = [8, 0, 0, 9, 11]  # at nodes 0..4
    assert greedy_walk(CRAFTED, 5, argmax) == ([0, 3, 4], [5, 8, 9, 11])
    assert greedy_walk(CRAFTED, 6, argmax) == ([1], [6, 0])
    assert greedy_walk(CRAFTED, 3, argmax) == ([], [3])  # root argmax not in the tree
    assert greedy_walk(FlatTree(), 4, []) == ([], [4])


def test_greedy_on_truncated_tree():
    argmax = [8, 0, 0, 9, 11]
    assert greedy_walk(CRAFTED.truncated(4), 5, argmax) == ([0, 3], [5, 8, 9])
    assert greedy_walk(CRAFTED.truncated(3), 5, argmax) == ([0], [5, 8])
    assert greedy_walk(CRAFTED.truncated(0), 5, argmax) == ([], [5])


def test_greedy_never_accepts_draft_nodes():
    # node 2 is a draft node with the right token under an accepted verify node; node 3 is
    # a draft root child matching the root argmax
    t = FlatTree([5, 6, 8, 5], [-1, -1, 0, -1], num_verify=2)
    assert greedy_walk(t, 5, [8, 0, 1, 2]) == ([0], [5, 8])
    t2 = FlatTree([4, 5], [-1, -1], num_verify=1)
    assert greedy_walk(t2, 5, [0, 0]) == ([], [5])


def test_greedy_duplicate_siblings_lowest_index_wins():
    t = FlatTree([3, 3, 4, 9], [-1, -1, 1, 0])
    assert greedy_walk(t, 3, [9, 4, 1, 2]) == ([0, 3], [3, 9, 2])


# ---------------------------------------------------------------------- sampling
def test_target_probs_knobs():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = target_probs(logits, 1.0)
    assert torch.allclose(p, torch.softmax(logits, -1))
    assert torch.allclose(target_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))
    k2 = target_probs(logits, 1.0, top_k=2)
    assert (k2[0, 2:] == 0).all() and torch.allclose(k2[0, :2], torch.softmax(logits[0, :2], -1))
    full = torch.softmax(logits[0], -1)
    # smallest most-probable set reaching top_p: full[0] < 0.6 <= full[0] + full[1]
    pp = target_probs(logits, 1.0, top_p=0.6)
    assert (pp[0] > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(pp.sum(-1), torch.ones(1))
    assert (target_probs(logits, 1.0, top_p=float(full[0]) * 0.5)[0] > 0).sum() == 1
    assert target_probs(logits[0], 1.0).shape == (5,)
    for bad in (dict(temperature=0.0), dict(temperature=1.0, top_p=0.0),
                dict(temperature=1.0, top_k=0)):
        with pytest.raises(ValueError):
            target_probs(logits, **bad)


def chi2_pvalue(observed: list[float], expected: list[float]) -> float:
    """Pearson chi-square goodness of fit; cells with expected < 5 are pooled."""
    big = [(o, e) for o, e in zip(observed, expected) if e >= 5]
    small_o = sum(o for o, e in zip(observed, expected) if e < 5)
    small_e = sum(e for o, e in zip(observed, expected) if e < 5)
    if small_e > 0:
        big.append((small_o, small_e))
    stat = sum((o - e) ** 2 / e for o, e in big)
    dof = len(big) - 1
    # chi-square survival function = regularised upper incomplete gamma Q(dof/2, stat/2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


V = 8
# node 0 and node 2 duplicate token 2; node 0 has duplicate children (token 1 twice); token
# 0/4/6/7 are absent from the root's children (bonus only)
SAMPLE_TREE = FlatTree([2, 5, 2, 1, 1, 3, 0, 7],
                       [-1, -1, -1, 0, 0, 0, 1, 3],
                       num_verify=7)  # node 7 is a draft node: never accepted


def _cells(tree: FlatTree, probs: torch.Tensor) -> dict[tuple, float]:
    """Exact probability of each (t1, t2) outcome of the first two committed tokens: t2 is
    None when t1 is not a root child (the walk stops with t1 as the bonus)."""
    nv = tree.num_verify
    first_child = {}
    for i in range(nv):
        if tree.parents[i] == -1:
            first_child.setdefault(tree.tokens[i], i)
    cells = {}
    for t1 in range(V):
        p1 = float(probs[0, t1])
        if t1 in first_child:
            row = probs[first_child[t1] + 1]
            for t2 in range(V):
                cells[(t1, t2)] = p1 * float(row[t2])
        else:
            cells[(t1, None)] = p1
    return cells


def _run_walk(walk, tree, probs, n, seed):
    g = torch.Generator().manual_seed(seed)
    counts: dict[tuple, int] = {}
    for _ in range(n):
        acc, com = walk(tree, probs, g)
        assert all(a < tree.num_verify for a in acc)
        assert com[: len(acc)] == [tree.tokens[a] for a in acc]
        key = (com[0], com[1] if len(com) > 1 else None)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _fit(counts, cells, n):
    """p-value of the observed outcomes; 0 when an impossible outcome occurred."""
    if any(cells.get(key, 0.0) <= 0 for key in counts):
        return 0.0
    keys = [k for k, p in cells.items() if p > 0]
    return chi2_pvalue([counts.get(k, 0) for k in keys], [cells[k] * n for k in keys])


@pytest.mark.parametrize("temperature,top_p,top_k", [
    (1.0, 1.0, -1), (0.7, 0.9, -1), (1.4, 1.0, 4), (1.0, 0.85, 5)])
def test_sampling_walk_reproduces_target_distribution(temperature, top_p, top_k):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(SAMPLE_TREE.num_nodes + 1, V, generator=gen) * 1.5
    logits[0, 2] += 1.0  # make the duplicated root child likely: both copies get exercised
    probs = target_probs(logits, temperature, top_p, top_k)
    n = 4000
    counts = _run_walk(sampling_walk, SAMPLE_TREE, probs, n, seed=11)
    assert _fit(counts, _cells(SAMPLE_TREE, probs), n) > 1e-3


def _naive_walk(tree, probs, g):
    """A wrong walk (no renormalisation after a rejection): the chi-square must catch it."""
    kids = tree.children()
    acc, cur = [], -1
    while True:
        row = probs[cur + 1]
        nxt = -1
        for c in kids[cur + 1]:
            if c < tree.num_verify and float(torch.rand((), generator=g)) < float(row[tree.tokens[c]]):
                nxt = c
                break
        if nxt < 0:
            return acc, [tree.tokens[a] for a in acc] + [int(torch.multinomial(row, 1, generator=g))]
        acc.append(nxt)
        cur = nxt


def test_chi_square_has_power_against_a_biased_walk():
    gen = torch.Generator().manual_seed(7)
    probs = target_probs(torch.randn(SAMPLE_TREE.num_nodes + 1, V, generator=gen) * 1.5, 1.0)
    n = 4000
    counts = _run_walk(_naive_walk, SAMPLE_TREE, probs, n, seed=11)
    assert _fit(counts, _cells(SAMPLE_TREE, probs), n) < 1e-6


def test_sampling_walk_all_mass_on_children():
    # the children cover the whole support: a child is always accepted, never a bonus
    probs = torch.zeros(3, 4)
    probs[0, 1] = probs[0, 2] = 0.5
    probs[1:, 3] = 1.0
    t = FlatTree([1, 2], [-1, -1])
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        acc, com = sampling_walk(t, probs, g)
        assert len(acc) == 1 and com[1] == 3
        seen.add(com[0])
    assert seen == {1, 2}
    one = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert sampling_walk(FlatTree([1], [-1]), one, g) == ([0], [1, 2])


def test_sampling_walk_degenerate_rows_and_draft_nodes():
    g = torch.Generator().manual_seed(0)
    zero = torch.zeros(2, 5)
    acc, com = sampling_walk(FlatTree([1], [-1]), zero, g)
    assert acc == [] and len(com) == 1 and 0 <= com[0] < 5
    # a draft node holding all the mass is never accepted
    probs = torch.zeros(3, 4)
    probs[0, 2] = 1.0
    probs[1:, 0] = 1.0
    acc, com = sampling_walk(FlatTree([1, 2], [-1, -1], num_verify=1), probs, g)
    assert acc == [] and com == [2]
    with pytest.raises(ValueError):
        sampling_walk(FlatTree([1, 2], [-1, -1]), probs[:2], g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_takes_the_first_of_tied_maxima(dtype):
    # what vLLM's greedy sampler commits: the argmax of the fp32 logits, the first index
    # among equal maxima (frequent in bf16); row_argmax must pick the same at every row
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        rows = int(torch.randint(1, 40, (1,), generator=g))
        vocab = int(torch.randint(2, 50_000, (1,), generator=g))
        x = torch.randn(rows, vocab, generator=g).to(dtype)
        top = x.max(dim=-1, keepdim=True).values
        x.scatter_(1, torch.randint(0, vocab, (rows, 4), generator=g), top.expand(-1, 4))
        coarse = torch.randint(-3, 3, (rows, vocab), generator=g).to(dtype)
        for logits in (x, coarse):
            assert torch.equal(row_argmax(logits), logits.float().argmax(dim=-1))
