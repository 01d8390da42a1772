"""PTD inside vLLM (issue 3): lossless greedy output, vLLM's spec-decode counters, per-step
agreement with the reference engine, seeded and parallel sampling, aborts, the context end,
config errors, preemption, second turns read from the prefix cache, stop token ids and
strings, and a structured-output request beside requests with trees.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the tests can reach
the runner's ``TreeProposer``. Three engines start, one at a time: plain decoding (every
baseline of the file in one batched call), PTD with max_model_len 1024, and PTD with
max_model_len 192 and a KV cache of three blocks. Everything is fp32 + eager on both sides:
token identity in bf16 flips at near-ties.
"""
from __future__ import annotations

import math

import pytest
from engine_utils import check_two_turns
from engine_utils import counters as _counters
from engine_utils import flush as _flush
from engine_utils import in_process_engines
from engine_utils import proposer as _proposer
from engine_utils import shutdown as _shutdown
from engine_utils import two_turns

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

MODEL_ARGS = dict(dtype="float32", enforce_eager=True, seed=0)
# The main engine's PTD runs its trees as made (no cost model, whose timing-driven sizes could
# not be replayed by the reference engine) and without the history of earlier requests
# (which holds the texts of every earlier test, not replayed either, and makes a seeded
# sampled output depend on what ran before: README, PTD keys); the small engine runs
# the defaults, budget "auto" and the history, as do the compiled, bf16 and TP engines.
FIXED_PTD = {"method": "ptd", "budget": "fixed", "max_verify_nodes": 6, "max_draft_nodes": 2,
             "history_tokens": 0}
# mixed prompt sets, 4 each, chat template applied
SETS = ("mt_bench", "gsm8k", "humaneval", "mbpp")
SAMPLING_PROMPTS = 3
SAMPLE_TOKENS = 20
REF_PROMPTS = 2       # batch-1 comparison with the reference engine
REF_TOKENS = 32
CONTEXT_LEN = 192     # the small engine's max_model_len
SMALL_BLOCK_SIZE = 32
SMALL_BLOCKS = 7      # 224 tokens: vLLM wants max_model_len + 24 lookahead slots; 3 requests
                      # of ~90 tokens + their trees need 12 blocks
PREEMPT_PROMPTS = 3
PREEMPT_TOKENS = 32


@pytest.fixture(scope="module")
def engine_env(tmp_path_factory):
    with in_process_engines(tmp_path_factory.mktemp("ptd_trace") / "trace.jsonl") as trace:
        yield trace


