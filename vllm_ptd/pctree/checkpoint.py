"""Load / save DSpark drafters in DeepSpec's released format (``config.json`` +
``model.safetensors``, or sharded with ``model.safetensors.index.json``), no vLLM.

Tensor names (no prefix; a ``model.`` prefix is accepted when loading)::

    embed_tokens.weight                      [V, d]      (absent in the compact variant)
    lm_head.weight                           [V, d]      (absent in the compact variant)
    fc.weight                                [d, n*d]
    hidden_norm.weight, norm.weight          [d]
    layers.{i}.input_layernorm.weight        [d]
    layers.{i}.post_attention_layernorm.weight [d]
    layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias with attention_bias)
    layers.{i}.self_attn.{q,k}_norm.weight   [head_dim]
    layers.{i}.mlp.{gate,up,down}_proj.weight
    markov_head.markov_w1.weight             [V, r]
    markov_head.markov_w2.weight             [V, r]
    markov_head.gate_proj.{weight,bias}      (markov_head_type "gated")
    confidence_head.proj.{weight,bias}       (enable_confidence_head)

Compact variant: ``"vllm_ptd_shared_embeddings": true`` in ``config.json``; the file has no
``embed_tokens`` / ``lm_head`` and they come from the target at load time.

A checkpoint that does not fit the target is refused with a ValueError that lists every
mismatch (architecture, vocabulary, hidden size, target layer count, layer ids, mask token,
missing / unexpected / wrongly shaped tensors).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Mapping

import torch

from vllm_ptd.pctree.drafter import ARCHITECTURE, SHARED_EMBEDDINGS_KEY, DSparkConfig, DSparkDrafter

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "INDEX_NAME",
    "target_config_dict",
    "read_drafter_config",
    "read_tensor_shapes",
    "expected_tensor_shapes",
    "check_drafter_fits",
    "load_drafter",
    "save_drafter",
    "load_target_embeddings",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_PREFIX = "model."


# ---------------------------------------------------------------------------------------
# target config
# ---------------------------------------------------------------------------------------


def target_config_dict(target_config: Any) -> dict:
    """The target's HF config as a dict (text part for multimodal configs).

    Accepts a ``transformers.PretrainedConfig``, a dict, or a model folder / config.json path.
    The folder (when known) is kept under ``"_name_or_path"``."""
    if isinstance(target_config, (str, os.PathLike)):
        p = Path(target_config)
        cfg_file = p / CONFIG_NAME if p.is_dir() else p
        if not cfg_file.is_file():
            raise ValueError(f"target config {str(p)!r}: no {CONFIG_NAME} there")
        d = json.loads(cfg_file.read_text(encoding="utf-8"))
        d.setdefault("_name_or_path", str(cfg_file.parent))
    elif isinstance(target_config, Mapping):
        d = dict(target_config)
    elif hasattr(target_config, "to_dict"):
        d = target_config.to_dict()
        name = getattr(target_config, "name_or_path", None) or getattr(target_config, "_name_or_path", None)
        if name:
            d["_name_or_path"] = name
    else:
        raise ValueError(f"cannot read a target config from {type(target_config).__name__}")
    text = d.get("text_config")
    if isinstance(text, Mapping) and "hidden_size" not in d:
        name = d.get("_name_or_path")
        d = dict(text)
        if name:
            d.setdefault("_name_or_path", name)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if key not in d:
            raise ValueError(f"target config lacks {key!r}")
    return d


# ---------------------------------------------------------------------------------------
# headers
# ---------------------------------------------------------------------------------------


def _header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n <= 0 or n > 100_000_000:
            raise ValueError(f"{file}: not a safetensors file (header length {n})")
        hdr = json.loads(f.read(n).decode("utf-8"))
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in hdr.items() if k != "__metadata__"}


def _weight_files(path: Path) -> list[Path]:
    single = path / WEIGHTS_NAME
    if single.is_file():
        return [single]
    index = path / INDEX_NAME
    if index.is_file():
        wm = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return [path / f for f in sorted(set(wm.values()))]
    raise ValueError(f"drafter folder {str(path)!r} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")


def _strip(name: str) -> str:
    return name[len(_PREFIX):] if name.startswith(_PREFIX) else name


def read_tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors header(s) only (no tensor data read)."""
    out: dict[str, tuple[int, ...]] = {}
    for f in _weight_files(Path(path)):
        if not f.is_file():
            raise ValueError(f"drafter shard {str(f)!r} is missing")
        for k, (_, shape) in _header(f).items():
            out[_strip(k)] = shape
    return out


def read_drafter_config(path: str | os.PathLike) -> DSparkConfig:
    p = Path(path)
    cfg_file = p / CONFIG_NAME
    if not cfg_file.is_file():
        raise ValueError(f"drafter folder {str(p)!r} has no {CONFIG_NAME}")
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: invalid JSON ({e})") from e
    try:
        return DSparkConfig.from_dict(raw)
    except ValueError as e:
        raise ValueError(f"drafter {str(p)!r}: {e}") from e


