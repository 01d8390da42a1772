"""Shared pytest fixtures: the embedded default model, its tokenizer, a tiny random model."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures(...)``): tiny and
    one-sequence matmuls gain little from threads, and on a shared 2-core machine a second
    thread that waits for a busy core makes every op several times slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def model_path() -> str:
    """Path of the default target model (SmolLM2-135M-Instruct bf16 HF folder)."""
    from vllm_ptd.model_store import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    """The default model's tokenizer (with its chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory, model_path) -> str:
    """A tiny random fp32 LlamaForCausalLM (2 layers, hidden 64) sharing the real tokenizer."""
    from vllm_ptd.model_store import tiny_random_model

    return tiny_random_model(tmp_path_factory.mktemp("tiny_llama"))
