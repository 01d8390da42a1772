"""The budget: step cost model, calibrated acceptance, allocation of nodes across requests,
and the drafting pause. Pure Python, no engine."""
from __future__ import annotations

import math
import random

import pytest

from vllm_ptd.budget import (AcceptanceModel, StepCostModel, TreeBudget, allocate, score_bin)
from vllm_ptd.tree import FlatTree


def linear_cost(base: float, per_row: float, overhead: float = 0.0) -> StepCostModel:
    cost = StepCostModel(prior_slope=0.0)
    for rows in (1, 2, 4, 8, 16, 32, 64):
        for _ in range(3):
            cost.observe(rows, base + per_row * (rows - 1), overhead)
    return cost


def test_cost_model_learns_interpolates_and_extrapolates():
    cost = linear_cost(50.0, 8.0, overhead=5.0)
    assert cost.forward_ms(1) == pytest.approx(50.0)
    assert cost.forward_ms(12) == pytest.approx(50 + 8 * 11)   # between 8 and 16
    assert cost.forward_ms(100) == pytest.approx(50 + 8 * 99)  # the last slope goes on
    assert cost.overhead_ms == pytest.approx(5.0)
    assert cost.step_ms_range(3, 5) == pytest.approx([5 + 50 + 8 * r for r in (2, 3, 4)])
    # nothing measured yet: the prior slope relative to one row
    prior = StepCostModel(prior_slope=0.2)
    assert prior.forward_ms(6) / prior.forward_ms(1) == pytest.approx(2.0)


def test_cost_model_tracks_a_change_and_buckets_large_counts():
    cost = linear_cost(50.0, 8.0)
    for _ in range(60):
        cost.observe(4, 200.0)
    assert cost.forward_ms(4) == pytest.approx(200.0, rel=0.01)
    assert StepCostModel.bucket(64) == 64 and StepCostModel.bucket(70) == 70 - 70 % 8
    assert StepCostModel.bucket(1000) == 1000 - 1000 % 64


def test_cost_model_saves_and_loads_as_a_prior(tmp_path):
    cost = linear_cost(50.0, 8.0, overhead=3.0)
    path = tmp_path / "cost" / "m.json"
    cost.path = path
    cost.save()
    again = StepCostModel(prior_slope=0.5, path=path)
    assert again.forward_ms(8) == pytest.approx(cost.forward_ms(8))
    assert again.overhead_ms == pytest.approx(3.0)
    # a loaded bucket counts as a prior: this engine's own samples move it at once
    again.observe(8, 500.0)
    assert again.forward_ms(8) > 100
    path.write_text("{broken")
    assert StepCostModel(path=path).rows == {}


def chain(n: int, score: float, group: int = 2) -> FlatTree:
    return FlatTree(list(range(10, 10 + n)), list(range(-1, n - 1)), scores=[score] * n,
                    groups=[group] * n)


def test_acceptance_model_calibrates_per_group_and_bin():
    acc = AcceptanceModel(engine_strength=2.0, request_strength=2.0)
    good, bad = chain(4, 0.8, group=5), chain(4, 0.8, group=0)
    for _ in range(50):
        acc.observe("r", good, [0, 1, 2, 3])  # every node of group 5 accepted
        acc.observe("r", bad, [])             # group 0: the first node rejected
    assert acc.conditional("r", [0.8], [5])[0] > 0.95
    assert acc.conditional("r", [0.8], [0])[0] < 0.05
    # nodes under a rejected parent were never looked at: no evidence about them
    assert acc.engine[(0, score_bin(0.8))][1] == 50
    # another request starts from the engine-wide estimate
    assert acc.conditional("new", [0.8], [5])[0] > 0.9
    # unconditional = product along the path
    p = acc.unconditional("r", FlatTree([1, 2, 3], [-1, 0, -1], scores=[0.8] * 3,
                                        groups=[5, 0, 5]))
    assert p[1] == pytest.approx(p[0] * acc.conditional("r", [0.8], [0])[0])
    acc.forget("r")
    assert "r" not in acc.requests