def expected_tensor_shapes(cfg: DSparkConfig, *, with_embeddings: bool | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``cfg`` must hold, with its shape."""
    if with_embeddings is None:
        with_embeddings = not cfg.shared_embeddings
    d, V, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    qd, kvd, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    e: dict[str, tuple[int, ...]] = {
        "fc.weight": (d, len(cfg.target_layer_ids) * d),
        "hidden_norm.weight": (d,),
        "norm.weight": (d,),
    }
    if with_embeddings:
        e["embed_tokens.weight"] = (V, d)
        e["lm_head.weight"] = (V, d)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        e[p + "input_layernorm.weight"] = (d,)
        e[p + "post_attention_layernorm.weight"] = (d,)
        for name, shape in (("q_proj", (qd, d)), ("k_proj", (kvd, d)), ("v_proj", (kvd, d)), ("o_proj", (d, qd))):
            e[p + f"self_attn.{name}.weight"] = shape
            if cfg.attention_bias:
                e[p + f"self_attn.{name}.bias"] = (shape[0],)
        e[p + "self_attn.q_norm.weight"] = (hd,)
        e[p + "self_attn.k_norm.weight"] = (hd,)
        e[p + "mlp.gate_proj.weight"] = (inter, d)
        e[p + "mlp.up_proj.weight"] = (inter, d)
        e[p + "mlp.down_proj.weight"] = (d, inter)
    if cfg.markov_rank > 0:
        r = cfg.markov_rank
        e["markov_head.markov_w1.weight"] = (V, r)
        e["markov_head.markov_w2.weight"] = (V, r)
        if cfg.markov_head_type == "gated":
            e["markov_head.gate_proj.weight"] = (r, d + r)
            e["markov_head.gate_proj.bias"] = (r,)
    if cfg.enable_confidence_head:
        dim = d + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
        e["confidence_head.proj.weight"] = (1, dim)
        e["confidence_head.proj.bias"] = (1,)
    return e


def _fit_problems(cfg: DSparkConfig, target: dict) -> list[str]:
    probs = []
    tv, th, tl = int(target["vocab_size"]), int(target["hidden_size"]), int(target["num_hidden_layers"])
    if cfg.vocab_size != tv:
        probs.append(f"vocabulary size: drafter {cfg.vocab_size}, target {tv}")
    if cfg.hidden_size != th:
        probs.append(f"hidden size: drafter {cfg.hidden_size}, target {th}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != tl:
        probs.append(f"target layer count: drafter was trained on {cfg.num_target_layers}, target has {tl}")
    bad = [i for i in cfg.target_layer_ids if not -1 <= i <= tl - 1]
    if bad:
        probs.append(f"target_layer_ids {bad} out of range [-1, {tl - 2}] for a {tl}-layer target")
    if tl - 1 in cfg.target_layer_ids:
        probs.append(f"target_layer_ids include the final layer {tl - 1}: its HF hidden state is "
                     "the final-normed output, which no hidden-state tap reproduces")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        probs.append(f"mask_token_id {cfg.mask_token_id} outside the vocabulary [0, {cfg.vocab_size})")
    return probs


def _tensor_problems(cfg: DSparkConfig, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    exp = expected_tensor_shapes(cfg)
    probs = []
    missing = sorted(set(exp) - set(shapes))
    if missing:
        hint = ""
        if cfg.shared_embeddings is False and set(missing) <= {"embed_tokens.weight", "lm_head.weight"}:
            hint = f" (a compact checkpoint must set {SHARED_EMBEDDINGS_KEY!r}: true)"
        probs.append(f"missing tensors: {missing}{hint}")
    allowed_extra = {"embed_tokens.weight", "lm_head.weight"} if cfg.shared_embeddings else set()
    extra = sorted(set(shapes) - set(exp) - allowed_extra)
    if extra:
        probs.append(f"unexpected tensors: {extra}")
    for k in sorted(set(exp) & set(shapes)):
        if tuple(shapes[k]) != tuple(exp[k]):
            probs.append(f"tensor {k} has shape {list(shapes[k])}, expected {list(exp[k])}")
    return probs


def check_drafter_fits(path: str | os.PathLike, target_hf_config: Any) -> DSparkConfig:
    """Cheap check (config.json + safetensors headers only) that the drafter at ``path``
    fits the target. Returns its config; raises ValueError naming every mismatch."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"drafter path {str(p)!r} is not a folder")
    cfg = read_drafter_config(p)
    target = target_config_dict(target_hf_config)
    probs = _fit_problems(cfg, target) + _tensor_problems(cfg, read_tensor_shapes(p))
    if probs:
        raise ValueError(f"drafter {str(p)!r} does not fit the target: " + "; ".join(probs))
    return cfg


# ---------------------------------------------------------------------------------------
# target embeddings
# ---------------------------------------------------------------------------------------


def load_target_embeddings(model_dir: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding, lm_head) ``[V, d]`` read from a HF model folder's safetensors (lm_head is
    the embedding when tied)."""
    from safetensors import safe_open

    p = Path(model_dir)
    files = _weight_files(p)
    embed = lm = None
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if k.endswith("embed_tokens.weight") and embed is None:
                    embed = sf.get_tensor(k)
                elif k in ("lm_head.weight", "model.lm_head.weight") and lm is None:
                    lm = sf.get_tensor(k)
    if embed is None:
        raise ValueError(f"target folder {str(p)!r} has no embed_tokens.weight")
    return embed, (embed if lm is None else lm)


def _resolve_embeddings(target_embeddings: Any, target: dict) -> tuple[torch.Tensor, torch.Tensor]:
    if target_embeddings is None:
        name = target.get("_name_or_path")
        if name and Path(name).is_dir():
            return load_target_embeddings(name)
        raise ValueError("this drafter is compact (shares the target's embedding and lm_head): "
                         "pass target_embeddings=(embed_weight, lm_head_weight) or a target config "
                         "that names its model folder")
    if torch.is_tensor(target_embeddings):
        return target_embeddings, target_embeddings
    if isinstance(target_embeddings, Mapping):
        e = target_embeddings.get("embed_tokens", target_embeddings.get("embed"))
        lm = target_embeddings.get("lm_head", e)
        if e is None:
            raise ValueError("target_embeddings dict needs an 'embed_tokens' entry")
        return e, lm
    if isinstance(target_embeddings, (tuple, list)) and len(target_embeddings) == 2:
        e, lm = target_embeddings
        return e, (e if lm is None else lm)
    raise ValueError("target_embeddings must be a tensor (tied), a pair (embed, lm_head) or a dict")


# ---------------------------------------------------------------------------------------
# load / save
# ---------------------------------------------------------------------------------------


def load_drafter(path: str | os.PathLike, target_config: Any, target_embeddings: Any = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DSparkDrafter:
    """Load a DeepSpec-format drafter that fits ``target_config`` (see check_drafter_fits).

    ``target_embeddings``: the target's embedding / lm_head weights (tensor if tied, a pair,
    or a dict ``{"embed_tokens": ..., "lm_head": ...}``). Required by compact checkpoints
    unless ``target_config`` names the target's model folder; ignored otherwise.
    ``dtype``: float32 by default (bf16 matmuls are slow on CPUs without bf16 units)."""
    from safetensors.torch import load_file

    p = Path(path)
    cfg = check_drafter_fits(p, target_config)
    target = target_config_dict(target_config)
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(p):
        for k, v in load_file(str(f)).items():
            state[_strip(k)] = v
    drafter = DSparkDrafter(cfg)
    if cfg.shared_embeddings:
        state.pop("embed_tokens.weight", None)
        state.pop("lm_head.weight", None)
        missing, unexpected = drafter.load_state_dict(state, strict=False)
        missing = [m for m in missing if m not in ("embed_tokens.weight", "lm_head.weight")]
    else:
        missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"drafter {str(p)!r}: missing tensors {list(missing)}, unexpected {list(unexpected)}")
    drafter = drafter.to(device=device, dtype=dtype)
    if cfg.shared_embeddings:
        embed, lm = _resolve_embeddings(target_embeddings, target)
        drafter.set_target_embeddings(embed, lm)
    for name in drafter.frozen_parameter_names():
        drafter.get_parameter(name).requires_grad_(False)
    return drafter.eval()


def save_drafter(drafter: DSparkDrafter, path: str | os.PathLike, *, compact: bool | None = None,
                 dtype: torch.dtype | None = torch.bfloat16, extra_config: dict | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in DeepSpec's format.

    ``compact`` (default: the drafter's own ``shared_embeddings`` flag) leaves out
    ``embed_tokens`` / ``lm_head`` and sets ``vllm_ptd_shared_embeddings``. ``dtype``: the
    stored dtype (None keeps the parameters' dtype)."""
    from safetensors.torch import save_file

    cfg = drafter.config
    compact = cfg.shared_embeddings if compact is None else bool(compact)
    out_cfg = cfg.to_dict()
    out_cfg[SHARED_EMBEDDINGS_KEY] = compact
    out_cfg["architectures"] = [ARCHITECTURE]
    out_cfg["torch_dtype"] = str(dtype or drafter.dtype).replace("torch.", "")
    if extra_config:
        out_cfg.update(extra_config)
    tensors = {}
    for k, v in drafter.state_dict().items():
        if compact and k in ("embed_tokens.weight", "lm_head.weight"):
            continue
        t = v.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[k] = t.contiguous().clone()
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(p / WEIGHTS_NAME), metadata={"format": "pt"})
    (p / CONFIG_NAME).write_text(json.dumps(out_cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name in (WEIGHTS_NAME, CONFIG_NAME):
        os.chmod(p / name, 0o644)  # package data: readable by everyone
    return p
