"""Reference engine on a tiny random model: fast checks of the step mechanics.

Lossless greedy output (PTD and a scripted method that forces deep acceptance), exact stops at
max_new_tokens / EOS / max_model_len, prompt errors, seeded sampling, and the KV compaction
and tapped hidden states against a fresh no-cache forward.
"""
import random

import pytest
import torch

from vllm_ptd.ptd.config import PTDConfig
from vllm_ptd.method import StepOutcome, TreeMethod
from vllm_ptd.ptd.method import PTDMethod
from vllm_ptd.reference import ReferenceEngine
from vllm_ptd.tree import FlatTree
from vllm_ptd.verify import greedy_walk

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
         "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
         "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
         "Hello"]


class ScriptedMethod(TreeMethod):
    """Knows the plain greedy continuation and proposes trees with its next 0..depth tokens
    (each with a wrong sibling, sometimes a wrong child below), plus random draft rows in a
    causal tail: deep acceptance on any model, with cut trees and decoys around it."""

    def __init__(self, sequence, depth=5, num_draft=3, seed=0, vocab=49152,
                 hidden_layer_ids=()):
        self.sequence = list(sequence)
        self.depth, self.num_draft, self.vocab = depth, num_draft, vocab
        self.rng = random.Random(seed)
        self.needs_hidden = bool(hidden_layer_ids)
        self.hidden_layer_ids = tuple(hidden_layer_ids)
        self.prompt_hidden = None
        self.outcomes: list[StepOutcome] = []
        self.finished: list[str] = []

    @property
    def max_tree_nodes(self):
        return 2 * self.depth + 1 + self.num_draft

    def start(self, req_id, prompt_token_ids, prompt_hidden=None):
        self.pos = len(prompt_token_ids) + 1  # the prefill committed one token
        self.prompt_hidden = prompt_hidden

    def observe(self, req_ids, outcomes):
        for o in outcomes:
            self.pos += len(o.committed)
            self.outcomes.append(o)

    def propose(self, req_ids, last_tokens):
        assert last_tokens[0] == self.sequence[self.pos - 1]
        path = self.sequence[self.pos: self.pos + self.rng.randint(0, self.depth)]
        tokens, parents, prev = [], [], -1
        for t in path:
            tokens += [(t + 1) % self.vocab, t]
            parents += [prev, prev]
            prev = len(tokens) - 1
        if self.rng.random() < 0.5:
            tokens.append(self.rng.randrange(self.vocab))
            parents.append(prev)
        nv = len(tokens)
        for _ in range(self.num_draft):
            tokens.append(self.rng.randrange(self.vocab))
            parents.append(self.rng.randint(-1, len(tokens) - 2))
        return [FlatTree(tokens, parents, nv, nv)]

    def finish(self, req_id):
        self.finished.append(req_id)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return ReferenceEngine(tiny_model_path)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in TEXTS]


def ptd(engine, **kw):
    return PTDMethod(PTDConfig(**kw).resolved("cpu"), engine.eos_token_ids)


def test_plain_vs_ptd_identical(engine, prompts):
    accepted = 0
    for p in prompts:
        plain = engine.generate(p, 64)
        spec = engine.generate(p, 64, ptd(engine, width=4, depth=6))
        assert spec.tokens == plain.tokens
        assert spec.finish_reason == plain.finish_reason
        assert plain.steps == len(plain.tokens) - 1 and set(plain.accepted_per_step) <= {0}
        assert spec.metrics.committed == len(spec.tokens) - 1  # the prefill made the first
        accepted += sum(spec.accepted_per_step)
    assert accepted > 0, "PTD never accepted a token: the test exercised no multi-token step"


def test_scripted_deep_acceptance_identical(engine, prompts):
    for p in prompts:
        plain = engine.generate(p, 80)
        m = ScriptedMethod(p + plain.tokens, depth=6, seed=len(p))
        spec = engine.generate(p, 80, m, req_id="r1")
        assert spec.tokens == plain.tokens
        assert max(spec.accepted_per_step) >= 4
        assert spec.steps < plain.steps
        assert m.finished == ["r1"]


@pytest.mark.parametrize("max_new", [1, 2, 7, 33])
@pytest.mark.parametrize("budget", [(1, 0), (2, 3), (12, 12), (24, 32)])
def test_budgets_and_lengths(engine, prompts, max_new, budget):
    nv, nd = budget
    for p in prompts[:2]:
        plain = engine.generate(p, max_new)
        assert len(plain.tokens) == max_new or plain.finish_reason == "eos"
        spec = engine.generate(p, max_new, ptd(engine, max_verify_nodes=nv, max_draft_nodes=nd))
        assert spec.tokens == plain.tokens
        assert spec.metrics.verify_rows <= nv * spec.steps
        assert spec.metrics.draft_rows <= nd * spec.steps
        deep = engine.generate(p, max_new, ScriptedMethod(p + plain.tokens, depth=8))
        assert deep.tokens == plain.tokens


def test_context_end(tiny_model_path, prompts):
    eng = ReferenceEngine(tiny_model_path, max_model_len=40)
    p = (prompts[0] * 3)[:25]
    plain = eng.generate(p, 100)
    assert len(p) + len(plain.tokens) == 40 and plain.finish_reason == "context"
    spec = eng.generate(p, 100, ptd(eng))
    assert spec.tokens == plain.tokens and spec.finish_reason == "context"
    deep = eng.generate(p, 100, ScriptedMethod(p + plain.tokens, depth=8, num_draft=6))
    assert deep.tokens == plain.tokens and deep.finish_reason == "context"
    # the length limit wins when it is reached first at the context end too
    assert eng.generate(p, 15, ptd(eng)).finish_reason == "length"
    one = eng.generate((prompts[0] * 9)[:39], 100, ptd(eng))
    assert len(one.tokens) == 1 and one.finish_reason == "context"


