"""The benchmark package's own logic (vllm_ptd.bench): method parsing, defaults, the memory
check, trace reading, and the report/plots rebuilt from a committed run's results.json (no
engine is started)."""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import pytest

from vllm_ptd.bench import engines, host, memory, methods, offline

REPO = Path(__file__).resolve().parent.parent


def test_parse_methods_adds_plain_and_checks_keys():
    parsed = methods.parse_methods("ngram:3,ptd:max_verify_nodes=6:max_draft_nodes=4,pctree:mode=chain")
    assert [m.label for m in parsed][0] == "none"
    ngram = parsed[1]
    assert ngram.spec["num_speculative_tokens"] == 3 and ngram.spec["prompt_lookup_max"] == 5
    # PTD leaves out the texts of its own prompt's earlier runs (repeats would copy them)
    assert parsed[2].spec == {"method": "ptd", "history_same_prompt": False,
                              "max_verify_nodes": 6, "max_draft_nodes": 4}
    with pytest.raises(ValueError, match="given twice"):
        methods.parse_methods("ptd,ptd")
    with pytest.raises(ValueError, match="max_verfy_nodes"):
        methods.parse_methods("ptd:max_verfy_nodes=3")
    with pytest.raises(ValueError, match="unknown method"):
        methods.parse_methods("eagle")


def test_a_method_runs_again_under_a_tag():
    parsed = methods.parse_methods("none,none@2,ptd@b:max_verify_nodes=6")
    assert [(m.label, m.name) for m in parsed] == [
        ("none", "none"), ("none@2", "none"), ("ptd@b:max_verify_nodes=6", "ptd")]
    assert parsed[1].spec is None and parsed[2].spec == {
        "method": "ptd", "history_same_prompt": False, "max_verify_nodes": 6}
    with pytest.raises(ValueError, match="none@"):
        methods.parse_methods("none@")


def test_dtype_auto_and_fp32_alias():
    a = argparse.Namespace(dtype="auto", kv_cache_gib=None, model="m")
    host.resolve_common_args(a)
    assert a.dtype == ("bfloat16" if host.fast_bf16() else "float32")
    assert a.kv_cache_gib == (1.0 if a.dtype == "float32" else 0.5)
    b = argparse.Namespace(dtype="fp32", kv_cache_gib=0.25, model="m")
    host.resolve_common_args(b)
    assert (b.dtype, b.kv_cache_gib) == ("float32", 0.25)


def test_memory_check_refuses_too_many_engines(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    opts = {"dtype": "float32", "kv_cache_gib": 0.5}
    memory.check_memory(4, opts, avail_gib=20.0)  # 4 x 3 GiB fits
    with pytest.raises(SystemExit, match="9 engines need about 27 GiB"):
        memory.check_memory(9, opts, avail_gib=20.0)


def test_replot_rebuilds_report_and_plots(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    # a report keeps every method it ran, installed here or not (this one ran suffix)
    monkeypatch.setattr(methods, "suffix_available", lambda: False)
    src = REPO / "docs" / "results" / "b1_compiled" / "results.json"
    shutil.copy(src, tmp_path / "results.json")
    offline.replot(tmp_path / "results.json", str(REPO / "docs" / "results" / "rowcost_compiled" / "row_cost.json"))
    md = (tmp_path / "results.md").read_text()
    data = json.loads(src.read_text())
    for label in data["meta"]["methods"]:
        assert f"| {label} |" in md
    for png in ("speedup.png", "de_vs_rows.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_suffix_baseline_is_skipped_with_a_note_when_missing(monkeypatch, capsys):
    monkeypatch.setattr(methods, "suffix_available", lambda: False)
    labels = [m.label for m in methods.parse_methods("ngram:6,suffix,ptd")]
    assert labels == ["none", "ngram:6", "ptd"]
    assert "arctic-inference" in capsys.readouterr().out
    monkeypatch.setattr(methods, "suffix_available", lambda: True)
    (suffix,) = [m for m in methods.parse_methods("suffix:suffix_decoding_max_tree_depth=16")
                 if m.name == "suffix"]
    # its cross-request cache is off unless asked for (repeats would read earlier outputs)
    assert suffix.spec == {"method": "suffix", "suffix_decoding_max_tree_depth": 16,
                           "suffix_decoding_max_cached_requests": 0}
    (cached,) = methods.parse_methods("suffix:suffix_decoding_max_cached_requests=100")[1:]
    assert cached.spec["suffix_decoding_max_cached_requests"] == 100


def test_trace_reader_splits_request_and_step_records(tmp_path):
    from vllm_ptd.bench.aggregate import step_time_summary

    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"req": "a", "nodes": 4, "proposed": 5, "verify": 3,
                                "accepted": 2, "committed": 3}) + "\n"
                    + json.dumps({"step": {"rows": 5, "wall_ms": 40.0, "forward_ms": 30.0,
                                           "tree_attention_ms": 2.0, "verify_ms": 1.0,
                                           "drafting_ms": 3.0, "budget_ms": 0.5}}) + "\n"
                    + '{"req": "b", "nod')  # a line still being written
    rows, steps, pos = engines.read_trace(str(path), 0)
    assert rows == [(4, 3, 2, 3)] and len(steps) == 1
    assert pos < path.stat().st_size  # the partial line is read next time
    t = step_time_summary(steps + [{"rows": 1, "wall_ms": 5000.0}])  # an idle gap is left out
    assert t["steps"] == 1 and t["other"] == 40.0 - 30.0 - 1.0 - 3.0 - 0.5


