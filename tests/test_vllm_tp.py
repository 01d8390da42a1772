"""Tensor parallelism: PTD and PCTree at ``tensor_parallel_size=2`` equal plain decoding at
``tensor_parallel_size=2``, greedy, fp32, eager.

vLLM's multiprocess executor runs one worker process per rank, each bound to its own core
(``VLLM_CPU_OMP_THREADS_BIND``). Only the first rank drafts; the proposer broadcasts the
scheduled trees' shapes, so every rank lays out the same rows, masks and positions, walks the
same logits and moves the same K/V. The reference is plain decoding at the same parallel
size: a sum split across two ranks rounds differently from one rank's.

The embedded SmolLM2-135M has 9 attention heads and 3 KV heads, which two ranks cannot split
(vLLM refuses it), so these engines run a small random Llama with 4 heads and 2 KV heads (its
greedy text repeats itself, so PTD's trees are accepted); PCTree runs a random drafter made
for it, whose trees are rarely accepted but run through the same path. The trace, written by
the drafting rank, shows that trees ran.
"""
from __future__ import annotations

import json
import os

import pytest
from engine_utils import save_random_drafter, shutdown

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

ENGINE_ARGS = dict(dtype="float32", enforce_eager=True, seed=0, max_model_len=1024,
                   tensor_parallel_size=2, max_num_seqs=8)
MAX_TOKENS = [24, 40, 32, 48]


@pytest.fixture(scope="module")
def tp_env(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_trace") / "trace.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
        mp.setenv("VLLM_PTD_TRACE", str(path))
        yield path


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory, model_path):
    from vllm_ptd.model_store import tiny_random_model

    return tiny_random_model(tmp_path_factory.mktemp("tp_llama"), layers=3, hidden=128,
                             heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def tp_drafter(tmp_path_factory, tp_model):
    return save_random_drafter(tp_model, tmp_path_factory.mktemp("tp_drafter") / "random", [0, 1])


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from vllm.inputs import TokensPrompt

    from vllm_ptd.datasets import chat_prompt_ids, load_prompts

    chosen = [load_prompts(name, 1)[0] for name in ("gsm8k", "humaneval", "mbpp", "mt_bench")]
    return [TokensPrompt(prompt_token_ids=chat_prompt_ids(tokenizer, p.text)) for p in chosen]


def _generate(model, prompts, spec=None):
    from vllm import LLM, SamplingParams

    llm = LLM(model, speculative_config=spec, **ENGINE_ARGS)
    try:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0)
                                      for n in MAX_TOKENS], use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def plain(tp_env, tp_model, prompts):
    return _generate(tp_model, prompts)


def _run(tp_env, tp_model, prompts, plain, name, spec) -> list[dict]:
    start = tp_env.stat().st_size if tp_env.exists() else 0
    got = _generate(tp_model, prompts, spec)
    for i, (g, p) in enumerate(zip(got, plain)):
        first = next((k for k, (x, y) in enumerate(zip(g, p)) if x != y), None)
        assert g == p, f"{name} TP=2 prompt {i}: first divergence at token {first}"
    with open(tp_env) as f:
        f.seek(start)
        records = [json.loads(line) for line in f if '"req"' in line]
    assert records, f"{name}: no tree ran at TP=2"
    return records


def test_ptd_tp2_equals_plain(tp_env, tp_model, prompts, plain):
    records = _run(tp_env, tp_model, prompts, plain, "ptd", {"method": "ptd", "budget": "fixed"})
    assert sum(r["accepted"] for r in records) > 0, "ptd: no tree token accepted at TP=2"


def test_pctree_tp2_equals_plain(tp_env, tp_model, tp_drafter, prompts, plain):
    spec = {"method": "pctree", "budget": "fixed", "model": tp_drafter}
    _run(tp_env, tp_model, prompts, plain, "pctree", spec)


def test_pipeline_parallel_is_refused(model_path):
    from vllm import LLM

    with pytest.raises(ValueError, match="pipeline_parallel_size = 2"):
        LLM(model_path, speculative_config={"method": "ptd"}, pipeline_parallel_size=2,
            dtype="float32", enforce_eager=True)
