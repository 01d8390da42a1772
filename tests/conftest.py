"""Shared pytest fixtures: the embedded default model, its tokenizer, a tiny random model."""
import pytest


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
