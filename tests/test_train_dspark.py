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
