"""PCTree inside vLLM (issue 4): lossless greedy output with a random-init drafter and with
the trained drafter shipped in the package; bad drafters and bad keys refused up front.

Engines run in this process, one at a time, fp32 + eager on both sides (token identity in
bf16 flips at near-ties).
"""
from __future__ import annotations

import pytest
from engine_utils import in_process_engines, save_random_drafter
from engine_utils import shutdown as _shutdown

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

MODEL_ARGS = dict(dtype="float32", enforce_eager=True, seed=0, max_model_len=1024)
MAX_TOKENS = [24, 40, 32, 48]


@pytest.fixture(scope="module", autouse=True)
def _in_process():
    with in_process_engines():
        yield


def _generate(model_path, prompts, speculative_config=None):
    from vllm import LLM, SamplingParams

    llm = LLM(model_path, speculative_config=speculative_config, **MODEL_ARGS)
    try:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0)
                                      for n in MAX_TOKENS[: len(prompts)]], use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        _shutdown(llm)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from vllm.inputs import TokensPrompt

    from vllm_ptd.datasets import chat_prompt_ids, load_prompts

    chosen = [load_prompts(name, 1)[0] for name in ("gsm8k", "humaneval", "mbpp", "mt_bench")]
    return [TokensPrompt(prompt_token_ids=chat_prompt_ids(tokenizer, p.text)) for p in chosen]


@pytest.fixture(scope="module")
def plain(model_path, prompts):
    return _generate(model_path, prompts)


@pytest.fixture(scope="module")
def random_drafter(tmp_path_factory, model_path):
    return save_random_drafter(model_path, tmp_path_factory.mktemp("drafter") / "random",
                               [1, 15, 27])


def test_random_drafter_is_lossless(model_path, prompts, plain, random_drafter):
    spec = {"method": "pctree", "model": random_drafter, "branching": 3, "max_nodes": 10}
    assert _generate(model_path, prompts, spec) == plain


def test_trained_drafter_is_lossless(model_path, prompts, plain):
    from vllm_ptd.pctree.method import packaged_drafters

    assert packaged_drafters(), "the trained drafter must ship with the package"
    assert _generate(model_path, prompts, {"method": "pctree"}) == plain


def test_mismatched_drafter_is_refused_before_the_engine_starts(model_path, tmp_path):
    from vllm import LLM

    from vllm_ptd.pctree.checkpoint import save_drafter
    from vllm_ptd.pctree.drafter import DSparkConfig, DSparkDrafter

    small = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6,
                 rope_theta=10000.0, model_type="llama", tie_word_embeddings=True)
    cfg = DSparkConfig.for_target(small, num_layers=1, block_size=4, target_layer_ids=[0, 2],
                                  mask_token_id=0, markov_rank=4, markov_head_type="vanilla",
                                  enable_confidence_head=False, confidence_head_with_markov=False,
                                  shared_embeddings=True)
    save_drafter(DSparkDrafter(cfg), tmp_path / "small")
    with pytest.raises(ValueError, match="vocab"):
        LLM(model_path, speculative_config={"method": "pctree", "model": str(tmp_path / "small")},
            **MODEL_ARGS)


@pytest.mark.parametrize("spec, key", [({"method": "pctree", "branchng": 4}, "branchng"),
                                       ({"method": "pctree", "max_nodes": 1}, "max_nodes"),
                                       ({"method": "pctree", "mode": "beam"}, "mode")])
def test_bad_keys_are_refused(model_path, spec, key):
    from vllm import LLM

    with pytest.raises(ValueError, match=key):
        LLM(model_path, speculative_config=spec, **MODEL_ARGS)