# ---------------------------------------------------------------------------- workloads
@pytest.fixture(scope="module")
def work(tokenizer):
    """Every prompt of the file as token ids, with its max_tokens."""
    from vllm_ptd.datasets import chat_prompt_ids, load_prompts

    mixed = []
    for name in SETS:
        mixed += [chat_prompt_ids(tokenizer, p.text) for p in load_prompts(name, 4)]
    # interleave the sets so neighbours differ in length; max_tokens 16..46
    mixed = [mixed[(i % 4) * 4 + i // 4] for i in range(16)]
    mixed_max = [16 + 2 * i for i in range(16)]
    code = [chat_prompt_ids(tokenizer, p.text) for p in load_prompts("humaneval", 8)[4:]]
    # ~180 tokens: a long prompt cut to 180 (token identity needs no well-formed text)
    long_text = " ".join(p.text for p in load_prompts("gsm8k", 4))
    near_end = chat_prompt_ids(tokenizer, long_text)[:180]
    assert len(near_end) == 180
    preempt = [chat_prompt_ids(tokenizer, p.text)
               for p in load_prompts("mbpp", 4 + PREEMPT_PROMPTS)[4:]]
    assert all(len(p) + PREEMPT_TOKENS < CONTEXT_LEN for p in preempt)
    # two-turn conversations (engine_utils.two_turns) on prompts no other test sends
    turns = [chat_prompt_ids(tokenizer, load_prompts(name, i + 1)[i].text)
             for name, i in (("mt_bench", 4), ("gsm8k", 4), ("mbpp", 4 + PREEMPT_PROMPTS))]
    return dict(mixed=mixed, mixed_max=mixed_max, code=code, near_end=near_end,
                preempt=preempt, turns=turns)


def _plain_jobs(work):
    """(key, prompt ids, max_tokens) of every greedy baseline."""
    jobs = [(("mixed", i), p, n) for i, (p, n) in enumerate(zip(work["mixed"], work["mixed_max"]))]
    jobs += [(("abort", i), p, 48) for i, p in enumerate(work["code"][:2])]
    # plain decoding at max_model_len 192 stops when prompt + output reach it
    jobs.append((("near_end", 0), work["near_end"], CONTEXT_LEN - len(work["near_end"])))
    jobs += [(("preempt", i), p, PREEMPT_TOKENS) for i, p in enumerate(work["preempt"])]
    jobs += [(("next", 0), work["code"][0], 8)]
    return jobs


def _generate_traced(llm, engine_env, prompts, params):
    """The outputs of one ``generate`` and the trace records (requests with a tree) it
    left; the engine is flushed after it."""
    from vllm.inputs import TokensPrompt

    engine_env.mark()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    trace = engine_env.since_mark()
    _flush(llm)
    return outs, trace


def _stopped_requests(llm, work, plain_outputs) -> list[tuple]:
    """Requests that end on a stop token id or a stop string found in the middle of their
    plain-decoding output (a tree step may commit past them: vLLM must cut the output
    there);
    per request: token ids, text, finish and stop reason."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    by_token, by_text = plain_outputs[("mixed", 0)], plain_outputs[("mixed", 5)]
    stop_text = llm.get_tokenizer().decode(by_text[10:12]).strip()
    assert stop_text, by_text[10:12]
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in (work["mixed"][0], work["mixed"][5])],
        [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[by_token[12]]),
         SamplingParams(temperature=0, max_tokens=40, stop=[stop_text])], use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason,
             o.outputs[0].stop_reason) for o in outs]


JSON_SCHEMA = {"type": "object", "required": ["name", "age"],
               "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


def _structured_batch(llm, tokenizer, work) -> list[list[int]]:
    """One request held to a JSON schema (vLLM's structured outputs: it decodes without a
    tree, its logits masked by the grammar) in a batch with two requests that send trees."""
    import json

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_ptd.datasets import chat_prompt_ids

    asked = chat_prompt_ids(tokenizer, "Give a JSON object with a name and an age for a "
                                       "fictional person.")
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in (asked, work["mixed"][1], work["mixed"][2])],
        [SamplingParams(temperature=0, max_tokens=48,
                        structured_outputs=StructuredOutputsParams(json=JSON_SCHEMA))]
        + [SamplingParams(temperature=0, max_tokens=32)] * 2, use_tqdm=False)
    assert set(json.loads(outs[0].outputs[0].text)) == {"name", "age"}, outs[0].outputs[0].text
    return [list(o.outputs[0].token_ids) for o in outs]


def _edited_params(banned_word: str):
    # (vLLM refuses logit_bias and min_p with speculative decoding)
    from vllm import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=24, bad_words=[banned_word]),
            SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3)]


def _seeded_params():
    from vllm import SamplingParams

    return [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=SAMPLE_TOKENS)
            for i in range(SAMPLING_PROMPTS)]


@pytest.fixture(scope="module")
def plain(engine_env, model_path, tokenizer, work):
    """Greedy plain-decoding outputs of every baseline, from one engine (then shut down)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model_path, max_model_len=1024, **MODEL_ARGS)
    try:
        jobs = _plain_jobs(work)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for _, p, _ in jobs],
                            [SamplingParams(temperature=0, max_tokens=n) for _, _, n in jobs],
                            use_tqdm=False)
        got = {key: list(o.outputs[0].token_ids) for (key, _, _), o in zip(jobs, outs)}
        # a request asking for logprobs: its tokens and top-2 logprobs per output token
        lp = llm.generate([TokensPrompt(prompt_token_ids=work["code"][2])],
                          SamplingParams(temperature=0, max_tokens=32, logprobs=2),
                          use_tqdm=False)[0].outputs[0]
        got[("logprobs", 0)] = (list(lp.token_ids), lp.logprobs)
        # requests whose logits vLLM's sampler edits: the first word greedy picks made a
        # bad word, and a repetition penalty
        got["banned"] = llm.get_tokenizer().decode([lp.token_ids[0]])
        edited = llm.generate([TokensPrompt(prompt_token_ids=work["code"][2])] * 2,
                              _edited_params(got["banned"]), use_tqdm=False)
        got[("bad_word", 0)], got[("penalty", 0)] = [list(o.outputs[0].token_ids)
                                                     for o in edited]
        got["turns"] = two_turns(llm, work["turns"])
        got["seeded"] = [list(o.outputs[0].token_ids) for o in llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in work["code"][:SAMPLING_PROMPTS]],
            _seeded_params(), use_tqdm=False)]
        got["stopped"] = _stopped_requests(llm, work, got)
        got["structured"] = _structured_batch(llm, tokenizer, work)
        return got
    finally:
        _shutdown(llm)


