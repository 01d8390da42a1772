"""Reference engine on the real model (SmolLM2-135M-Instruct): PTD is lossless.

fp32: greedy PTD (w=4, d=6, CPU budgets) is token-identical to plain greedy decoding on 3
MT-Bench + 3 GSM8K chat prompts, 96 new tokens each (``scripts/bench_reference.py`` runs the
larger set; the vLLM tests cover more prompts, batches and compiled mode). bf16: the tree forward's rounding
differs from the one-row forward's, so outputs may part; each first divergence must sit where
the plain run's top-2 logits nearly tie. Also the context end (max_model_len) on this model.
"""
import pytest
import torch

from vllm_ptd.ptd.config import PTDConfig
from vllm_ptd.bench.near_ties import first_divergence
from vllm_ptd.datasets import chat_prompt_ids, load_prompts
from vllm_ptd.metrics import SpecMetrics
from vllm_ptd.ptd.method import PTDMethod
from vllm_ptd.reference import ReferenceEngine

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

NEW_TOKENS = 96
PROMPTS_PER_SET = 3
# bf16 forwards on a CPU without bf16 instructions are several times slower than fp32: the
# bf16 check runs on a subset (every other prompt, both datasets).
BF16_EVERY = 2
BF16_NEW_TOKENS = 48
# Largest top-2 logit gap of the plain bf16 run at which a bf16 divergence is accepted as
# rounding. bf16 keeps 8 mantissa bits: logits of about 10-30 carry steps of 0.06-0.125,
# and the tree forward sums in another order, so gaps of a few steps flip.
BF16_TIE_GAP = 0.25


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [chat_prompt_ids(tokenizer, p.text)
            for name in ("mt_bench", "gsm8k") for p in load_prompts(name, PROMPTS_PER_SET)]


def ptd_method(engine):
    cfg = PTDConfig(width=4, depth=6).resolved(str(engine.device))
    return PTDMethod(cfg, engine.eos_token_ids)


def run_both(engine, prompts, max_new):
    plain = [engine.generate(p, max_new) for p in prompts]
    spec = [engine.generate(p, max_new, ptd_method(engine)) for p in prompts]
    return plain, spec


@pytest.mark.timeout(1800)  # about 3 CPU-minutes: a busy shared machine may need more
def test_ptd_lossless_fp32(model_path, prompts):
    engine = ReferenceEngine(model_path, dtype=torch.float32)
    plain, spec = run_both(engine, prompts, NEW_TOKENS)
    same = sum(s.tokens == p.tokens for s, p in zip(spec, plain))
    m = SpecMetrics.merged(s.metrics for s in spec)
    plain_s, spec_s = sum(g.seconds for g in plain), sum(g.seconds for g in spec)
    print(f"\nfp32 identical {same}/{len(prompts)}; PTD {m.summary()}; "
          f"plain {plain_s:.0f}s, PTD {spec_s:.0f}s")
    for i, (s, p) in enumerate(zip(spec, plain)):
        assert s.tokens == p.tokens, (
            f"prompt {i}: PTD parts from plain greedy at output token "
            f"{first_divergence(s.tokens, p.tokens)}")
    assert m.steps < sum(len(p.tokens) for p in plain), "PTD saved no forward at all"


def test_ptd_bf16_divergences_are_near_ties(model_path, prompts):
    engine = ReferenceEngine(model_path, dtype=torch.bfloat16)
    subset = prompts[::BF16_EVERY]
    plain, spec = run_both(engine, subset, BF16_NEW_TOKENS)
    same = sum(s.tokens == p.tokens for s, p in zip(spec, plain))
    gaps = []
    for s, p in zip(spec, plain):
        if s.tokens != p.tokens:
            i = first_divergence(s.tokens, p.tokens)
            assert i < min(len(s.tokens), len(p.tokens)), "one output is a prefix of the other"
            gaps.append(p.top2_gaps[i])
    print(f"\nbf16 identical {same}/{len(subset)} (match rate {same / len(subset):.2f}); "
          f"top-2 gaps of the plain run at the first divergences: "
          f"{[round(g, 4) for g in gaps]}")
    assert all(g <= BF16_TIE_GAP for g in gaps), gaps


def test_context_end_real_model(model_path, prompts):
    engine = ReferenceEngine(model_path, dtype=torch.float32, max_model_len=80)
    long = [p[:60] for p in prompts if len(p) >= 60]  # one MT-Bench, one GSM8K prompt
    for p in (long[0], long[-1]):
        plain = engine.generate(p, 100)
        spec = engine.generate(p, 100, ptd_method(engine))
        assert len(p) == 60 and len(p) + len(plain.tokens) <= 80
        assert plain.finish_reason == "eos" or (len(plain.tokens) == 20
                                                and plain.finish_reason == "context")
        assert spec.tokens == plain.tokens and spec.finish_reason == plain.finish_reason
