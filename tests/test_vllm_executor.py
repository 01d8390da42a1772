"""A step's trees come back with its sampled tokens (``executor_patch``): with vLLM's
multiprocess executor (a worker process, as in every served engine) the engine core does not
ask the worker for the drafts in a second call, and outputs stay those of plain decoding.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
``distributed_executor_backend="mp"``, so the test can count the calls the executor sends to
its worker; a tiny random model (fp32, eager) repeats itself, so PTD's trees are accepted.
"""
from __future__ import annotations

import pytest
from engine_utils import counters, first_divergence, in_process_engines, shutdown

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

ENGINE_ARGS = dict(dtype="float32", enforce_eager=True, seed=0, max_model_len=1024,
                   max_num_seqs=4, distributed_executor_backend="mp", disable_log_stats=False)
MAX_TOKENS = [24, 40, 32, 48]


def _generate(model, spec=None):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[1, 504 + 7 * i, 1230, 216, 32 + i]) for i in range(4)]
    llm = LLM(model, speculative_config=spec, **ENGINE_ARGS)
    try:
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        sent: list[str] = []
        rpc = executor.collective_rpc

        def counted(method, *args, **kwargs):
            sent.append(method if isinstance(method, str) else "<callable>")
            return rpc(method, *args, **kwargs)

        executor.collective_rpc = counted
        outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0)
                                      for n in MAX_TOKENS], use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], sent, counters(llm), type(executor)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory, model_path):
    """Head size 32: vLLM's CPU attention has no kernel for the 16 of the tiniest model."""
    from vllm_ptd.model_store import tiny_random_model

    return tiny_random_model(tmp_path_factory.mktemp("mp_llama"), layers=2, hidden=128,
                             heads=4, kv_heads=2)


def test_drafts_come_back_with_the_sampled_tokens(small_model):
    with in_process_engines():
        plain, _, _, kind = _generate(small_model)
        got, sent, count, _ = _generate(small_model, {"method": "ptd", "budget": "fixed"})
    assert kind.__name__ == "MultiprocExecutor"
    for i, (g, p) in enumerate(zip(got, plain)):
        assert g == p, f"prompt {i}: first divergence at token {first_divergence(g, p)}"
    steps = sent.count("sample_tokens")
    assert steps > 10
    # the drafts reached the scheduler (accepted tokens counted) without a call of their own
    assert count.get("vllm:spec_decode_num_accepted_tokens", 0) > 0, count
    assert sent.count("take_draft_token_ids") == 0, (sent.count("take_draft_token_ids"), steps)