def test_allocate_sizes_trees_to_what_pays():
    cost = linear_cost(50.0, 8.0)     # a row costs 16 % of a one-row step
    # certain nodes pay, hopeless ones do not: 3 sure nodes then 3 at 1 %
    values = [[1.0, 1.0, 1.0, 0.01, 0.01, 0.01]]
    parents = [[-1, 0, 1, 2, 3, 4]]
    a = allocate(values, parents, [0.0], [0], base_rows=1, num_requests=1, cost=cost)
    assert a.verify == [[0, 1, 2]] and a.draft == [0] and a.pays
    # nothing worth its row: no tree at all
    a = allocate([[0.05, 0.05]], [[-1, 0]], [0.0], [0], 1, 1, cost)
    assert a.verify == [[]] and not a.pays
    # free rows (a GPU-like curve): every useful node goes in, draft rows too
    flat = linear_cost(50.0, 0.01)
    a = allocate([[0.5, 0.3, 0.2]], [[-1, -1, 0]], [0.05], [2], 1, 1, flat)
    assert a.verify == [[0, 1, 2]] and a.draft == [2]


def test_allocate_shares_rows_across_requests_by_value():
    cost = linear_cost(50.0, 8.0)
    values = [[0.9, 0.8, 0.7], [0.2, 0.1], [0.95]]
    parents = [[-1, 0, 1], [-1, 0], [-1]]
    a = allocate(values, parents, [0.0] * 3, [0] * 3, base_rows=3, num_requests=3, cost=cost)
    chosen = {(r, i) for r, kept in enumerate(a.verify) for i in kept}
    assert (2, 0) in chosen and (0, 0) in chosen
    assert (1, 1) not in chosen  # the weakest node is left out first
    for r, kept in enumerate(a.verify):  # closed under parents
        assert all(parents[r][i] < 0 or parents[r][i] in kept for i in kept)


def test_allocate_keeps_parents_on_random_trees():
    rng = random.Random(0)
    cost = linear_cost(30.0, 2.0)
    for _ in range(200):
        values, parents = [], []
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(0, 8)
            par = [rng.randint(-1, i - 1) for i in range(n)]
            v: list[float] = []
            for i, p in enumerate(par):
                v.append(rng.random() * (1.0 if p < 0 else v[p]))
            values.append(v)
            parents.append(par)
        a = allocate(values, parents, [0.0] * len(values), [0] * len(values),
                     len(values), len(values), cost)
        for r, kept in enumerate(a.verify):
            assert kept == sorted(kept)
            assert all(parents[r][i] < 0 or parents[r][i] in kept for i in kept)


def test_tree_budget_cuts_trees_and_pauses_drafting_that_does_not_pay():
    cost = linear_cost(50.0, 8.0)
    budget = TreeBudget(cost)
    tree = FlatTree([1, 2, 3, 9, 9], [-1, 0, 1, -1, 3], num_verify=3, causal_from=3,
                    scores=[0.99, 0.99, 0.01], groups=[3, 3, 3], draft_value=0.0)
    (cut,) = budget.size(["r"], [tree], base_rows=1, num_requests=1)
    assert cut.tokens == [1, 2] and cut.num_verify == 2
    hopeless = FlatTree([1], [-1], scores=[0.01], groups=[0])
    for _ in range(TreeBudget.MISSES):
        assert budget.should_draft()
        (none,) = budget.size(["r"], [hopeless], base_rows=1, num_requests=1)
        assert none.num_nodes == 0
    paused = 0
    while not budget.should_draft():
        paused += 1
    assert paused == 1  # the first pause is one step, the next ones double
    for _ in range(TreeBudget.MISSES):
        budget.size(["r"], [hopeless], 1, 1)
    paused = 0
    while not budget.should_draft():
        paused += 1
    assert paused == 2


def test_host_time_per_tree_is_learnt_and_charged(tmp_path):
    """Each request that carries a tree costs host work of its own (drafting, walks, tree-row
    attention): the model learns it from steps with and without trees, and a tree that pays
    for its rows but not for that is not sent."""
    cost = linear_cost(50.0, 1.0, overhead=2.0)     # rows nearly free
    for _ in range(20):
        cost.observe(9, 58.0, 2.0 + 4 * 6.0, trees=4)  # four trees: 6 ms each on the host
    assert cost.overhead_ms == pytest.approx(2.0)
    assert cost.per_tree_ms == pytest.approx(6.0, rel=0.05)
    assert cost.step_ms(9, trees=4) == pytest.approx(2.0 + 24.0 + 58.0, rel=0.01)
    # one node at 10 %: 0.1 token for 1 ms of rows pays, but not with 6 ms of host work
    no_host = linear_cost(50.0, 1.0, overhead=2.0)
    assert allocate([[0.1]], [[-1]], [0.0], [0], 1, 1, no_host).verify == [[0]]
    assert allocate([[0.1]], [[-1]], [0.0], [0], 1, 1, cost).verify == [[]]
    # a sure chain still pays for it
    assert allocate([[1.0, 1.0]], [[-1, 0]], [0.0], [0], 1, 1, cost).verify == [[0, 1]]
    cost.save(tmp_path / "cost.json")  # kept with the curve
    assert StepCostModel(path=tmp_path / "cost.json").per_tree_ms == pytest.approx(
        cost.per_tree_ms)