# ---------------------------------------------------------------------------- invalid config
@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec,key", [
    ({"method": "ptd", "tree_widht": 4}, "tree_widht"),
    ({"method": "ptd", "width": 0}, "width"),
    ({"method": "ptd", "max_verify_nodes": -1}, "max_verify_nodes"),
    ({"method": "ptd", "num_speculative_tokens": 3}, "num_speculative_tokens"),
    ({"method": "ptd", "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "pctree", "mode": "chain", "branching": 8}, "branching"),
])
def test_invalid_config_names_the_key(engine_env, model_path, spec, key):
    from vllm import LLM

    with pytest.raises(Exception) as info:
        LLM(model_path, max_model_len=256, speculative_config=spec, **MODEL_ARGS)
    assert repr(key) in str(info.value), str(info.value)


def test_tree_budget_larger_than_the_context_is_refused(engine_env, model_path):
    from vllm import LLM

    spec = {"method": "ptd", "max_verify_nodes": 512, "max_draft_nodes": 512}
    with pytest.raises(ValueError, match=r"1024 nodes .*max_model_len 512"):
        LLM(model_path, max_model_len=512, speculative_config=spec, **MODEL_ARGS)


# ---------------------------------------------------------------------------- PTD, 1024
@pytest.fixture(scope="class")
def ptd_llm(engine_env, plain, model_path):
    from vllm import LLM

    llm = LLM(model_path, max_model_len=1024, speculative_config=FIXED_PTD,
              disable_log_stats=False, per_request_spec_decode_metrics="summary",
              **MODEL_ARGS)
    yield llm
    _shutdown(llm)


