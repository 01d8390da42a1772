"""The budget: step cost model, calibrated acceptance, allocation of nodes across requests,
and the drafting pause. Pure Python, no engine."""
from __future__ import annotations

import math
import random

import pytest

from vllm_ptd.budget import (REALIZED_MARGIN, AcceptanceModel, Calibration, RealizedGain,
                             StepCostModel, TreeBudget, allocate, kept_branching, makespan_lead,
                             makespan_weights, monotone)
from vllm_ptd.tree import FlatTree


def linear_cost(base: float, per_row: float, overhead: float = 0.0) -> StepCostModel:
    cost = StepCostModel(prior_slope=0.0)
    for rows in (1, 2, 4, 8, 16, 32, 64):
        for _ in range(3):
            cost.observe(rows, base + per_row * (rows - 1), overhead)
    cost.observe(1, base, overhead, requests=1, nodes=0)  # a plain step of one request
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
        cost.observe(64, 1000.0)
    assert cost.forward_ms(64) == pytest.approx(1000.0, rel=0.01)
    assert StepCostModel.bucket(64) == 64 and StepCostModel.bucket(70) == 70 - 70 % 8
    assert StepCostModel.bucket(1000) == 1000 - 1000 % 64


def test_the_cost_curve_never_falls_with_more_rows():
    # a point measured low by chance is pooled with its neighbours, by their samples
    pts = [(1, 54.0, 8), (2, 65.0, 4), (3, 51.0, 4), (5, 46.0, 16), (8, 60.0, 3), (12, 58.0, 1)]
    fit = monotone(pts)
    assert [r for r, _ in fit] == [1, 2, 3, 5, 8, 12]
    ms = [m for _, m in fit]
    assert all(a <= b for a, b in zip(ms, ms[1:]))
    assert ms[0] == pytest.approx((54 * 8 + 65 * 4 + 51 * 4 + 46 * 16) / 32)
    assert ms[4] == ms[5] == pytest.approx((60 * 3 + 58) / 4)
    assert monotone([(1, 1.0, 2), (2, 3.0, 2)]) == [(1, 1.0), (2, 3.0)]  # kept as measured
    rng = random.Random(3)
    for _ in range(50):
        pts = sorted({r: (r, rng.uniform(10, 100), rng.randint(1, 40))
                      for r in rng.sample(range(1, 80), 12)}.values())
        ms = [m for _, m in monotone(pts)]
        assert all(a <= b + 1e-9 for a, b in zip(ms, ms[1:]))
        # pooling keeps the weighted total (weights: samples, at most 16)
        w = [min(n, 16) for _, _, n in pts]
        assert sum(wi * m for wi, m in zip(w, ms)) == pytest.approx(
            sum(wi * m for wi, (_, m, _) in zip(w, pts)))
    # the allocation no longer lands on a low point: 5 rows cost as much as one here
    cost = StepCostModel(prior_slope=0.0)
    for rows, ms in ((1, 54.0), (5, 40.0), (6, 70.0)):
        for _ in range(4):
            cost.observe(rows, ms, 0.0)
    assert cost.forward_ms(5) == pytest.approx(47.0) == cost.forward_ms(1)


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
    assert acc.conditional("r", [0.8], [5], [1])[0] > 0.95
    assert acc.conditional("r", [0.8], [0], [1])[0] < 0.05
    # nodes under a rejected parent were never looked at: no evidence about them
    assert acc.engine[acc.key(0, 0.8, 1)][1] == 50
    assert acc.key(0, 0.8, 2) not in acc.engine
    # another request starts from the engine-wide estimate
    assert acc.conditional("new", [0.8], [5], [1])[0] > 0.9
    # unconditional = product along the path
    p = acc.unconditional("r", FlatTree([1, 2, 3], [-1, 0, -1], scores=[0.8] * 3,
                                        groups=[5, 0, 5]))
    assert p[1] == pytest.approx(p[0] * acc.conditional("r", [0.8], [0], [2])[0])
    acc.forget("r")
    assert "r" not in acc.requests


def test_acceptance_model_tells_the_first_node_from_its_continuation():
    """A copied continuation either diverges at its first node or mostly goes on: 20 long
    chains accepted whole and 20 rejected at once. Pooled over depths, the first node was
    valued by the continuations' hits (0.95); apart, by its own (about one half)."""
    acc = AcceptanceModel()
    tree = chain(12, 1.0, group=8)
    for _ in range(20):
        acc.observe("r", tree, list(range(12)))
        acc.observe("r", tree, [])
    first, second, deep = acc.conditional("r", [1.0] * 3, [8] * 3, [1, 2, 7])
    assert 0.4 < first < 0.6
    assert second > 0.9 and deep > 0.95
    assert sum(acc.unconditional("r", tree)) < 0.6 * 12