def test_fast_bf16_and_int8_are_read_off_the_flags(monkeypatch):
    from vllm_ptd import hardware

    for flags, bf16, int8 in (({"avx2"}, False, False),  # AMD EPYC, AVX2 only
                              ({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, True, True),
                              ({"avx2", "avx_vnni"}, False, True),
                              ({"avx2", "amx_bf16", "amx_int8"}, True, True)):
        monkeypatch.setattr(hardware, "cpu_flags", lambda flags=flags: flags)
        assert (hardware.cpu_has_fast_bf16(), hardware.cpu_has_fast_int8()) == (bf16, int8)


def test_cpu_description_names_the_processor_and_its_matmul_extensions():
    from vllm_ptd.hardware import cpu_description

    info = ("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse avx2 avx512f "
            "avx512_bf16 sha_ni\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9R14\n"
            "flags\t\t: fpu sse avx2 avx512f avx512_bf16 sha_ni\n")
    assert cpu_description(info) == "AMD EPYC 9R14 (avx2 avx512f avx512_bf16)"
    assert cpu_description("model name\t: Old\nflags\t: fpu sse\n") == "Old"
    assert cpu_description("model name\t: X\nflags\t: avx2 avx512f avx512_vnni amx_int8 "
                           "amx_bf16\n") == "X (avx2 avx512f avx512_vnni amx_bf16 amx_int8)"
    assert host.host_info()["cpu"] == cpu_description()


def test_serving_report_counts_engine_time_and_short_steps():
    from vllm_ptd.bench.serving import report, summarize

    def req(text):
        return {"tokens": 4, "text": text, "error": None, "ttft": 0.1, "itl": [0.05], "tpot": 0.05}

    steps = [{"rows": 4, "requests": 4, "trees": 0, "nodes": 0, "accepted": 0,
              "wall_ms": 100.0, "forward_ms": 90.0},
             {"rows": 3, "requests": 2, "trees": 1, "nodes": 1, "accepted": 1,
              "wall_ms": 80.0, "forward_ms": 70.0, "verify_ms": 2.0, "drafting_ms": 1.0},
             {"rows": 1, "requests": 1, "trees": 0, "nodes": 0, "accepted": 0,
              "wall_ms": 5000.0, "forward_ms": 10.0}]  # idle: left out
    rounds = [{"label": "none", "clients": 4, "repeat": 0, "wall": 1.0, "requests": [req("a")]},
              {"label": "ptd", "clients": 4, "repeat": 0, "wall": 1.0, "requests": [req("a")],
               "trace": [], "steps": steps}]
    rows = summarize(rounds, ["none", "ptd"], [4], 1)
    by = {r["label"]: r for r in rows}
    assert by["none"]["engine"] is None
    e = by["ptd"]["engine"]
    assert e["busy_s"] == pytest.approx(0.18) and e["forward_s"] == pytest.approx(0.16)
    assert (e["steps"], e["tree_steps"], e["short_steps"]) == (2, 1, 1)
    assert e["short_busy_s"] == pytest.approx(0.08)
    md = report(rows, {"model": "m", "dtype": "float32", "max_tokens": 4, "num_requests": 1,
                       "repeats": 1, "servers": ""}, {})
    # no plain decode step of 2 requests to price the tree step against
    assert e["decode_speedup"] == pytest.approx(1.0)
    assert "| 4 | ptd | 0.18 | 0.16 | 0.00 | 0.00 | 2 | 1 | 1 (0.08) | 1.00 |" in md


def test_arrival_waves_count_requests_sent_together_as_one():
    """Requests sent within half a step (half the round's median chunk gap) of the one
    before them are one wave; the same requests spread a step apart are as many waves."""
    from vllm_ptd.bench.serving import arrival_waves

    def req(start):
        return {"start": start, "itl": [0.050, 0.050, 0.060]}

    in_step = [req(0.0), req(0.002), req(0.004), req(3.2), req(3.203), req(3.205)]
    spread = [req(0.0), req(0.05), req(0.10), req(3.2), req(3.25), req(3.30)]
    assert arrival_waves(in_step) == 2
    assert arrival_waves(spread) == 6
    assert arrival_waves([{"start": None, "itl": []}]) is None


def test_decode_speedup_prices_each_step_at_its_batch_sizes_plain_steps():
    """Tokens of every decode-only step at the same engine's plain ms per token of its batch
    size, against the wall it took (drafting counted; prefill and idle steps left out)."""
    from vllm_ptd.bench.trace_steps import decode_speedup

    def step(requests, wall, trees=0, nodes=0, accepted=0, drafting=0.0, rows=None):
        return {"rows": requests + nodes if rows is None else rows, "requests": requests,
                "trees": trees, "nodes": nodes, "accepted": accepted, "wall_ms": wall,
                "drafting_ms": drafting}

    steps = [step(4, 42.0, drafting=2.0),        # plain, with a try that sent no tree
             step(4, 40.0),
             step(4, 60.0, trees=2, nodes=6, accepted=3, drafting=5.0),
             step(2, 30.0),                      # plain at 2: 15 ms a token
             step(2, 33.0, trees=1, nodes=2, accepted=2),
             step(4, 300.0, rows=120),           # a prefill beside decoding: left out
             step(4, 4000.0)]                    # the engine waiting: left out
    d = decode_speedup(steps)
    assert (d["steps"], d["tokens"], d["drafting_ms"]) == (5, 4 + 4 + 7 + 2 + 4, 7.0)
    assert d["speedup"] == pytest.approx(
        (15 * 10.0 + 6 * 15.0) / (42.0 + 40.0 + 60.0 + 30.0 + 33.0))
    assert decode_speedup(steps, min_requests=3)["steps"] == 3
    assert "speedup" not in decode_speedup([step(4, 60.0, trees=1, nodes=2, accepted=1)])


def test_step_clock_records_the_accepted_nodes_and_draft_shape_of_its_step():
    from vllm_ptd.integration.step_clock import StepClock

    clock = StepClock()
    clock.start_step(rows=6, requests=2)
    clock.set_trees(1, 4)
    clock.set_accepted(3)
    clock.set_draft_shape(2, 3)
    clock.set_paused(1.5)
    first = clock.start_step(rows=2, requests=2)
    assert (first["trees"], first["nodes"], first["accepted"], first["draft_depth"],
            first["draft_branching"], first["paused_ms"]) == (1, 4, 3, 2, 3, 1.5)
    second = clock.start_step(rows=2, requests=2)
    assert second["accepted"] == 0 and second["draft_depth"] == second["draft_branching"] == 0
    assert second["paused_ms"] == 0.0


def test_step_clock_leaves_the_engine_waiting_out_of_a_step():
    """A gap after a step's last timed part as long as ``idle_gap_ms`` is the engine
    waiting: it goes to ``idle_ms``, not into the step's wall; a short gap is the step's
    host work. Readers keep such records however long the step (a prefill of several
    prompts takes over a second), and drop only old records of 1 s or more."""
    from vllm_ptd.bench.aggregate import busy_steps
    from vllm_ptd.integration.step_clock import StepClock

    clock = StepClock(idle_gap_ms=50.0)
    clock.start_step(rows=4, requests=4)
    time.sleep(0.02)
    clock.forward_done()
    with clock.part("drafting"):
        time.sleep(0.01)
    time.sleep(0.12)  # the engine waits for its next call
    waited = clock.start_step(rows=400, requests=4)
    assert waited["idle_ms"] >= 120.0
    assert 30.0 <= waited["wall_ms"] < 120.0 and waited["forward_ms"] >= 20.0
    clock.forward_done()
    time.sleep(0.01)  # host work after the forward: part of the step
    busy = clock.start_step(rows=4, requests=4)
    assert busy["idle_ms"] == 0.0 and busy["wall_ms"] >= 10.0
    assert clock.totals["wall"] == pytest.approx(waited["wall_ms"] + busy["wall_ms"])
    long_prefill = {**busy, "wall_ms": 1500.0}
    old_idle = {k: v for k, v in long_prefill.items() if k != "idle_ms"}
    assert busy_steps([long_prefill, old_idle]) == [long_prefill]


def test_trace_steps_groups_by_batch_and_trees():
    from vllm_ptd.bench.trace_steps import step_groups

    rec = lambda **k: json.dumps({"step": {"drafting_ms": 1.0, "verify_ms": 0.0, **k}})  # noqa: E731
    lines = [rec(rows=16, requests=16, trees=0, wall_ms=100.0, forward_ms=90.0),
             rec(rows=20, requests=16, trees=2, wall_ms=130.0, forward_ms=110.0, verify_ms=6.0),
             rec(rows=24, requests=16, trees=3, wall_ms=150.0, forward_ms=120.0, verify_ms=8.0,
                 accepted=5),
             rec(rows=1, requests=1, trees=0, wall_ms=50.0, forward_ms=45.0),
             rec(rows=16, requests=16, trees=0, wall_ms=4000.0, forward_ms=90.0),  # idle
             json.dumps({"req": "a", "nodes": 3})]
    g = step_groups(lines)
    assert set(g) == {(16, False), (16, True), (1, False)}
    assert g[(16, True)]["steps"] == 2 and g[(16, True)]["rows"] == 22
    assert g[(16, True)]["verify"] == 7.0 and g[(16, True)]["host"] == 140.0 - 115.0 - 1.0
    assert g[(16, True)]["drafting"] == 1.0
    assert g[(16, False)]["steps"] == 1
    assert g[(16, True)]["busy_s"] == pytest.approx(0.28) and g[(16, True)]["accepted"] == 5
    assert g[(1, False)]["busy_s"] == pytest.approx(0.05)  # the idle step is not busy time
    assert set(step_groups(lines, requests=1)) == {(1, False)}


def test_trace_tries_count_proposals_and_whether_trees_followed():
    from vllm_ptd.bench.trace_steps import drafting_tries

    step = lambda **k: json.dumps({"step": {"nodes": 0, **k}})  # noqa: E731
    lines = [step(requests=4, trees=0, drafting_ms=9.0, draft_depth=2, draft_branching=2),
             step(requests=4, trees=3, drafting_ms=0.02),  # upkeep only
             step(requests=4, trees=0, drafting_ms=11.0, draft_depth=3, draft_branching=3),
             step(requests=4, trees=0, drafting_ms=12.0, draft_depth=3, draft_branching=3),
             json.dumps({"req": "a", "nodes": 3}),
             step(requests=1, trees=0, drafting_ms=5.0),
             step(requests=1, trees=1, drafting_ms=4.0)]   # the last step: nothing follows
    t = drafting_tries(lines)
    assert set(t) == {4, 1}
    assert (t[4]["tries"], t[4]["followed_by_trees"], t[4]["median_ms"]) == (3, 1, 11.0)
    assert t[4]["total_s"] == pytest.approx(0.032) and t[4]["median_depth"] == 3
    assert t[4]["median_branching"] == 3
    assert (t[1]["tries"], t[1]["followed_by_trees"], t[1]["median_ms"]) == (1, 1, 5.0)
    # records without the fields (PTD, older traces)
    assert t[1]["median_depth"] is None and t[1]["median_branching"] is None


def test_trace_request_ratios_group_trees_by_their_requests_earlier_outcomes():
    """A tree is binned by its request's ratio before it (earlier trees only, shrunk toward
    1 by the prior): a request whose first trees brought nothing sends its later ones from
    a low bin, one that brought more than expected from a high bin."""
    from vllm_ptd.bench.trace_steps import request_ratio_buckets

    req = lambda rid, exp, acc: json.dumps({"req": rid, "expected": exp, "accepted": acc})  # noqa: E731
    lines = [req("cold", 2.0, 0) for _ in range(6)] + [req("hot", 1.0, 3) for _ in range(3)]
    lines += [json.dumps({"step": {"requests": 2}}), req("x", -1.0, 0)]  # no expectation
    bins = request_ratio_buckets(lines, prior=2.0, memory=1e9)
    # cold: (0 + 2) / (2k + 2) for k = 0..5 earlier trees -> 1.0, 0.5, 0.33, 0.25, 0.2, 0.17
    assert bins[1.0]["trees"] == 2 and bins[1.0]["accepted"] == 3  # cold's first, hot's first
    assert bins[0.5]["trees"] == 1 and bins[0.25]["trees"] == 2 and bins[0.0]["trees"] == 2
    assert bins[0.0]["ratio"] == 0.0
    # hot: (3 + 2) / (1 + 2) = 1.67 and (6 + 2) / (2 + 2) = 2: capped at the top bin
    assert bins[1.5]["trees"] == 2 and bins[1.5]["ratio"] == pytest.approx(3.0)
    assert sum(b["trees"] for b in bins.values()) == 9


def test_trace_share_floors_leave_out_the_trees_expected_to_bring_least():
    """Leaving out the trees expected below a floor drops their offered nodes and the
    tokens they brought; trees without verify nodes (draft rows only) never count."""
    from vllm_ptd.bench.trace_steps import share_floors

    req = lambda exp, ver, acc: json.dumps({"req": "a", "expected": exp, "verify": ver,  # noqa: E731
                                            "accepted": acc})
    lines = [req(0.2, 4, 0), req(0.4, 4, 1), req(2.0, 4, 3), req(0.0, 0, 0),
             json.dumps({"step": {"requests": 1}})]
    rows = share_floors(lines, [0.3, 1.0, 5.0])
    assert [r["floor"] for r in rows] == [0.0, 0.3, 1.0, 5.0]
    assert (rows[0]["trees_left_out"], rows[0]["accepted_lost"], rows[0]["share"]) == (0, 0, 4 / 12)
    assert (rows[1]["trees_left_out"], rows[1]["accepted_lost"], rows[1]["share"]) == (1, 0, 4 / 8)
    assert (rows[2]["trees_left_out"], rows[2]["accepted_lost"], rows[2]["share"]) == (2, 1, 3 / 4)
    assert rows[2]["accepted_lost_share"] == pytest.approx(0.25)
    assert rows[3]["share"] is None and rows[3]["accepted_lost"] == 4


def test_trace_outcomes_set_the_budget_against_what_its_tree_steps_did():
    from vllm_ptd.bench.trace_steps import budget_outcomes

    step = lambda **k: json.dumps({"step": {"drafting_ms": 1.0, "nodes": 0, **k}})  # noqa: E731
    req = lambda **k: json.dumps({"req": "a", **k})  # noqa: E731
    lines = [step(rows=4, requests=4, trees=0, wall_ms=41.0, predicted_ms=0.0),
             step(rows=4, requests=4, trees=0, wall_ms=61.0, predicted_ms=0.0),
             req(verify=3, accepted=2, expected=1.5), req(verify=2, accepted=0, expected=0.5),
             step(rows=9, requests=4, trees=2, nodes=5, wall_ms=61.0, predicted_ms=55.0),
             req(verify=4, accepted=4, expected=3.0),   # a prefill beside the tree: left out
             step(rows=50, requests=4, trees=1, nodes=4, wall_ms=300.0, predicted_ms=60.0),
             req(verify=2, accepted=2, expected=1.0),   # no plain step of 2 to compare: out
             step(rows=4, requests=2, trees=1, nodes=2, wall_ms=50.0, predicted_ms=45.0)]
    o = budget_outcomes(lines)
    assert (o["steps"], o["offered"], o["accepted"]) == (1, 5, 2)
    assert (o["predicted_ms"], o["taken_ms"], o["expected"]) == (55.0, 60.0, 2.0)
    assert o["speedup"]["realized"] == pytest.approx((4 + 2) / 60.0 / (4 / 50.0))
    assert o["speedup"]["predicted"] == pytest.approx((4 + 2) / 55.0 / (4 / 50.0))
    assert budget_outcomes(lines, min_requests=5)["steps"] == 0
    # decode-only steps of size 4, drafting counted: 4 + 4 + 6 tokens at 50/4 ms each,
    # against 41 + 61 + 61 ms taken (the size-2 step has no plain step to compare)
    d = o["decode"]
    assert (d["steps"], d["tokens"], d["drafting_ms"]) == (3, 14, 3.0)
    assert d["speedup"] == pytest.approx(14 * 50.0 / 4 / (41.0 + 61.0 + 61.0))
    # the yardstick: the mean plain decode step (wall less drafting) per batch size
    assert o["plain_step_ms"] == {4: 50.0}


def test_trace_realized_gain_sets_what_drafting_saved_against_what_it_cost():
    """Per batch size bucket: accepted tokens at the plain step's ms per token, against the
    drafting of steps that ran a proposal (less its rows a pause held, as the budget counts
    it) and each tree step's time beyond a plain step."""
    from vllm_ptd.bench.trace_steps import realized_gain

    step = lambda **k: json.dumps({"step": {"drafting_ms": 0.0, "budget_ms": 0.0, "nodes": 0,  # noqa: E731
                                            "trees": 0, "accepted": 0, **k}})
    lines = [step(rows=4, requests=4, wall_ms=40.0),
             step(rows=4, requests=4, wall_ms=49.0, drafting_ms=9.0, budget_ms=0.2,
                  paused_ms=3.0),  # a try after a pause
             step(rows=10, requests=4, trees=2, nodes=6, accepted=4, wall_ms=52.0),
             step(rows=4, requests=4, wall_ms=40.5, drafting_ms=0.5),  # observe only: no cost
             step(rows=1, requests=1, wall_ms=30.0),
             step(rows=4, requests=1, trees=1, nodes=3, accepted=3, wall_ms=31.0,
                  drafting_ms=2.0, budget_ms=0.1),
             step(rows=90, requests=4, trees=1, nodes=3, accepted=3, wall_ms=200.0)]  # prefill
    g = realized_gain(lines)
    assert set(g) == {0, 2}  # batch sizes 1 and 4-7
    assert g[2]["tree_steps"] == 1
    assert g[2]["saved_ms"] == pytest.approx(4 * 40.0 / 4)
    assert g[2]["cost_ms"] == pytest.approx(6.0 + (52.0 - 40.0))
    assert g[2]["gain"] == pytest.approx(40.0 / 18.0)
    assert g[0]["saved_ms"] == pytest.approx(3 * 30.0) and g[0]["cost_ms"] == pytest.approx(2.0 + 29.0 - 30.0)


def test_warmup_runs_held_out_prompts_and_records_nothing():
    """The warm-up runs real prompts that no measured batch holds (one batch per size and
    dataset); a dataset without spare prompts falls back to its first batch reversed."""
    from vllm_ptd.bench.interleave import run_interleaved
    from vllm_ptd.bench.prompts import load_held_out_prompts, load_token_prompts

    class FakeEngine:
        def __init__(self, label):
            self.label, self.seen = label, []

        def generate(self, batch, max_tokens):
            self.seen.append(([list(b) for b in batch], max_tokens))
            return {"wall": 0.0, "outputs": [[1]] * len(batch), "counters": None, "trace": []}

    prompts = {"a": [{"id": i, "ids": [i, i + 1]} for i in range(3)],
               "b": [{"id": 9, "ids": [7, 8, 9], "max_tokens": 20}]}  # its own limit
    spare = {"a": [{"id": 5, "ids": [50, 51]}], "b": []}
    eng = [FakeEngine("none"), FakeEngine("ptd")]
    recs = run_interleaved(eng, prompts, [1, 2], 1, 64, 0.0, True, progress=False,
                           warmup_prompts=spare)
    measured = [[p["ids"] for p in v] for v in prompts.values()]
    measured = [ids for group in measured for ids in group]
    for e in eng:
        warm = e.seen[:4]  # (size 1, a), (size 2, a), (size 1, b), (size 2, b)
        # limits per prompt: 32 in the warm-up (b's own 20 below that), then 64 and b's 20
        assert [m for _, m in warm] == [[32], [32, 32], [20], [20]] and e.seen[4][1] == [64]
        assert [m for b, m in e.seen[4:] if b == [[7, 8, 9]]] == [[20], [20]]
        batches = [b for b, _ in warm]
        assert batches[0] == [[50, 51]] and batches[1] == [[50, 51], [50, 51]]
        assert batches[2] == batches[3] == [[9, 8, 7]]  # b has no spare prompt
        assert not any(ids in measured for b in batches for ids in b)
    assert len(recs) == 2 * (3 + 1 + 2 + 1)  # the warm-up is not recorded

    # the held-out prompts of a real dataset come after the measured ones
    model = str(Path.home() / ".cache/vllm_ptd/smollm2-135m-instruct-bf16")
    if not Path(model).is_dir():
        pytest.skip("the embedded model's tokenizer is not built")
    got = load_token_prompts(model, ["mt_bench"], 3, None, 4096)
    held = load_held_out_prompts(model, ["mt_bench"], 3, 2, None, 4096)
    both = load_token_prompts(model, ["mt_bench"], 5, None, 4096)
    assert [p["id"] for p in both["mt_bench"]] == [p["id"] for p in
                                                   got["mt_bench"] + held["mt_bench"]]


def test_a_prompts_own_token_limit_is_fixed_and_in_range():
    from vllm_ptd.bench.prompts import token_limit

    assert token_limit("gsm8k", 3, None, 64) == 64  # no spread: the one limit
    limits = [token_limit("gsm8k", i, 16, 64) for i in range(200)]
    assert limits == [token_limit("gsm8k", i, 16, 64) for i in range(200)]  # fixed per prompt
    assert min(limits) >= 16 and max(limits) <= 64 and len(set(limits)) > 30
    assert [token_limit("mbpp", i, 16, 64) for i in range(200)] != limits  # dataset in the key


def test_a_token_limit_beyond_max_tokens_is_refused_naming_both(capsys):
    from vllm_ptd.bench.cli import main as bench_main
    from vllm_ptd.bench.serving import main as serving_main

    for main in (bench_main, serving_main):
        with pytest.raises(SystemExit) as e:
            main(["--methods", "none", "--num-prompts", "1", "--max-tokens", "32",
                  "--min-tokens-limit", "48", "--dtype", "float32"])
        assert "--min-tokens-limit 48" in str(e.value) and "(32)" in str(e.value)


def test_continuous_batching_sends_each_dataset_in_one_call():
    """--batching continuous: one call per dataset and repeat with all its prompts (the
    engine's max_num_seqs keeps the batch size), warmed up on one batch's worth of held-out
    prompts; several batch sizes are refused with the flag named."""
    from vllm_ptd.bench.aggregate import aggregate
    from vllm_ptd.bench.cli import main
    from vllm_ptd.bench.interleave import run_interleaved

    class FakeEngine:
        def __init__(self, label):
            self.label, self.seen = label, []

        def generate(self, batch, max_tokens):
            self.seen.append(([list(b) for b in batch], max_tokens))
            return {"wall": 1.0, "outputs": [[1]] * len(batch), "counters": {}, "trace": []}

    prompts = {"a": [{"id": i, "ids": [i]} for i in range(5)],
               "b": [{"id": 9, "ids": [9, 9]}]}
    spare = {"a": [{"id": 7, "ids": [70]}, {"id": 8, "ids": [80]}], "b": []}
    eng = [FakeEngine("none"), FakeEngine("ptd")]
    recs = run_interleaved(eng, prompts, [2], 2, 16, 0.0, True, progress=False,
                           warmup_prompts=spare, continuous=True)
    for e in eng:
        assert [b for b, _ in e.seen[:2]] == [[[70], [80]], [[9, 9]]]  # warm-up: 2 and 1
        assert [len(b) for b, _ in e.seen[2:]] == [5, 1, 5, 1]  # whole datasets, 2 repeats
    assert len(recs) == 2 * 2 * 2 and {r["chunk"] for r in recs} == {0}
    assert {tuple(r["prompt_index"]) for r in recs if r["dataset"] == "a"} == {(0, 1, 2, 3, 4)}
    # one batch per dataset and repeat completes a repeat (closed batches would expect 3 for a)
    rows = aggregate(recs, ["none", "ptd"], prompts, [2], 2, continuous=True)["rows"]
    ptd_all = next(x for x in rows if x["method"] == "ptd" and x["dataset"] == "all")
    assert ptd_all["speedup"]["mean"] == pytest.approx(1.0) and ptd_all["identical"] == 12
    assert aggregate(recs, ["none", "ptd"], prompts, [2], 2)["rows"][0]["tok_s"]["n"] == 0
    with pytest.raises(SystemExit):
        main(["--batching", "continuous", "--batch-sizes", "4,16", "--methods", "none",
              "--num-prompts", "1"])


def test_upkeep_times_phases_and_checks_outputs_against_plain():
    from vllm_ptd.bench.upkeep import _reference, add_timer, report, summarize

    class Core:
        def step(self, x):
            time.sleep(0.01)
            return x + 1

    core, totals = Core(), {}
    add_timer(core, "step", "execute", totals)
    assert core.step(1) == 2 and core.step(2) == 3
    assert 0.02 <= totals["execute"] < 1.0
    # two batches per dataset: each is checked against the same batch of plain decoding
    plain = [{"round": n, "dataset": "a", "chunk": c, "wall": 1.0 + 2 * n,
              "outputs": [[1, 2], [3]] if c == 0 else [[5], [6, 7]]}
             for n in (0, 1) for c in (0, 2)]
    ref = _reference(plain)
    assert ref == {("a", 0): [[1, 2], [3]], ("a", 2): [[5], [6, 7]]}
    tree = [{"round": 0, "dataset": "a", "chunk": 0, "wall": 1.0, "propose_draft_token_ids": 0.5,
             "outputs": [[1, 2], [4]]},
            {"round": 0, "dataset": "a", "chunk": 2, "wall": 2.0, "outputs": [[5], [6, 7]]},
            {"round": 1, "dataset": "a", "chunk": 0, "wall": 2.0, "propose_draft_token_ids": 0.1,
             "outputs": [[1, 2], [3]]},
            {"round": 1, "dataset": "a", "chunk": 2, "wall": 3.0, "outputs": [[5], [6, 7]]}]
    s = summarize(tree, ref)
    assert s["wall"] == {"mean": 4.0, "min": 3.0, "max": 5.0}
    assert s["propose_draft_token_ids"]["mean"] == pytest.approx(0.3)
    assert (s["identical"], s["compared"]) == (7, 8)
    table = report([("none", summarize(plain, None)), ("ptd", s)])
    assert "| 1 | none | 4.00 (2.00-6.00) |" in table and "| 7/8 |" in table


def test_engine_env_puts_its_defaults_under_values_already_set():
    from vllm_ptd.bench.engines import ENGINE_ENV, engine_env

    env = engine_env({"THP_MEM_ALLOC_ENABLE": "0", "OTHER": "x"})
    assert env["THP_MEM_ALLOC_ENABLE"] == "0" and env["OTHER"] == "x"
    assert env["VLLM_USE_AOT_COMPILE"] == ENGINE_ENV["VLLM_USE_AOT_COMPILE"] == "0"
    assert engine_env({})["THP_MEM_ALLOC_ENABLE"] == "1"


def test_upkeep_times_the_garbage_collector_and_counts_full_collections():
    import gc

    from vllm_ptd.bench.upkeep import add_gc_timer, report, summarize

    totals: dict = {}
    before, enabled = list(gc.callbacks), gc.isenabled()
    gc.disable()  # only the collections below
    try:
        add_gc_timer(totals)
        cycles = [[] for _ in range(20000)]
        for c in cycles:
            c.append(c)  # reference cycles: only the cyclic collector frees them
        del cycles
        gc.collect(0)
        gc.collect()
    finally:
        gc.callbacks[:] = before
        if enabled:
            gc.enable()
    assert totals["gc_full"] == 1 and totals["gc"] > 0
    rec = {"round": 0, "dataset": "a", "chunk": 0, "wall": 1.0, "outputs": [], **totals}
    table = report([("ptd", summarize([rec], None))])
    assert f"| {totals['gc']:.2f} ({totals['gc']:.2f}-{totals['gc']:.2f}) (1) |" in table


def test_paired_steps_are_timed_and_sorted_by_kind():
    from types import SimpleNamespace

    from vllm_ptd.bench.paired import StepTimer, report, step_kind, summarize_steps

    assert step_kind(4, 4, 0) == "decode"
    assert step_kind(4, 12, 8) == "decode+tree"
    assert step_kind(4, 300, 0) == "prefill"
    assert step_kind(4, 308, 8) == "prefill+tree"

    from concurrent.futures import Future

    class Executor:  # vLLM's split: execute_model returns None, sample_tokens the output
        def execute_model(self, so, non_block=False):
            time.sleep(0.01)
            out = None if so.total_num_scheduled_tokens > 4 else "out"
            if non_block:  # the engine core's call: a done future
                fut = Future()
                fut.set_result(out)
                return fut
            return out

        def sample_tokens(self, grammar):
            return "sampled"

    ex = Executor()
    timer = StepTimer(ex)
    tree = SimpleNamespace(scheduled_spec_decode_tokens={"a": [1, 2], "b": []},
                           num_scheduled_tokens={"a": 3, "b": 1}, total_num_scheduled_tokens=4)
    plain = SimpleNamespace(scheduled_spec_decode_tokens={}, num_scheduled_tokens={"a": 200},
                            total_num_scheduled_tokens=200)
    assert ex.execute_model(tree) == "out"  # the step's output straight from execute_model
    assert ex.execute_model(plain, non_block=True).result() is None
    assert ex.sample_tokens(None) == "sampled"
    assert ex.sample_tokens(None) == "sampled"  # no open step: nothing recorded
    assert [(k, r) for k, r, _ in timer.steps] == [("decode+tree", 4), ("prefill", 200)]
    assert all(0.01 <= s < 1.0 for _, _, s in timer.steps)
    kinds = summarize_steps(timer.steps)
    assert kinds["decode+tree"]["steps"] == 1 and kinds["prefill"]["rows"] == 200
    assert kinds["decode"] == {"steps": 0, "seconds": 0.0, "rows": 0}
    host = {"none": {"schedule": 0.5}, "ptd": {"schedule": 0.25, "process_outputs": 1.0}}
    text = report(["none", "ptd"], {"none": [2.0, 4.0], "ptd": [1.0, 4.0]},
                  {"none": kinds, "ptd": kinds}, {"ptd": (7, 8)}, host, rounds=2)
    # per batch 0.5 and 1.0 (median 0.75); two rounds of one batch: 0.5 and 1.0
    assert "| ptd | 5.00 | 0.750 | 0.750 ± 0.354 | 7/8 |" in text
    assert "| none | 6.00 | 1.000 | 1.000 ± 0.000 | ref |" in text
    assert "| ptd | prefill | 1 |" in text and "| ptd | decode |" not in text
    steps = sum(s for _, _, s in timer.steps)
    # host phases, and the rest of the wall time: 5 s less the steps and 1.25 s of phases
    assert f"| ptd | {steps:.2f} | 0.25 | 0.00 | 0.00 | 1.00 | {5 - steps - 1.25:.2f} |" in text


def test_paired_report_reads_engines_against_the_plain_engines_mean():
    """With two or more plain engines (``none``, ``none@2``) the paired report gives every
    engine's speed per round against their mean wall; with one, it does not."""
    from vllm_ptd.bench.paired import report, speed_against_plain_mean

    labels = ["none", "ptd", "none@2"]
    # two rounds of two batches: plain rounds 4 and 6 (mean 5) and 6 and 10 (mean 8)
    walls = {"none": [2.0, 2.0, 3.0, 3.0], "ptd": [2.0, 3.0, 4.0, 4.0],
             "none@2": [3.0, 3.0, 5.0, 5.0]}
    speeds = speed_against_plain_mean(labels, walls, rounds=2)
    assert speeds["ptd"] == pytest.approx([1.0, 1.0])
    assert speeds["none"] == pytest.approx([5 / 4, 8 / 6])
    assert speeds["none@2"] == pytest.approx([5 / 6, 8 / 10])
    assert speed_against_plain_mean(["none", "ptd"], walls, rounds=2) is None
    kinds = {lab: {} for lab in labels}
    text = report(labels, walls, kinds, {}, {lab: {} for lab in labels}, rounds=2)
    assert "| ptd | 1.000 ± 0.000 |" in text
    assert "| none@2 | 0.817 ± 0.024 |" in text
    assert "against the plain engines' mean" not in report(
        ["none", "ptd"], walls, kinds, {}, {lab: {} for lab in labels}, rounds=2)


def test_paired_bf16_divergences_are_explained_by_plain_decodings_top2_gaps():
    """In bf16 the paired benchmark reads plain decoding's top-2 gap at each output's first
    divergence from a rerun of that batch, once per batch; a rerun that does not reproduce
    the timed plain output leaves the divergence unknown; the report counts near-ties."""
    from vllm_ptd.bench.near_ties import TIE_GAP
    from vllm_ptd.bench.paired import divergence_gaps, identical_cell, report

    # two batches of two prompts, two rounds: calls 0, 1 (round 1) and 2, 3 (round 2)
    plain = [[[1, 2, 3], [4, 5]], [[6, 7], [8, 9]], [[1, 2, 3], [4, 5]], [[6, 7], [8, 9]]]
    tree = [[[1, 2, 30], [4, 5]], [[60, 7], [8, 9]], [[1, 2, 30], [4, 5]], [[6, 7], [8, 9]]]
    reruns = {0: ([[1, 2, 3], [4, 5]], [[1.0, 2.0, TIE_GAP / 2], [1.0, 1.0]]),
              1: ([[6, 70], [8, 9]], [[3.0, 3.0], [1.0, 1.0]])}  # not reproduced
    asked = []

    def rerun(call):
        asked.append(call)
        return reruns[call % 2]

    gaps = divergence_gaps(plain, tree, rerun)
    assert gaps == [TIE_GAP / 2, None, TIE_GAP / 2]
    assert asked == [0, 1, 2]  # only calls with a divergence
    assert divergence_gaps(plain, plain, rerun) == []
    assert identical_cell(5, 8, gaps) == "5/8 (2/2 at near-ties; 1 unknown)"
    assert identical_cell(3, 4, [TIE_GAP * 4]) == "3/4 (0/1 at near-ties)"
    assert identical_cell(8, 8, []) == identical_cell(8, 8, None) == "8/8"
    kinds = {"none": {}, "ptd": {}}
    text = report(["none", "ptd"], {"none": [1.0], "ptd": [1.0]}, kinds, {"ptd": (5, 8)},
                  {"none": {}, "ptd": {}}, gaps={"ptd": gaps})
    assert "| 5/8 (2/2 at near-ties; 1 unknown) |" in text


def test_bf16_divergences_are_explained_by_plain_decodings_top2_gaps():
    """A run in bf16 reruns, untimed and once, each plain batch in which a method's output
    parted from plain decoding's, with logprobs, and reads plain decoding's top-2 gap at the
    first divergence: the report says how many divergences were near-ties. A rerun that does
    not reproduce the timed plain output leaves its divergence unknown, counted apart; fp32
    runs explain nothing."""
    from vllm_ptd.bench.aggregate import aggregate
    from vllm_ptd.bench.interleave import run_interleaved
    from vllm_ptd.bench.near_ties import TIE_GAP, explain_run, first_divergence
    from vllm_ptd.bench.report import identical_cell

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2

    plain_out = {0: [1, 2, 3], 1: [4, 5, 6], 2: [7, 8, 9], 3: [10, 11]}
    ptd_out = {0: [1, 2, 30], 1: [40, 5, 6], 2: [7, 8, 9], 3: [10, 12]}
    gaps = {0: [4.0, 3.0, TIE_GAP / 2], 1: [2.0, 1.0, 1.0], 2: [1.0] * 3, 3: [1.0, 0.1]}

    class FakeEngine:
        def __init__(self, label, outputs, reruns_differ=()):
            self.label, self.outputs, self.error, self.calls = label, outputs, None, []
            self.reruns_differ = reruns_differ

        def generate(self, batch, max_tokens, logprobs=None):
            self.calls.append((len(batch), max_tokens, logprobs))
            ids = [b[0] for b in batch]
            out = {"wall": 1.0, "outputs": [list(self.outputs[i]) for i in ids],
                   "counters": {}, "trace": []}
            if logprobs:
                out["top2_gaps"] = [gaps[i] for i in ids]
                for j, i in enumerate(ids):
                    if i in self.reruns_differ:
                        out["outputs"][j] = [0]
            return out

    prompts = {"a": [{"id": i, "ids": [i], "max_tokens": 3} for i in range(4)]}
    for dtype, explained in (("float32", False), ("bfloat16", True)):
        plain, ptd = FakeEngine("none", plain_out, reruns_differ=(3,)), FakeEngine("ptd", ptd_out)
        recs = run_interleaved([plain, ptd], prompts, [2], 1, 16, 0.0, False, progress=False)
        said = []
        explain_run([plain, ptd], recs, prompts, dtype, said.append)
        reruns = [c for c in plain.calls if c[2]]
        row = next(x for x in aggregate(recs, ["none", "ptd"], prompts, [2], 1)["rows"]
                   if x["method"] == "ptd")
        if not explained:
            assert not reruns and not said and identical_cell(row) == "1/4"
            continue
        # both batches (prompts 0-1 and 2-3) had a divergence: rerun once each, same limits
        assert reruns == [(2, [3, 3], 2), (2, [3, 3], 2)]
        # prompt 0 parts at a near-tie, prompt 1 where plain decoding was sure, prompt 3's
        # plain rerun did not reproduce its output
        assert (row["near_ties"], row["explained"], row["unexplained"]) == (1, 2, 1)
        assert identical_cell(row) == "1/4 (1/2 at near-ties; 1 unknown)"
        assert "3 outputs part from plain decoding; at 1 of the 2 " in said[0]
