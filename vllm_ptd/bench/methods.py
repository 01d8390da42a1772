"""The methods a benchmark compares, from the command line's ``name:key=value:...``."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

# Five engines: what 24 GiB holds in fp32 with room for batch 16 (see memory.check_memory).
DEFAULT_METHODS = "none,ngram:6,ptd,pctree:mode=chain,pctree"

# suffix decoding without its cross-request cache (see parse_method)
SUFFIX_DEFAULTS = {"suffix_decoding_max_cached_requests": 0}
# PTD reads the texts of the engine's earlier requests, but not those of the same prompt: a
# benchmark repeats its prompts, and every repeat would copy the previous one's outputs
# (as suffix decoding's cache would, which is why it runs without one). Keys override.
TREE_DEFAULTS = {"ptd": {"history_same_prompt": False}}
# vLLM's own example (examples/offline_inference/spec_decode.py) uses these lookup sizes.
NGRAM_DEFAULTS = {"prompt_lookup_min": 2, "prompt_lookup_max": 5}


@dataclass(frozen=True)
class Method:
    label: str            # as given on the command line (unique)
    name: str             # none | ngram | ptd | pctree | fixed
    spec: dict | None     # vLLM speculative_config (None: no speculation)


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _key_values(parts: list[str], label: str) -> dict:
    out = {}
    for kv in parts:
        if "=" not in kv:
            raise ValueError(f"method {label!r}: expected key=value, got {kv!r}")
        k, v = kv.split("=", 1)
        out[k.strip().replace("-", "_")] = _value(v.strip())
    return out


def suffix_available() -> bool:
    """vLLM's ``suffix`` method needs the arctic-inference package (scripts/setup.sh
    --with-suffix builds it)."""
    import importlib.util

    return importlib.util.find_spec("arctic_inference") is not None


def parse_method(text: str) -> Method:
    """``none``, ``ngram:K[:k=v...]``, ``suffix[:k=v...]`` or a tree method
    ``<name>[:k=v...]`` (ptd, pctree, ...: vllm_ptd.methods). ``<name>@<tag>`` runs the same
    method again in an engine of its own (``none@2``: a second plain engine; its ratio to
    ``none`` shows how far two engine processes differ on the same work in that run)."""
    from vllm_ptd.methods import method_names

    label = text.strip()
    parts = label.split(":")
    name, at, tag = parts[0].strip().lower().partition("@")
    if at and not tag.strip():
        raise ValueError(f"method {label!r}: write <name>@<tag>, e.g. none@2")
    if name == "none":
        if len(parts) > 1:
            raise ValueError("method 'none' takes no options")
        return Method(label, "none", None)
    if name == "ngram":
        rest = parts[1:]
        if not rest or "=" in rest[0]:
            raise ValueError(f"method {label!r}: write ngram:K (K = draft tokens per step)")
        k = int(rest.pop(0))
        spec = {"method": "ngram", "num_speculative_tokens": k, **NGRAM_DEFAULTS}
        spec.update(_key_values(rest, label))
        return Method(label, "ngram", spec)
    if name == "suffix":
        # vLLM's suffix decoding (Arctic Inference) with its own defaults except its global
        # cache of earlier responses: a benchmark repeats its prompts, and the cache would
        # serve every repeat after the first from the outputs of the one before. Off, it
        # uses the request's own prompt and output, as PTD and ngram do. Keys override.
        return Method(label, "suffix", {"method": "suffix", **SUFFIX_DEFAULTS,
                                        **_key_values(parts[1:], label)})
    if name in method_names():
        spec = {"method": name, **TREE_DEFAULTS.get(name, {}), **_key_values(parts[1:], label)}
        from vllm_ptd.config import parse_speculative_config

        parse_speculative_config(dict(spec))  # unknown keys / bad values fail here, early
        return Method(label, name, spec)
    raise ValueError(f"unknown method {label!r}: use none, ngram:K, suffix, or one of "
                     f"{', '.join(method_names())} with optional :key=value options")


def parse_methods(text: str, check_installed: bool = True) -> list[Method]:
    """The methods of a comma-separated list, plain decoding first. ``check_installed``: drop
    (with a note) those whose package is missing, as a run must; a report of an earlier run
    keeps them all."""
    methods, seen = [], set()
    for item in text.split(","):
        if not item.strip():
            continue
        m = parse_method(item)
        if m.label in seen:
            raise ValueError(f"method {m.label!r} given twice")
        seen.add(m.label)
        methods.append(m)
    if check_installed and any(m.name == "suffix" for m in methods) and not suffix_available():
        methods = [m for m in methods if m.name != "suffix"]
        print("[bench] skipping suffix: vLLM's suffix decoding needs the arctic-inference "
              "package (bash scripts/setup.sh --with-suffix)")
    if "none" not in seen:  # every ratio needs the plain engine
        methods.insert(0, Method("none", "none", None))
    return methods


def int_list(text: str) -> list[int]:
    vals = [int(x) for x in text.split(",") if x.strip()]
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def safe_label(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