def test_acceptance_model_scales_a_request_by_how_its_own_trees_came_out():
    """A request whose trees bring nothing is valued below a fresh one with the same nodes,
    one whose trees bring more than expected above it (never above 1), each by its ratio of
    accepted to expected tokens shrunk toward 1; the ratio is the request's own, fades with
    the engine's steps, and goes with the request."""
    acc = AcceptanceModel()
    tree = chain(3, 0.5, group=1)
    fresh = acc.unconditional("fresh", tree)
    assert acc.request_factor("fresh") == 1.0
    # the requests' trees come in other score bins than ``tree``'s (0.25-0.5): their cells
    # say nothing about its nodes, the request's factor does
    for score in (0.2, 0.6, 0.8, 0.95) * 4:
        acc.observe("cold", chain(3, score, group=1), [])           # nothing accepted
        acc.observe("hot", chain(3, score / 2, group=1), [0, 1, 2])  # everything accepted
    cold, hot = acc.unconditional("cold", tree), acc.unconditional("hot", tree)
    f_cold, f_hot = acc.request_factor("cold"), acc.request_factor("hot")
    assert f_cold < 0.6 and f_hot > 1.2
    assert cold[0] < 0.6 * fresh[0]
    # the factor scales every node alike (on top of the per-cell evidence), capped at 1
    base = acc._path_products("cold", tree)
    assert cold == pytest.approx([f_cold * v for v in base])
    assert all(h >= c for h, c in zip(hot, cold)) and max(hot) <= 1.0
    assert cold[0] >= cold[1] >= cold[2]  # parents first, as before
    # another request is not scaled: the fresh one has the engine-wide estimates only
    assert acc.request_factor("fresh") == 1.0
    assert acc.unconditional("fresh", tree) == acc._path_products("fresh", tree)
    # a request whose trees stopped going out drifts back toward 1 with the engine's steps
    acc.clock.steps += 10 * 256
    assert acc.request_factor("cold") > 0.95
    acc.forget("hot")
    assert "hot" not in acc.request_sums and acc.request_factor("hot") == 1.0
    # bounded with the per-request cells: the oldest request's ratio goes with them
    small = AcceptanceModel(max_requests=2)
    for rid in ("a", "b", "c"):
        small.observe(rid, tree, [])
    assert set(small.request_sums) == set(small.requests) == {"b", "c"}
    # the key request_calibration: false keeps the per-cell estimates alone
    off = AcceptanceModel(request_calibration=False)
    for _ in range(8):
        off.observe("cold", chain(3, 0.95, group=1), [])
    assert off.request_factor("cold") == 1.0
    assert off.unconditional("cold", tree) == off._path_products("cold", tree)


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


def test_makespan_weights_value_the_critical_path():
    # the requests with the most tokens left share one step; the others save their share
    assert makespan_weights([10, 7, 10, 3], 0.05) == [0.5, 0.05, 0.5, 0.05]
    assert makespan_weights([5, 5, 5, 5], 0.05) == [0.25] * 4
    assert makespan_weights([4], 0.3) == [1.0]
    assert makespan_weights([9, 2], -0.2) == [1.0, 0.0] and makespan_weights([], 0.1) == []


def test_a_batch_that_nothing_follows_sends_trees_only_where_they_shorten_it():
    # four requests, one row costs 2 % of a step, each request 3 %; every request has the
    # same sure-ish nodes. Counting tokens, all four get trees; at the batch's end only the
    # request with the most tokens left does (the others' tokens save 3 % of a step each,
    # less than their row costs)
    cost = StepCostModel(prior_slope=0.0)
    for rows in range(1, 40):
        for _ in range(3):
            cost.observe(rows, 50.0 + 1.0 * (rows - 1), 0.0, requests=min(rows, 4))
    share = cost.request_share(4)
    assert share == pytest.approx(1.0 / 53.0)
    values = [[0.6, 0.4]] * 4
    parents = [[-1, 0]] * 4
    by_tokens = allocate(values, parents, [0.0] * 4, [0] * 4, 4, 4, cost)
    assert all(kept for kept in by_tokens.verify)
    weights = makespan_weights([20, 12, 12, 15], share)
    at_end = allocate(values, parents, [0.0] * 4, [0] * 4, 4, 4, cost, weights=weights)
    assert at_end.verify == [[0, 1], [], [], []] and at_end.pays
    # all tied: the same trees as counting tokens (weights proportional to 1)
    tied = allocate(values, parents, [0.0] * 4, [0] * 4, 4, 4, cost,
                    weights=makespan_weights([9] * 4, share))
    assert tied.verify == by_tokens.verify
    # all four on the critical path, but only two have anything to send: the batch ends no
    # sooner unless all four gain, so no tree goes out (worth the mean of the four, the two
    # sure chains had gone out)
    half = [[1.0, 1.0, 1.0]] * 2 + [[]] * 2
    half_parents = [[-1, 0, 1]] * 2 + [[]] * 2
    a = allocate(half, half_parents, [0.0] * 4, [0] * 4, 4, 4, cost,
                 weights=makespan_weights([9] * 4, share))
    assert a.verify == [[], [], [], []] and not a.pays
    assert all(allocate(half, half_parents, [0.0] * 4, [0] * 4, 4, 4, cost).verify[:2])