def test_a_tree_that_only_just_pays_on_paper_is_not_sent():
    from vllm_ptd.budget import MARGIN

    cost = linear_cost(100.0, 1.0)
    # expected rate gain of this node: (1 + p) / (100 + 1) against 1 / 100
    p_edge = (1 + MARGIN / 2) * 101 / 100 - 1
    assert allocate([[p_edge]], [[-1]], [0.0], [0], 1, 1, cost).verify == [[]]
    p_clear = (1 + 2 * MARGIN) * 101 / 100 - 1
    assert allocate([[p_clear]], [[-1]], [0.0], [0], 1, 1, cost).verify == [[0]]


def test_expensive_drafting_that_fails_is_paused_to_a_small_share_of_the_time():
    cost = linear_cost(50.0, 8.0)
    budget = TreeBudget(cost)
    hopeless = FlatTree([1], [-1], scores=[0.01], groups=[0])
    # drafting as dear as a step: one failed try, then about 1 / EXPLORE_SHARE steps without
    budget.size(["r"], [hopeless], base_rows=1, num_requests=1, drafting_ms=50.0)
    paused = 0
    while not budget.should_draft():
        paused += 1
    assert paused == math.ceil(1 / TreeBudget.EXPLORE_SHARE) - 1
    # cheap drafting is tried again at once (until MISSES misses in a row)
    budget = TreeBudget(cost)
    budget.size(["r"], [hopeless], base_rows=1, num_requests=1, drafting_ms=0.2)
    assert budget.should_draft()


def test_host_time_is_learnt_per_batch_size(tmp_path):
    """Verifying a tree costs more host time in a batch of 16 than alone (the whole batch's
    sampling and bookkeeping): learnt per batch size, a tree that pays alone is not sent
    where its host time eats the gain, and the estimates are saved with the curve."""
    cost = linear_cost(50.0, 1.0, overhead=2.0)
    for _ in range(20):
        cost.observe(1, 50.0, 2.0, trees=0, requests=1)              # alone: 2 ms host
        cost.observe(2, 51.0, 2.0 + 0.5, trees=1, requests=1)        # alone: 0.5 ms a tree
        cost.observe(16, 65.0, 7.0, trees=0, requests=16)            # 16 plain: 7 ms host
        cost.observe(18, 67.0, 7.0 + 2 * 6.0, trees=2, requests=16)  # 16 with trees: 6 ms each
    assert cost.per_tree_ms_at(1) == pytest.approx(0.5, rel=0.05)
    assert cost.per_tree_ms_at(16) == pytest.approx(6.0, rel=0.05)
    assert cost.per_tree_ms_at(20) == pytest.approx(6.0, rel=0.05)   # same bucket (16-31)
    assert cost.step_ms(16, requests=16) == pytest.approx(7.0 + 65.0, rel=0.01)
    assert cost.per_tree_ms_at(4) == pytest.approx(cost.per_tree_ms)  # unseen: over all sizes
    # one node at 40 %: worth 1 ms of rows and 0.5 ms of host alone ...
    assert allocate([[0.4]], [[-1]], [0.0], [0], 1, 1, cost).verify == [[0]]
    # ... but not 6 ms of host beside 15 other requests (0.4 token for 7 ms at 4.5 ms a token)
    values = [[0.4]] + [[] for _ in range(15)]
    a = allocate(values, [[-1]] + [[] for _ in range(15)], [0.0] * 16, [0] * 16, 16, 16, cost)
    assert a.verify[0] == []
    cost.save(tmp_path / "cost.json")
    again = StepCostModel(path=tmp_path / "cost.json")
    assert again.per_tree_ms_at(16) == pytest.approx(cost.per_tree_ms_at(16))
    assert again.per_tree_ms_at(1) == pytest.approx(cost.per_tree_ms_at(1))