@pytest.fixture(scope="class")
def ptd_batch_run(ptd_llm, engine_env, work):
    """The 16 mixed prompts sent together, greedy, max_tokens 16..46."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = ptd_llm
    before = _counters(llm)
    engine_env.mark()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in work["mixed"]],
                        [SamplingParams(temperature=0, max_tokens=n) for n in work["mixed_max"]],
                        use_tqdm=False)
    after = _counters(llm)
    trace = engine_env.since_mark()
    _flush(llm)
    return outs, before, after, trace


class TestPTD:
    @pytest.fixture
    def llm(self, ptd_llm):
        return ptd_llm

    @pytest.fixture
    def batch_run(self, ptd_batch_run):
        return ptd_batch_run

    def test_greedy_batch_equals_plain(self, llm, batch_run, plain, work):
        outs, *_ , trace = batch_run
        got = [list(o.outputs[0].token_ids) for o in outs]
        for i, g in enumerate(got):
            assert g == plain[("mixed", i)], f"prompt {i}: PTD output differs from plain decoding"
            assert len(g) == work["mixed_max"][i] or g[-1] in _proposer(llm).method.eos_token_ids
        assert trace and sum(t["accepted"] for t in trace) > 0, "no tree token was ever accepted"
        assert _proposer(llm).num_tracked() == 0

    def test_stops_equal_plain(self, llm, plain, work):
        """Stop token ids and stop strings met inside an accepted path cut the output where
        plain decoding's ends."""
        want = plain["stopped"]
        assert [w[2] for w in want] == ["stop", "stop"], want
        assert _stopped_requests(llm, work, plain) == want
        _flush(llm)
        assert _proposer(llm).num_tracked() == 0

    def test_structured_output_beside_trees_equals_plain(self, llm, plain, tokenizer, work):
        assert _structured_batch(llm, tokenizer, work) == plain["structured"]
        _flush(llm)
        assert _proposer(llm).num_tracked() == 0

    def test_parallel_sampling(self, llm, engine_env, work):
        """n=2 (vLLM's parallel sampling: two child requests of one prompt): unseeded, both
        children walk trees; seeded, they get none and a second run repeats them; no state
        is left behind either way."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompt = [TokensPrompt(prompt_token_ids=work["code"][1])]
        runs = []
        for seed in (None, 7, 7):
            params = SamplingParams(temperature=0.8, top_p=0.9, seed=seed, n=2,
                                    max_tokens=SAMPLE_TOKENS)
            engine_env.mark()
            out = llm.generate(prompt, params, use_tqdm=False)[0]
            walked = [t for t in engine_env.since_mark() if t["verify"] > 0]
            _flush(llm)
            runs.append([list(c.token_ids) for c in out.outputs])
            assert len(runs[-1]) == 2 and all(len(t) == SAMPLE_TOKENS for t in runs[-1])
            if seed is None:
                assert walked, "no candidate tree was verified while sampling"
            else:
                assert not walked, "a seeded sampled request got a tree"
        assert runs[1] == runs[2], "seeded parallel sampling with PTD is not reproducible"
        assert _proposer(llm).num_tracked() == 0

    def test_second_turn_on_cached_blocks_equals_plain(self, llm, plain, work):
        """A second turn reads the first from vLLM's prefix cache, including blocks that
        hold first-turn answer tokens whose K/V came from PTD's tree-row moves."""
        got = two_turns(llm, work["turns"])
        check_two_turns(got, plain["turns"], work["turns"], prefix_cache=True)
        _flush(llm)
        assert _proposer(llm).num_tracked() == 0

    def test_vllm_spec_decode_counters_match_trace(self, batch_run):
        outs, before, after, trace = batch_run

        def delta(name):
            return after.get(name, 0) - before.get(name, 0)

        # vLLM counts the candidate (verify) nodes offered, not the draft-tree rows
        assert delta("vllm:spec_decode_num_drafts") == sum(t["verify"] > 0 for t in trace)
        assert delta("vllm:spec_decode_num_draft_tokens") == sum(t["verify"] for t in trace)
        assert sum(t["nodes"] - t["verify"] for t in trace) > 0, "no draft row ran"
        assert delta("vllm:spec_decode_num_accepted_tokens") == sum(t["accepted"] for t in trace)
        assert delta("vllm:spec_decode_num_accepted_tokens") > 0
        # and so does each request's own record (the response's metrics.speculative_decoding)
        records = [o.outputs[0].spec_decode_metrics for o in outs]
        assert all(r is not None for r in records)
        assert sum(r.num_draft_tokens for r in records) == sum(t["verify"] for t in trace)
        assert sum(sum(r.histogram) for r in records) == sum(t["verify"] > 0 for t in trace)
        assert sum(j * n for r in records for j, n in enumerate(r.histogram)) == \
            sum(t["accepted"] for t in trace)

    def test_batch1_accepted_lengths_equal_reference(self, llm, engine_env, work):
        """One prompt at a time, every step's (tree size, verified nodes, accepted length)
        equals the reference engine's with the same PTD config."""
        import torch
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from vllm_ptd.ptd.config import PTDConfig
        from vllm_ptd.ptd.method import PTDMethod
        from vllm_ptd.reference import ReferenceEngine

        class RecordingPTD(PTDMethod):
            def propose(self, req_ids, last_tokens):
                trees = super().propose(req_ids, last_tokens)
                self.sizes.extend((t.num_nodes, t.num_verify) for t in trees)
                return trees

        proposer = _proposer(llm)
        eos = list(proposer.method.eos_token_ids)
        prompts = [work["code"][2], work["mixed"][1]][:REF_PROMPTS]
        runs = []
        for ids in prompts:
            engine_env.mark()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                               SamplingParams(temperature=0, max_tokens=REF_TOKENS), use_tqdm=False)
            trace = engine_env.since_mark()
            assert len({t["req"] for t in trace}) == 1
            runs.append((ids, list(out[0].outputs[0].token_ids), trace))
        _flush(llm)

        ref = ReferenceEngine(str(proposer.model_config.model), dtype=torch.float32)
        for ids, tokens, trace in runs:
            method = RecordingPTD(PTDConfig(**{k: v for k, v in FIXED_PTD.items()
                                               if k != "method"}).resolved("cpu"), eos)
            method.sizes = []
            # PTD seeds a request's random choices from config.seed and the prompt; the id is
            # passed anyway, so the comparison would also hold for an id-seeded method
            gen = ref.generate(ids, REF_TOKENS, method=method, req_id=trace[0]["req"])
            assert gen.tokens == tokens
            ref_steps = [(n, v, a) for (n, v), a in zip(method.sizes, gen.accepted_per_step)
                         if n > 0]
            got = [(t["nodes"], t["verify"], t["accepted"]) for t in trace]
            assert len(got) == len(ref_steps)
            # the last step may be cut by max_tokens in the reference (vLLM counts the walk)
            assert got[:-1] == ref_steps[:-1]
            assert got[-1][:2] == ref_steps[-1][:2] and got[-1][2] >= ref_steps[-1][2]

    def test_sampling_walks_trees_and_seeded_sampling_equals_plain(self, llm, engine_env,
                                                                   plain, work):
        """Sampling without a seed walks trees and accepts from them. A seeded sampled
        request gets no tree (its draws would follow tree shapes the budget sizes from
        measured times): beside greedy requests that do, its text is plain decoding's for
        the same seed, run after run."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=p) for p in work["code"][:SAMPLING_PROMPTS]]
        engine_env.mark()
        outs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9,
                                                    max_tokens=SAMPLE_TOKENS), use_tqdm=False)
        walked = [t for t in engine_env.since_mark() if t["verify"] > 0]
        _flush(llm)
        assert all(len(o.outputs[0].token_ids) == SAMPLE_TOKENS for o in outs)
        assert walked, "no candidate tree was verified while sampling"
        assert any(t["accepted"] > 0 for t in walked), "the sampling walk never accepted"

        greedy = [TokensPrompt(prompt_token_ids=p) for p in work["mixed"][:2]]
        params = _seeded_params() + [SamplingParams(temperature=0, max_tokens=SAMPLE_TOKENS)] * 2
        for _ in range(2):
            engine_env.mark()
            outs = llm.generate(prompts + greedy, params, use_tqdm=False)
            trace = engine_env.since_mark()
            _flush(llm)
            # the engine's request ids are the output's plus "-<random suffix>"
            traced = {t["req"].rsplit("-", 1)[0] for t in trace if t["verify"] > 0}
            assert not traced & {o.request_id for o in outs[:SAMPLING_PROMPTS]}, \
                "a seeded request got a tree"
            assert traced & {o.request_id for o in outs[SAMPLING_PROMPTS:]}, \
                "the greedy requests beside got no tree"
            assert [list(o.outputs[0].token_ids) for o in outs[:SAMPLING_PROMPTS]] \
                == plain["seeded"]
        assert _proposer(llm).num_tracked() == 0

    def test_disable_by_batch_size_turns_trees_off_in_large_batches(self, llm, engine_env,
                                                                     plain, work):
        """``disable_by_batch_size``: no tree in a step whose batch has that many requests;
        outputs unchanged. Set on the running engine's proposer (the key's parsing and its way
        to the proposer are tested with the config)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        proposer = _proposer(llm)
        proposer.disable_by_batch_size = 3
        try:
            engine_env.mark()
            idx = [0, 1, 2]
            outs = llm.generate([TokensPrompt(prompt_token_ids=work["mixed"][i]) for i in idx],
                                [SamplingParams(temperature=0, max_tokens=work["mixed_max"][i])
                                 for i in idx], use_tqdm=False)
            trace = engine_env.since_mark()
        finally:
            proposer.disable_by_batch_size = None
        _flush(llm)
        for i, o in zip(idx, outs):
            assert list(o.outputs[0].token_ids) == plain[("mixed", i)]
        # the request that finishes first spent its whole life in a batch of 3: never a tree;
        # the others got trees once it had finished
        first = min(range(3), key=lambda k: len(outs[k].outputs[0].token_ids))
        with_trees = {t["req"] for t in trace}
        assert outs[first].request_id not in with_trees
        assert with_trees, "no tree even after the batch shrank"

    def test_logprobs_request_beside_trees_keeps_its_logprobs(self, llm, engine_env, plain,
                                                              work):
        """A request asking for logprobs decodes without a tree, in steps where other
        requests verify trees: it gets plain decoding's tokens and a logprobs entry for every
        token (the verify step passes vLLM's own logprobs rows through)."""
        from vllm import SamplingParams

        prompts = [work["code"][2], work["code"][0], work["mixed"][1], work["mixed"][2]]
        params = [SamplingParams(temperature=0, max_tokens=32, logprobs=2)] + \
            [SamplingParams(temperature=0, max_tokens=32)] * 3
        outs, trace = _generate_traced(llm, engine_env, prompts, params)
        assert trace, "no tree verified beside the logprobs request"
        assert outs[0].request_id not in {t["req"] for t in trace}
        want_tokens, want_lp = plain[("logprobs", 0)]
        got = outs[0].outputs[0]
        assert list(got.token_ids) == want_tokens
        assert got.logprobs is not None and len(got.logprobs) == len(want_tokens)
        for i, (g, w) in enumerate(zip(got.logprobs, want_lp)):
            assert set(g) == set(w), f"token {i}: top logprob ids differ"
            for tok in w:
                assert abs(g[tok].logprob - w[tok].logprob) < 1e-3, f"token {i}"

    def test_edited_logits_beside_trees(self, llm, engine_env, plain, work):
        """Requests whose logits vLLM's sampler edits (a bad word, a repetition penalty)
        decode without a tree beside requests with trees, through vLLM's sampler: the
        verify step's shortcut for plain-argmax requests must not take them."""
        from vllm import SamplingParams

        prompts = [work["code"][2]] * 2 + [work["code"][0], work["mixed"][1]]
        params = _edited_params(plain["banned"]) + \
            [SamplingParams(temperature=0, max_tokens=32)] * 2
        outs, trace = _generate_traced(llm, engine_env, prompts, params)
        assert trace, "no tree verified beside the edited requests"
        assert not {o.request_id for o in outs[:2]} & {t["req"] for t in trace}
        assert list(outs[0].outputs[0].token_ids) == plain[("bad_word", 0)]
        assert plain[("bad_word", 0)][0] != plain[("logprobs", 0)][0][0]
        assert list(outs[1].outputs[0].token_ids) == plain[("penalty", 0)]
        assert plain[("penalty", 0)] != plain[("logprobs", 0)][0][:24]

    def test_abort_mid_generation(self, llm, plain, work):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine = llm.llm_engine
        proposer = _proposer(llm)
        greedy = dict(temperature=0)
        engine.add_request("keep-0", TokensPrompt(prompt_token_ids=work["code"][0]),
                           SamplingParams(max_tokens=48, **greedy))
        engine.add_request("victim", TokensPrompt(prompt_token_ids=work["mixed"][0]),
                           SamplingParams(max_tokens=400, **greedy))
        engine.add_request("keep-1", TokensPrompt(prompt_token_ids=work["code"][1]),
                           SamplingParams(max_tokens=48, **greedy))
        final, aborted, steps, peak = {}, False, 0, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "victim" and not aborted \
                        and len(out.outputs[0].token_ids) >= 8:
                    engine.abort_request(["victim"])
                    aborted = True
                if out.finished:
                    final[out.request_id] = out
            steps += 1
            peak = max(peak, proposer.num_tracked())
            assert proposer.num_tracked() <= 2 * 3, "per-request state beyond the live requests"
            assert steps < 400
        assert aborted
        assert list(final["keep-0"].outputs[0].token_ids) == plain[("abort", 0)]
        assert list(final["keep-1"].outputs[0].token_ids) == plain[("abort", 1)]
        assert peak > 0
        _flush(llm)
        assert proposer.num_tracked() == 0
        assert not proposer.trees and not proposer.outcomes