def test_the_critical_path_is_worth_no_more_than_its_lead():
    # one request two tokens ahead of the rest: a token of its is worth a step of the batch
    # only until the next request joins the critical path, so its sure chain is cut there
    assert makespan_lead([14, 12, 12, 3]) == 2
    assert makespan_lead([9, 9]) == 9 and makespan_lead([5]) == 5 and makespan_lead([]) == 0
    cost = StepCostModel(prior_slope=0.0)
    for rows in range(1, 40):
        for _ in range(3):
            cost.observe(rows, 50.0 + 1.0 * (rows - 1), 0.0, requests=min(rows, 4))
    remaining = [14, 12, 12, 3]
    weights = makespan_weights(remaining, cost.request_share(4))
    chain = [[0.95 ** (i + 1) for i in range(8)]] + [[]] * 3
    parents = [[-1] + list(range(7))] + [[]] * 3
    args = (chain, parents, [0.0] * 4, [0] * 4, 4, 4, cost)
    unbounded = allocate(*args, weights=weights)
    assert unbounded.verify[0] == list(range(8))
    bounded = allocate(*args, weights=weights, critical_lead=makespan_lead(remaining))
    # 1.85 expected tokens in two nodes; the third brings the last 0.15 of the lead
    assert bounded.verify[0] == [0, 1, 2] and bounded.pays


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
    sure = FlatTree([1], [-1], scores=[0.95], groups=[0])

    def misses_then_pause(budget, tree) -> int:
        for _ in range(TreeBudget.MISSES):
            assert budget.should_draft()
            budget.size(["r"], [tree], base_rows=1, num_requests=1)
            assert budget.last.pays is False or not budget.realized.pays(1, 50.0)
        paused = 0
        while not budget.should_draft():
            paused += 1
        return paused

    # proposals that find nothing worth sending cost their drafting alone (nothing here):
    # cheap drafting looks again at every step, however many such misses come in a row
    for _ in range(5):
        assert misses_then_pause(budget, hopeless) == 0
    # trees that go out and do not pay (here: what drafting brought, measured, falls short
    # of its cost, so each proposal is a miss though its tree is sent) back off: the first
    # pause is one step, the next ones double
    budget.realized.observe_drafting(1, 1000.0)
    assert not budget.realized.pays(1, 50.0)
    assert misses_then_pause(budget, sure) == 1
    assert misses_then_pause(budget, sure) == 2
    # ``miss_backoff`` "all", the budget before it: every miss counts
    every = TreeBudget(cost, miss_backoff="all")
    assert misses_then_pause(every, hopeless) == 1
    assert misses_then_pause(every, hopeless) == 2
    with pytest.raises(ValueError, match="miss_backoff"):
        TreeBudget(cost, miss_backoff="some")


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



def test_no_tree_where_a_plain_step_of_the_batch_size_is_unknown():
    """A tree step is costed as a plain step of its batch plus its rows: before a plain step
    of 16 requests was measured (or can be interpolated between batch sizes measured around
    it) no tree goes out, and that is no miss of the drafting."""
    cost = linear_cost(50.0, 0.1)
    budget = TreeBudget(cost)
    sure = [chain(3, 1.0) for _ in range(16)]
    out = budget.size([f"r{i}" for i in range(16)], sure, base_rows=16, num_requests=16)
    assert all(t.num_nodes == 0 for t in out) and budget.should_draft()
    assert cost.plain_forward_ms(16) is None
    cost.observe(32, 60.0, 0.0, requests=32, nodes=0)
    assert cost.plain_forward_ms(16) == pytest.approx(50.0 + 10.0 * 15 / 31)
    out = budget.size([f"r{i}" for i in range(16)], sure, base_rows=16, num_requests=16)
    assert all(t.num_nodes == 3 for t in out)


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
    # drafting as dear as a step whose tries keep failing: a failed try, then about
    # 1 / EXPLORE_SHARE steps without while half the tries are taken to pay (before any
    # is seen), and 1 / (EXPLORE_SHARE * MIN_EXPLORE) once none has paid for a while
    pauses = []
    for _ in range(60):
        budget.size(["r"], [hopeless], base_rows=1, num_requests=1, drafting_ms=50.0)
        paused = 0
        while not budget.should_draft():
            paused += 1
        pauses.append(paused)
    full = math.ceil(1 / TreeBudget.EXPLORE_SHARE) - 1
    least = math.ceil(1 / (TreeBudget.EXPLORE_SHARE * TreeBudget.MIN_EXPLORE)) - 1
    # (the prior's weight keeps about one try in ten counted as a hit at the end)
    assert pauses[0] < 0.8 * full and 0.85 * least <= pauses[-1] <= least
    assert pauses == sorted(pauses)  # each miss makes the next try less worth its cost
    # cheap drafting is tried again at once
    budget = TreeBudget(cost)
    budget.size(["r"], [hopeless], base_rows=1, num_requests=1, drafting_ms=0.2)
    assert budget.should_draft()


