"""scripts/train_dspark.py: the teacher-forced data path (``--generator vllm``) yields the
tensors the transformers decoding loop yields, on a tiny random target."""
import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def train_dspark():
    path = Path(__file__).resolve().parents[1] / "scripts" / "train_dspark.py"
    spec = importlib.util.spec_from_file_location("train_dspark", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_teacher_forced_matches_decoding_loop(train_dspark, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    # different lengths: the loop pads on the left, the teacher-forced batch on the right
    prompts = [torch.randint(3, 1000, (n,)).tolist() for n in (5, 11, 8)]
    hidden = (0, 1, 2)
    loop = train_dspark.generate_batch(model, prompts, hidden, 9, eos=set(), topk=4, pad_id=2)
    forced = train_dspark.teacher_forced(model, [q["ids"].tolist() for q in loop],
                                         [q["prompt_len"] for q in loop], hidden, 4)
    for a, b in zip(loop, forced):
        assert torch.equal(a["ids"], b["ids"]) and a["prompt_len"] == b["prompt_len"]
        assert a["rows"].shape == b["rows"].shape == (len(a["ids"]) - 1, 3 * model.config.hidden_size)
        torch.testing.assert_close(a["rows"].float(), b["rows"].float(), atol=2e-3, rtol=2e-3)
        assert a["top_ids"].shape == b["top_ids"].shape == (len(a["ids"]) - 1 - a["prompt_len"], 4)
        assert torch.equal(a["top_ids"][:, 0], b["top_ids"][:, 0])  # the greedy token
        torch.testing.assert_close(a["top_p"].float(), b["top_p"].float(), atol=1e-3, rtol=1e-3)


def test_training_prompts_leave_benchmark_prompts_out(train_dspark):
    """Every source of SOURCE_MIX has prompts, none is a benchmark prompt (nor one of
    HumanEval's functions in the code prompts), and the pools come out the same for a seed."""
    try:
        ddir = train_dspark.data_dir(None)
    except SystemExit as e:  # a checkout without ../shared/data and no VLLM_PTD_DATA
        pytest.skip(str(e))
    pools = train_dspark.training_prompts(ddir, seed=0)
    assert set(train_dspark.SOURCE_MIX) <= set(pools)
    assert all(pools[name] for name in train_dspark.SOURCE_MIX)
    bench = train_dspark.benchmark_texts()
    texts = [t.strip() for pool in pools.values() for t in pool]
    assert not bench & set(texts)
    he_names = train_dspark.humaneval_function_names()
    code_names = {t.split("def ", 1)[1].split("(", 1)[0] for t in pools["stdlib_code"]}
    assert he_names and not he_names & code_names
    assert train_dspark.training_prompts(ddir, seed=0) == pools


def test_first_layers_is_the_drafter_cut_after_its_first_layers(train_dspark):
    """``--init`` with fewer ``--layers``: the shallower drafter is the trained one's context
    projection, first layers, norm and heads, and drafts what running those alone drafts."""
    from vllm_ptd.pctree.drafter import DSparkConfig, DSparkDrafter

    target = dict(vocab_size=96, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=64, rms_norm_eps=1e-6,
                  rope_theta=10000.0, model_type="llama", architectures=["LlamaForCausalLM"],
                  hidden_act="silu", tie_word_embeddings=True)
    cfg = DSparkConfig.for_target(target, num_layers=3, block_size=4, target_layer_ids=[0, 2],
                                  mask_token_id=95, markov_rank=8)
    g = torch.Generator().manual_seed(0)
    deep = DSparkDrafter(cfg)
    with torch.no_grad():
        for p in deep.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    deep.eval()
    small = train_dspark.first_layers(deep, 1).eval()
    assert small.config.num_hidden_layers == 1 and len(small.layers) == 1
    deep_params = dict(deep.named_parameters())
    for name, p in small.named_parameters():
        assert torch.equal(p, deep_params[name]), name
        assert p.requires_grad == (name not in small.frozen_parameter_names())
    ctx_rows = torch.randn(7, deep.context_dim, generator=g)
    ctx_small, ctx_deep = small.new_context(), deep.new_context()
    small.append_context(ctx_small, ctx_rows, 0)
    deep.append_context(ctx_deep, ctx_rows, 0)
    base, hidden = small.draft_block([ctx_small], [5])
    # the deep drafter with its later layers taken out by hand
    deep.layers = deep.layers[:1]
    ctx_deep.k, ctx_deep.v = ctx_deep.k[:1], ctx_deep.v[:1]
    deep.config.num_hidden_layers = 1
    base_ref, hidden_ref = deep.draft_block([ctx_deep], [5])
    torch.testing.assert_close(base, base_ref)
    torch.testing.assert_close(hidden, hidden_ref)