def test_prompt_errors(engine, tiny_model_path):
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], 10)
    short = ReferenceEngine(tiny_model_path, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        short.generate(list(range(100, 116)), 10)
    with pytest.raises(ValueError, match="max_model_len"):
        short.generate(list(range(100, 140)), 10, ptd(short))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ReferenceEngine(tiny_model_path, max_model_len=10**7)
    assert engine.generate([5, 6], 0).tokens == []


def test_eos_inside_a_multi_token_step(engine, prompts):
    p = prompts[2]
    plain = engine.generate(p, 60)
    # pretend a token from the middle of the output is an EOS: decoding must stop right after
    # its first occurrence, also when a step commits it in the middle of an accepted path
    i = next(i for i in range(8, 60) if plain.tokens[i] not in plain.tokens[:i])
    saved = engine.eos_token_ids
    engine.eos_token_ids = saved + (plain.tokens[i],)
    try:
        stop = engine.generate(p, 60)
        m = ScriptedMethod(p + plain.tokens, depth=8, seed=3)
        spec = engine.generate(p, 60, m)
        ignored = engine.generate(p, 60, ScriptedMethod(p + plain.tokens, depth=8),
                                  ignore_eos=True)
    finally:
        engine.eos_token_ids = saved
    assert stop.tokens == plain.tokens[: i + 1] and stop.finish_reason == "eos"
    assert spec.tokens == stop.tokens and spec.finish_reason == "eos"
    assert ignored.tokens == plain.tokens[:60] and ignored.finish_reason == "length"


def test_top2_gaps(engine, prompts):
    p = prompts[3]
    plain = engine.generate(p, 20)
    spec = engine.generate(p, 20, ScriptedMethod(p + plain.tokens, depth=6))
    forced = engine.top2_gaps(p, plain.tokens)
    assert len(plain.top2_gaps) == len(spec.top2_gaps) == len(forced) == len(plain.tokens)
    assert all(g >= 0 for g in forced)
    torch.testing.assert_close(torch.tensor(plain.top2_gaps), torch.tensor(forced),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(spec.top2_gaps), torch.tensor(forced),
                               atol=1e-4, rtol=1e-4)


def test_sampling_reproducible(engine, prompts):
    p = prompts[0]
    kw = dict(temperature=0.8, top_p=0.95, top_k=50)
    a = engine.generate(p, 40, seed=1, **kw)
    assert engine.generate(p, 40, seed=1, **kw).tokens == a.tokens
    assert engine.generate(p, 40, seed=2, **kw).tokens != a.tokens
    s1 = engine.generate(p, 40, ptd(engine), seed=1, **kw)
    s2 = engine.generate(p, 40, ptd(engine), seed=1, **kw)
    assert s1.tokens == s2.tokens
    assert len(s1.tokens) == 40 or s1.finish_reason == "eos"


def test_kv_compaction_matches_fresh_forward(engine, prompts):
    p = prompts[1]
    plain = engine.generate(p, 40)
    m = ScriptedMethod(p + plain.tokens, depth=6, num_draft=4, seed=7)
    state, logits, _ = engine.prefill(p)
    state.tokens.append(int(logits.argmax()))
    m.start("r", p)
    model = engine.model
    for _ in range(8):
        tree = m.propose(["r"], [state.tokens[-1]])[0]
        step_logits, _ = engine.forward_tree(state, tree)
        am = step_logits.argmax(-1).tolist()
        accepted, committed = greedy_walk(tree, am[0], am[1:])
        engine.keep(state, accepted, committed)
        m.observe(["r"], [StepOutcome(tree, am[0], am[1:], accepted, committed)])
        assert state.tokens == (p + plain.tokens)[: len(state.tokens)]
        assert state.cache.get_seq_length() == len(state.tokens) - 1
        with torch.inference_mode():
            fresh = model(input_ids=torch.tensor([state.tokens[:-1]]), use_cache=True)
        for got, want in zip(state.cache.layers, fresh.past_key_values.layers):
            torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)
        # the next step's root logits equal a fresh forward over the committed sequence
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([state.tokens])).logits[0, -1]
        probe, _ = engine.forward_tree(state, FlatTree())
        engine.keep(state, [], [])
        torch.testing.assert_close(probe[0], want, atol=1e-4, rtol=1e-4)
        assert state.cache.get_seq_length() == len(state.tokens) - 1
    assert sum(len(o.accepted) for o in m.outcomes) >= 8


def test_hidden_states_of_committed_rows(engine, prompts):
    p = prompts[0]
    plain = engine.generate(p, 30)
    layers = (1, 2)
    m = ScriptedMethod(p + plain.tokens, depth=5, seed=1, hidden_layer_ids=layers)
    spec = engine.generate(p, 30, m)
    assert spec.tokens == plain.tokens
    seq = p + plain.tokens
    with torch.inference_mode():
        hs = engine.model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[i][0] for i in layers], dim=-1)  # [len(seq), 2 * hidden]
    torch.testing.assert_close(m.prompt_hidden, want[: len(p)], atol=1e-4, rtol=1e-4)
    pos = len(p)  # the root of the first step is the prefill's token at position len(p)
    for o in m.outcomes:
        assert o.hidden.shape == (1 + len(o.accepted), want.shape[1])
        torch.testing.assert_close(o.hidden, want[pos: pos + 1 + len(o.accepted)],
                                   atol=1e-4, rtol=1e-4)
        pos += len(o.committed)