def test_a_failed_try_is_paused_for_what_it_caught_up_on_too():
    """Rows a proposal caught up on (a pause's, a new prompt's) do not decide whether its
    trees pay, since whichever proposal comes first pays them; but a try after a pause pays
    them again, so the pause after a miss counts them."""
    cost = linear_cost(50.0, 8.0)
    hopeless = FlatTree([1], [-1], scores=[0.01], groups=[0])
    sure = FlatTree([1], [-1], scores=[0.95], groups=[0])
    pauses = []
    for catch_up in (0.0, 20.0):
        budget = TreeBudget(cost)
        budget.size(["r"], [hopeless], base_rows=1, num_requests=1, drafting_ms=10.0,
                    catch_up_ms=catch_up)
        paused = 0
        while not budget.should_draft():
            paused += 1
        pauses.append(paused)
        budget.size(["r"], [sure], base_rows=1, num_requests=1, drafting_ms=10.0,
                    catch_up_ms=catch_up)
        assert budget.last.pays
    assert pauses[0] >= 5 and pauses[1] >= 2.5 * pauses[0]


def tree_step_came_out(budget: TreeBudget, requests: int, nodes: int, accepted: int,
                       ms: float) -> None:
    """What the engine reports after a decode-only step whose trees the budget sized."""
    budget.observe_step(requests + nodes, ms, 0.0, trees=1, requests=requests, nodes=nodes,
                        predicted_ms=ms, taken_ms=ms, accepted=accepted)


def test_drafting_stops_where_what_it_brought_does_not_beat_its_cost():
    """Trees that look as if they pay are sent, but a batch size where what their accepted
    tokens saved, measured, comes to no more than what drafting and their rows cost stops
    drafting (every proposal there counts as a miss), while another batch size whose trees
    paid goes on; drafting is tried again now and then, and resumes once trees pay."""
    cost = linear_cost(50.0, 1.0)
    cost.observe(4, 53.0, 0.0, requests=4, nodes=0)  # a plain step of 4 requests measured
    budget = TreeBudget(cost)
    sure = FlatTree([1], [-1], scores=[0.95], groups=[0])
    # at 4 requests each tree step takes 12 ms beyond a plain one (53 ms) and brings one
    # token (53 / 4 ms saved), and a proposal costs 2 ms: estimated to pay, it breaks even
    assert budget.realized.pays(4, 53.0)  # nothing measured yet: drafting starts
    tries, sent = 0, 0
    for _ in range(400):
        if not budget.should_draft():  # a plain step
            budget.observe_step(4, 53.0, 0.0, trees=0, requests=4, nodes=0, predicted_ms=0.0,
                                taken_ms=53.0)
            continue
        tries += 1
        kept = budget.size(["a", "b", "c", "d"], [sure] * 4, base_rows=4, num_requests=4,
                           drafting_ms=2.0)
        if any(t.num_nodes for t in kept):
            sent += 1
            tree_step_came_out(budget, requests=4, nodes=sum(t.num_nodes for t in kept),
                               accepted=1, ms=65.0)
    assert budget.realized.gain(4, 53.0) < 1.0 + REALIZED_MARGIN
    assert budget.last.pays  # the estimates still say it pays ...
    assert 5 <= tries <= 60 and sent >= 5  # ... but drafting stopped: tries now and then
    # at batch 1 the same trees pay (one token saves a 50 ms step for 1 ms of row and 2 ms
    # of drafting): its record is its own, and once the pause in flight is over drafting
    # there goes on every step
    drafted = []
    for _ in range(100):
        drafted.append(budget.should_draft())
        if drafted[-1]:
            budget.size(["r"], [sure], base_rows=1, num_requests=1, drafting_ms=2.0)
            tree_step_came_out(budget, requests=1, nodes=1, accepted=1, ms=51.0)
        else:
            budget.observe_step(1, 50.0, 0.0, trees=0, requests=1, nodes=0, predicted_ms=0.0,
                                taken_ms=50.0)
    assert budget.realized.pays(1, 50.0) and all(drafted[-30:])
    # once trees at 4 requests bring what they cost many times over, drafting resumes there
    for _ in range(200):
        if budget.should_draft():
            budget.size(["a", "b", "c", "d"], [sure] * 4, base_rows=4, num_requests=4,
                        drafting_ms=2.0)
            tree_step_came_out(budget, requests=4, nodes=4, accepted=4, ms=57.0)
        else:
            budget.observe_step(4, 53.0, 0.0, trees=0, requests=4, nodes=0,
                                predicted_ms=0.0, taken_ms=53.0)
    assert budget.realized.pays(4, 53.0) and budget.should_draft()


