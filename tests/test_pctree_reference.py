"""PCTree in the reference engine: greedy decoding with PCTree trees equals plain decoding
(fp32), with a random-init drafter on a tiny random target and with the packaged trained
drafter on SmolLM2-135M-Instruct (where drafts are actually accepted)."""
import json

import pytest
import torch

from vllm_ptd.pctree.config import PCTreeConfig
from vllm_ptd.pctree.checkpoint import load_target_embeddings, save_drafter
from vllm_ptd.pctree.drafter import DSparkConfig, DSparkDrafter
from vllm_ptd.pctree.method import PCTreeMethod, packaged_drafters
from vllm_ptd.reference import ReferenceEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
         "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
         "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"]


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_path):
    return ReferenceEngine(tiny_model_path)


@pytest.fixture(scope="module")
def tiny_drafter_dir(tiny_model_path, tmp_path_factory):
    tcfg = json.loads(open(f"{tiny_model_path}/config.json").read())
    L = int(tcfg["num_hidden_layers"])
    cfg = DSparkConfig.for_target(tcfg, num_layers=1, block_size=4, target_layer_ids=[-1, L - 2],
                                  mask_token_id=16, markov_rank=8)
    torch.manual_seed(0)
    dr = DSparkDrafter(cfg)
    with torch.no_grad():
        for p in dr.parameters():
            p.normal_(0.0, 0.3)
    out = tmp_path_factory.mktemp("tiny_dspark")
    save_drafter(dr, out, dtype=None)
    return str(out)


@pytest.mark.parametrize("mode,k,n", [("pctree", 4, 16), ("shared", 3, 12), ("chain", 1, 8)])
def test_tiny_random_drafter_lossless(tiny_engine, tiny_model_path, tiny_drafter_dir, tokenizer, mode, k, n):
    emb = load_target_embeddings(tiny_model_path)
    m = PCTreeMethod(PCTreeConfig(model=tiny_drafter_dir, branching=k, max_nodes=n, mode=mode),
                     tiny_engine.model.config, emb)
    assert m.hidden_layer_ids == (0, tiny_engine.model.config.num_hidden_layers - 1)
    for text in TEXTS:
        p = tokenizer(text)["input_ids"]
        plain = tiny_engine.generate(p, 40)
        spec = tiny_engine.generate(p, 40, m, req_id="x")
        assert spec.tokens == plain.tokens
        assert spec.finish_reason == plain.finish_reason
        assert m.num_requests() == 0  # finished
        assert spec.metrics.verify_rows > 0


@pytest.fixture(scope="module")
def trained_dir():
    found = packaged_drafters()
    if not found:
        pytest.skip("no packaged DSpark drafter (scripts/train_dspark.py makes one)")
    return str(found[0])


def test_trained_drafter_lossless_and_accepts(model_path, tokenizer, trained_dir):
    from vllm_ptd.datasets import chat_prompt_ids

    eng = ReferenceEngine(model_path, dtype=torch.float32)
    methods = {mode: PCTreeMethod(PCTreeConfig(mode=mode, branching=1 if mode == "chain" else 4, max_nodes=16), eng.model.config,
                                  (eng.model.get_input_embeddings().weight, eng.model.get_output_embeddings().weight))
               for mode in ("pctree", "chain")}
    assert methods["pctree"].hidden_layer_ids == (2, 10, 19, 28)
    prompts = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many "
               "clips in May. How many clips did Natalia sell altogether in April and May?",
               "Write a python function to reverse a string."]
    accepted = 0
    for text in prompts:
        p = chat_prompt_ids(tokenizer, text)
        plain = eng.generate(p, 32)
        for mode, m in methods.items():
            spec = eng.generate(p, 32, m, req_id=mode)
            assert spec.tokens == plain.tokens, mode
            accepted += spec.metrics.accepted
    assert accepted > 0, "the trained drafter never had a draft token accepted"