# ---------------------------------------------------------------------------- PTD, 192 tokens
@pytest.fixture(scope="class")
def small_llm(engine_env, plain, model_path):
    from vllm import LLM

    llm = LLM(model_path, max_model_len=CONTEXT_LEN, speculative_config={"method": "ptd"},
              block_size=SMALL_BLOCK_SIZE, num_gpu_blocks_override=SMALL_BLOCKS,
              disable_log_stats=False, **MODEL_ARGS)
    yield llm
    _shutdown(llm)


class TestSmallEngine:
    """max_model_len 192 and a KV cache of 224 tokens (7 blocks of 32) shared by 3 requests
    that each reserve 1 + 24 slots per step for their trees: some get preempted."""

    @pytest.fixture
    def llm(self, small_llm):
        return small_llm

    def test_prompt_near_context_end(self, llm, plain, work):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = work["near_end"]
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                           SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
        got = list(out.outputs[0].token_ids)
        assert got == plain[("near_end", 0)]
        assert len(ids) + len(got) == CONTEXT_LEN and out.outputs[0].finish_reason == "length"
        _flush(llm)
        assert _proposer(llm).num_tracked() == 0

    def test_prompt_longer_than_context(self, llm, plain, work):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        too_long = (work["near_end"] * 2)[: CONTEXT_LEN + 8]
        with pytest.raises(Exception, match="maximum context length"):
            llm.generate([TokensPrompt(prompt_token_ids=too_long)],
                         SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        out = llm.generate([TokensPrompt(prompt_token_ids=work["code"][0])],
                           SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == plain[("next", 0)]

    def test_arrival_opens_the_batch(self, llm, plain, work):
        """A request that arrives while another runs (a server's next client) opens the
        batch: from then on every token counts the same (no batch's-end weights) until the
        engine is idle again; outputs stay those of plain decoding."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        proposer, engine = _proposer(llm), llm.llm_engine
        seen = []
        real = proposer._batch_end

        def recording(ready_b):
            weights, lead = real(ready_b)
            seen.append((proposer._open_batch, weights))
            assert (lead == math.inf) == (weights is None)
            return weights, lead

        def add(i):
            engine.add_request(f"arrival-{i}",
                               TokensPrompt(prompt_token_ids=work["preempt"][i]),
                               SamplingParams(temperature=0, max_tokens=PREEMPT_TOKENS))

        proposer._batch_end = recording
        got: dict[str, list[int]] = {}
        try:
            add(0)
            for _ in range(4):
                for o in engine.step():
                    got[o.request_id] = list(o.outputs[0].token_ids)
            closed = list(seen)
            add(1)
            while engine.has_unfinished_requests():
                for o in engine.step():
                    got[o.request_id] = list(o.outputs[0].token_ids)
        finally:
            del proposer._batch_end
        assert got["arrival-0"] == plain[("preempt", 0)]
        assert got["arrival-1"] == plain[("preempt", 1)]
        assert closed and all(not open_ and w is not None for open_, w in closed)
        opened = seen[len(closed):]
        assert opened and all(open_ and w is None for open_, w in opened)
        _flush(llm)
        # idle again: the next batch, added before its first step, is closed
        llm.generate([TokensPrompt(prompt_token_ids=work["code"][0])],
                     SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert proposer._open_batch is False
        _flush(llm)
        assert proposer.num_tracked() == 0

    def test_preemption(self, llm, plain, work):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # the budget's objective as the steps go: counting tokens while the scheduler has
        # requests waiting (here the preempted ones), the batch's end when it has none
        proposer = _proposer(llm)
        seen = []
        real = proposer._batch_end

        def recording(ready_b):
            weights, lead = real(ready_b)
            seen.append((proposer._num_waiting, len(ready_b), weights))
            assert (lead == math.inf) == (weights is None) and lead >= 0
            return weights, lead

        proposer._batch_end = recording
        before = _counters(llm).get("vllm:num_preemptions", 0)
        try:
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in work["preempt"]],
                                SamplingParams(temperature=0, max_tokens=PREEMPT_TOKENS),
                                use_tqdm=False)
        finally:
            del proposer._batch_end
        preempted = _counters(llm).get("vllm:num_preemptions", 0) - before
        assert preempted > 0, "the workload did not preempt: the test checks nothing"
        for i, o in enumerate(outs):
            assert list(o.outputs[0].token_ids) == plain[("preempt", i)], f"request {i}"
        assert any(w is not None and w > 0 for w, _, _ in seen), "no step saw a waiting request"
        assert all(weights is None for w, _, weights in seen if w)
        at_end = [(n, weights) for w, n, weights in seen if w == 0]
        assert at_end and all(len(weights) == n for n, weights in at_end)
        assert all(0.0 <= x <= 1.0 for _, weights in at_end for x in weights)
        _flush(llm)
        assert _proposer(llm).num_tracked() == 0