def test_realized_gain_starts_open_and_a_few_failed_tries_do_not_close_it():
    """A new batch size starts from two plain steps of cost at a gain of 1 + 2 * margin:
    two tries that bring nothing (a fifth of a plain step each) leave drafting on, eight
    stop it; its record is kept per batch size; ``margin`` None turns the check off."""
    gain = RealizedGain()
    assert gain.pays(1, 25.0)
    for _ in range(2):
        gain.observe_drafting(1, 5.0)
    assert gain.pays(1, 25.0)
    for _ in range(6):
        gain.observe_drafting(1, 5.0)
    assert not gain.pays(1, 25.0) and gain.pays(4, 25.0)
    off = RealizedGain(margin=None)
    for _ in range(8):
        off.observe_drafting(1, 5.0)
    assert off.pays(1, 25.0)


def test_a_pauses_rows_are_not_charged_to_what_drafting_brings():
    """The rows a pause left (``paused_ms``) cost a try after it, not drafting at every
    step: the measured gain leaves them out (a new prompt's rows it keeps), so tries after
    pauses that bring what steady drafting would keep drafting on at that batch size."""
    cost = linear_cost(50.0, 1.0)
    cost.observe(4, 53.0, 0.0, requests=4, nodes=0)
    sure = FlatTree([1], [-1], scores=[0.95], groups=[0])
    gains = {}
    for label, paused in (("a pause's rows", 20.0), ("a new prompt's rows", 0.0)):
        budget = TreeBudget(cost)
        for _ in range(20):
            budget.size(["r"], [sure], base_rows=4, num_requests=4, drafting_ms=5.0,
                        catch_up_ms=20.0, paused_ms=paused)
            tree_step_came_out(budget, requests=4, nodes=1, accepted=1, ms=56.0)
        gains[label] = budget.realized.gain(4, 53.0)
    # each tree step saved 53 / 4 ms against 3 ms of rows and 5 (+ 20) ms of drafting
    assert gains["a pause's rows"] == pytest.approx(
        (20 * 53 / 4 + 2 * 53 * 1.6) / (20 * 8 + 2 * 53), rel=0.05)
    assert gains["a pause's rows"] >= 1 + REALIZED_MARGIN > gains["a new prompt's rows"]


def test_a_miss_among_tries_that_mostly_pay_hardly_pauses_drafting():
    """The pause after a miss counts only the share of tries that miss at that batch size:
    where nearly every try pays, one miss costs a step or two; at a batch size whose tries
    keep missing, the full pause holds (the two sizes' tries are counted apart)."""
    cost = linear_cost(50.0, 1.0)
    budget = TreeBudget(cost)
    sure = FlatTree([1], [-1], scores=[0.95], groups=[0])
    hopeless = FlatTree([1], [-1], scores=[0.01], groups=[0])
    for _ in range(40):
        budget.size(["r"], [sure], base_rows=1, num_requests=1, drafting_ms=10.0)
        assert budget.last.pays and budget.should_draft()
        tree_step_came_out(budget, requests=1, nodes=1, accepted=1, ms=51.0)
    budget.size(["r"], [hopeless], base_rows=1, num_requests=1, drafting_ms=10.0)
    paused = 0
    while not budget.should_draft():
        paused += 1
    full = math.ceil(10.0 / (TreeBudget.EXPLORE_SHARE * 50.0)) - 1
    assert full >= 10 and paused <= 3
    # batch 16's tries have not paid: a miss there pauses for the full share, and longer
    cost.observe(16, 65.0, 0.0, requests=16, nodes=0)  # a plain step of 16 measured
    for _ in range(60):
        budget.size(["r"], [hopeless], base_rows=16, num_requests=16, drafting_ms=10.0)
        paused = 0
        while not budget.should_draft():
            paused += 1
    full = math.ceil(10.0 / (TreeBudget.EXPLORE_SHARE * cost.step_ms(16, requests=16))) - 1
    assert full >= 9 and paused >= 3 * full
    # ... and batch 1's record is its own: a miss there still pauses it briefly
    budget.size(["r"], [hopeless], base_rows=1, num_requests=1, drafting_ms=10.0)
    paused = 0
    while not budget.should_draft():
        paused += 1
    assert paused <= 4


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


def test_tree_rows_are_costed_at_the_batch_size_they_run_in(tmp_path):
    """At one row count a step of four requests with a tree costs more than a step of one
    (measured here: 4 requests 42.6 ms plain, 85 ms with 12 tree rows, while one request
    with 15 tree rows took 63 ms), and prefill rows cost less than tree rows: a tree step is
    costed as a plain step of its requests plus what tree rows add at that batch size,
    learnt from decode-only steps; until both are measured, from the curve over all
    steps. Saved with the rest."""
    cost = StepCostModel(prior_slope=0.0)
    for _ in range(5):
        for rows in (1, 4, 8, 12):
            cost.observe(rows, 50.0, 0.0, trees=int(rows > 1), requests=1, nodes=rows - 1)
        cost.observe(12, 50.0, 0.0, requests=4, nodes=0)   # 4 decoding + 8 prefill rows
    assert cost.step_ms(12, requests=4) == pytest.approx(50.0)  # nothing at 4: over all
    for _ in range(5):
        cost.observe(4, 42.0, 0.0, requests=4, nodes=0)
    assert cost.step_ms(12, requests=4) == pytest.approx(50.0)  # no tree rows at 4 yet
    for _ in range(5):
        cost.observe(8, 60.0, 0.0, trees=1, requests=4, nodes=4)
    assert cost.step_ms(4, requests=4) == pytest.approx(42.0)
    assert cost.step_ms_range(4, 6, requests=4) == pytest.approx([42.0, 46.5, 51.0])
    # past the only count measured: what one more decoding request adds (nothing here: one
    # request measured dearer than four), not the slope from no rows, which carries the
    # fixed cost of having a tree
    assert cost.step_ms(12, requests=4) == pytest.approx(42.0 + 18.0)
    for _ in range(5):
        cost.observe(16, 78.0, 0.0, trees=1, requests=4, nodes=12)
    assert cost.step_ms(16, requests=4) == pytest.approx(42.0 + 36.0)
    assert cost.step_ms(20, requests=4) == pytest.approx(42.0 + 36.0 + 4 * 18.0 / 8)
    assert cost.step_ms(9, requests=5) == pytest.approx(cost.forward_ms(9))  # 5 not measured
    for _ in range(5):
        cost.observe(5, 45.0, 0.0, requests=5, nodes=0)
    assert cost.step_ms(9, requests=5) == pytest.approx(45.0 + 18.0)  # same bucket (4-7)
    assert cost.step_ms(12, requests=1) == pytest.approx(50.0)
    # a chain of 8 nodes at 60 % each beside 4 requests: on the curve over all steps all of
    # it would go (12 rows for 5.5 tokens at 50 ms), at this batch size a node or two
    values = [[0.6 ** (k + 1) for k in range(8)], [], [], []]
    parents = [[-1, 0, 1, 2, 3, 4, 5, 6], [], [], []]
    a = allocate(values, parents, [0.0] * 4, [0] * 4, 4, 4, cost)
    assert 1 <= len(a.verify[0]) <= 2
    cost.save(tmp_path / "cost.json")
    again = StepCostModel(path=tmp_path / "cost.json")
    assert again.step_ms(16, requests=4) == pytest.approx(78.0)
    assert again.step_ms(12, requests=4) == pytest.approx(cost.step_ms(12, requests=4))


def test_tree_rows_measured_once_per_node_count_still_make_the_curve():
    """At 16 requests trees go out on few steps, each with another node count: every such
    step is a point of the batch size's tree-row curve, not only counts seen twice (the
    curve over all steps, made cheap by prefill rows, had priced them a fifth low)."""
    cost = StepCostModel(prior_slope=0.0)
    for _ in range(5):
        cost.observe(16, 80.0, 0.0, requests=16, nodes=0)
        cost.observe(216, 120.0, 0.0, requests=16, nodes=None)  # a prefill of 200 rows
    for nodes in (11, 15, 30, 42):  # 3 ms a tree row, each count once
        cost.observe(16 + nodes, 80.0 + 3.0 * nodes, 0.0, trees=2, requests=16, nodes=nodes)
    assert cost.step_ms(16 + 20, requests=16) == pytest.approx(80.0 + 60.0)
    assert cost.step_ms(16 + 50, requests=16) == pytest.approx(80.0 + 150.0)
    # the last two counts measured out of order pool into a flat end: past it the cost
    # still grows, along the chord from no tree rows
    cost.observe(16 + 60, 80.0 + 150.0, 0.0, trees=2, requests=16, nodes=60)
    cost.observe(16 + 50, 80.0 + 170.0, 0.0, trees=2, requests=16, nodes=50)
    assert cost.step_ms(16 + 60, requests=16) == pytest.approx(80.0 + 160.0)
    chord = (160.0 - 33.0) / (60 - 11)  # from the first count measured to the last
    assert cost.step_ms(16 + 120, requests=16) == pytest.approx(80.0 + 160.0 + 60 * chord)


def test_a_first_tree_step_at_a_batch_size_costs_rows_as_decoding_requests():
    """Before any tree step at 16 requests, a tree row is priced at least at what one more
    decoding request adds (the chord of the plain steps), not below it by the curve over
    all steps, which prefill rows make cheap."""
    cost = StepCostModel(prior_slope=0.0)
    for _ in range(5):
        cost.observe(1, 50.0, 0.0, requests=1, nodes=0)
        cost.observe(16, 110.0, 0.0, requests=16, nodes=0)
        cost.observe(216, 150.0, 0.0, requests=16, nodes=None)  # a prefill of 200 rows
    assert cost.step_ms(16 + 30, requests=16) == pytest.approx(110.0 + 4.0 * 30)


def test_calibration_corrects_what_came_out_brighter_than_estimated():
    cal = Calibration()
    assert cal.time_ratio(4) == 1.0 and cal.token_ratio(4) == 1.0  # nothing seen
    cal.observe_time(4, 80.0, 120.0)          # one step: shrunk toward 1 by 8 like it
    assert cal.time_ratio(4) == pytest.approx((120 + 8 * 80) / (80 + 8 * 80))
    for _ in range(200):
        cal.observe_time(5, 80.0, 92.0)       # same bucket (4-7): 15 % longer
        cal.observe_tokens(6, 2.0, 1.6)       # 80 % of the tokens
        cal.observe_time(1, 50.0, 50.0)       # batch 1 as predicted
    # the last ~MEMORY steps count, shrunk by PRIOR_STEPS steps as estimated
    m, k = Calibration.MEMORY, Calibration.PRIOR_STEPS
    assert cal.time_ratio(4) == pytest.approx((m * 92 + k * 80) / ((m + k) * 80), abs=0.01)
    assert cal.token_ratio(7) == pytest.approx((m * 1.6 + k * 2) / ((m + k) * 2), abs=0.01)
    assert cal.time_ratio(1) == pytest.approx(1.0) and cal.token_ratio(16) == 1.0
    cal.observe_tokens(2, 0.0, 3.0)           # nothing expected: nothing learnt
    assert cal.token_ratio(2) == 1.0
    for _ in range(100):
        cal.observe_time(16, 10.0, 1000.0)
    assert cal.time_ratio(16) == Calibration.BOUNDS[1]
    # a node that pays by 4 % on paper (4.3 tokens in 58 ms against 4 in 56) does not once
    # its step takes 15 % longer and brings 80 % of what was expected
    cost = linear_cost(50.0, 2.0)
    values = [[0.3], [], [], []]
    parents = [[-1], [], [], []]
    on_paper = allocate(values, parents, [0.0] * 4, [0] * 4, 4, 4, cost)
    assert on_paper.verify[0] == [0] and on_paper.pays
    calibrated = allocate(values, parents, [0.0] * 4, [0] * 4, 4, 4, cost,
                          time_ratio=cal.time_ratio(4), token_ratio=cal.token_ratio(4))
    assert calibrated.verify[0] == [] and not calibrated.pays


def test_calibration_forgets_a_bad_start():
    cal = Calibration()
    for _ in range(65):
        cal.observe_tokens(4, 0.85, 0.05)      # a bad stretch: trees rejected
    assert cal.token_ratio(4) == Calibration.BOUNDS[0]
    for _ in range(Calibration.MEMORY * 3):
        cal.observe_tokens(4, 1.0, 0.9)        # later trees come out near their estimate
    assert cal.token_ratio(4) == pytest.approx(0.9, abs=0.03)


def test_engine_wide_evidence_fades_with_steps_that_send_no_tree():
    """A warm-up on reversed prompts (no draft accepted) once held an engine's trees back
    for good: with no tree sent, nothing could show otherwise. Calibration sums and the
    engine-wide acceptance counts fade with engine steps, so the estimates return to the
    method's own scores and the trees are tried again."""
    from vllm_ptd.budget import STEP_MEMORY

    budget = TreeBudget(StepCostModel(prior_slope=0.0))
    tree = chain(3, 0.8, group=0)
    for _ in range(40):
        budget.calibration.observe_tokens(4, 1.0, 0.0)
        budget.observe("warm", tree, [])
    budget.acceptance.forget("warm")
    assert budget.calibration.token_ratio(4) == Calibration.BOUNDS[0]
    assert budget.acceptance.conditional("r", [0.8], [0], [1])[0] < 0.2
    for _ in range(3 * STEP_MEMORY):  # plain steps
        budget.observe_step(4, 40.0, 2.0, trees=0, requests=4, nodes=0, predicted_ms=0.0,
                            taken_ms=42.0)
    assert budget.calibration.token_ratio(4) > 0.7
    assert budget.acceptance.conditional("r", [0.8], [0], [1])[0] > 0.6


def test_a_step_mixing_a_prefill_with_trees_is_no_error_of_the_sizing():
    budget = TreeBudget(StepCostModel(prior_slope=0.0))
    # 4 decoding requests, 12 tree rows and 300 prefill rows: 900 ms against 90 predicted
    budget.observe_step(316, 880.0, 20.0, trees=1, requests=4, nodes=12, predicted_ms=90.0,
                        taken_ms=900.0)
    assert budget.calibration.time_ratio(4) == 1.0
    budget.observe_step(16, 100.0, 8.0, trees=1, requests=4, nodes=12, predicted_ms=90.0,
                        taken_ms=108.0)
    assert budget.calibration.time_ratio(4) == pytest.approx((108 + 8 * 90) / (90 + 8 * 90))
    budget.observe_step(16, 100.0, None, trees=1, requests=4, nodes=12, predicted_ms=90.0,
                        taken_ms=5000.0)   # the engine idling: no host time, nothing learnt
    assert budget.calibration.time_ratio(4) == pytest.approx((108 + 8 * 90) / (90 + 8 * 90),
                                                             rel=1e-3)  # (but a step faded)


def test_kept_branching_is_the_k_an_expansion_needs():
    # a chain; a root with two children; two parents at depth 1 with one child each
    assert kept_branching([-1, 0, 1], [1, 2, 3], [0, 1, 2]) == 1
    assert kept_branching([-1, -1, 0], [1, 1, 2], [0, 1, 2]) == 2
    assert kept_branching([-1, -1, 0, 1], [1, 1, 2, 2], [0, 1, 2, 3]) == 2
    assert kept_branching([-1, -1, -1, 0, 1, 2], [1, 1, 1, 2, 2, 2], [0, 1, 3]) == 2
    assert kept_branching([-1, 0], [1, 2], []) == 0


def test_draft_branching_follows_the_kept_trees_and_fades():
    """No limit before the first sizing at a batch size; then one more than the branching
    of the trees kept there (a chain: 2), falling by ``REACH_FADE`` per sizing that keeps
    nothing that wide, and rising with a wider tree kept."""
    budget = TreeBudget(linear_cost(50.0, 0.5))
    assert budget.draft_branching(1) is None
    # root -> a, b, c (depth 1); a -> d (depth 2): the root has three children
    wide = FlatTree([1, 2, 3, 4], [-1, -1, -1, 0], scores=[0.99, 0.98, 0.97, 0.99],
                    groups=[1, 1, 1, 2])
    (kept,) = budget.size(["r"], [wide], base_rows=1, num_requests=1)
    assert kept.num_nodes == 4 and budget.last.branching == 3
    assert budget.draft_branching(1) == 4 and budget.draft_branching(4) is None
    chain = FlatTree([1, 2, 3], [-1, 0, 1], scores=[0.99, 0.99, 0.99], groups=[1, 2, 3])
    sizings = 0
    while budget.draft_branching(1) > 2:
        (kept,) = budget.size(["r"], [chain], base_rows=1, num_requests=1)
        assert kept.num_nodes == 3 and budget.last.branching == 1
        sizings += 1
    assert sizings == round(2 / TreeBudget.REACH_FADE)
    # two requests' chains side by side are no wider: branching is per tree
    budget.cost.observe(2, 50.5, 0.0, requests=2, nodes=0)  # a plain step of two requests
    budget.size(["r", "s"], [chain, chain], base_rows=2, num_requests=2)
    assert budget.last.branching == 1 and budget.draft_branching(2) == 2
    hopeless = FlatTree([1], [-1], scores=[0.001], groups=[1])
    budget.size(["r"], [hopeless], base_rows=1, num_requests=1)
    assert budget.last.branching == 0 and budget.draft_branching(1) == 2  # fading from 1
    (kept,) = budget.size(["r"], [wide], base_rows=1, num_requests=1)
    assert budget.draft_branching(1) == 4


def test_draft_depth_follows_the_deepest_kept_node_and_fades():
    """No limit before the first sizing at a batch size; then one level below the deepest
    node kept there, falling by ``REACH_FADE`` per sizing that keeps nothing that deep, and
    rising one level at a time as trees are kept to their last level."""
    budget = TreeBudget(linear_cost(50.0, 0.5))
    assert budget.draft_depth(1) is None
    chain = FlatTree([1, 2, 3, 4], [-1, 0, 1, 2], scores=[0.99, 0.99, 0.99, 0.99],
                     groups=[1, 2, 3, 4])
    (kept,) = budget.size(["r"], [chain], base_rows=1, num_requests=1)
    assert kept.num_nodes == 4 and budget.draft_depth(1) == 5
    assert budget.draft_depth(4) is None  # another batch size learns its own
    hopeless = FlatTree([1], [-1], scores=[0.001], groups=[1])
    steps = 0
    while budget.draft_depth(1) > 1:
        budget.size(["r"], [hopeless], base_rows=1, num_requests=1)
        steps += 1
    assert steps == round(4 / TreeBudget.REACH_FADE)
    (kept,) = budget.size(["r"], [chain.truncated(1)], base_rows=1, num_requests=1)
    assert kept.num_nodes == 1 and budget.draft_depth(1) == 2
