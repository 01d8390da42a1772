"""EngineArgsPatch: accept ``{"method": "ptd" | "pctree", ...}`` in speculative_config.

vLLM's SpeculativeConfig refuses unknown methods (a pydantic Literal) and unknown keys. This
patch, applied before the engine config is made (for ``LLM(...)`` and the serve command
alike), validates our keys, moves them to ``additional_config["vllm_ptd"]`` (which reaches
every worker) and rewrites the dict to vLLM's ``custom_class`` method pointing at
``TreeProposer``, with ``num_speculative_tokens`` = the largest flattened tree, so the
scheduler's per-step KV reservation always covers a whole tree.
"""
from __future__ import annotations

import dataclasses
import logging
import os

from vllm.engine.arg_utils import EngineArgs

from vllm_ptd.config import PCTreeConfig, PTDConfig, parse_speculative_config
from vllm_ptd.integration.patching import Patch

PROPOSER_CLASS = "vllm_ptd.integration.proposer.TreeProposer"
ADDITIONAL_CONFIG_KEY = "vllm_ptd"

logger = logging.getLogger("vllm_ptd")


def _device_kind() -> str:
    from vllm.platforms import current_platform

    return "cuda" if current_platform.device_type == "cuda" else "cpu"


def rewrite_speculative_config(spec: dict, device: str) -> tuple[dict, dict]:
    """(vLLM's speculative_config, our additional_config entry) for a ptd/pctree dict."""
    parsed = parse_speculative_config(spec)
    opts = parsed.options
    if isinstance(opts, PTDConfig):
        opts = opts.resolved(device)
    tree_nodes = opts.max_tree_nodes
    k = parsed.num_speculative_tokens
    if k is None:
        k = tree_nodes
    elif k < tree_nodes:
        raise ValueError(
            f"speculative_config['num_speculative_tokens'] = {k} is smaller than the largest "
            f"tree ({tree_nodes} nodes); leave it out, it is derived from the tree budgets")
    vllm_spec = {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": k,
                 **parsed.extra_vllm}
    ours = {"method": parsed.method, "options": dataclasses.asdict(opts), "device": device}
    return vllm_spec, ours


class EngineArgsPatch(Patch):
    target = EngineArgs

    def create_engine_config(self, *args, **kwargs):
        spec = self.speculative_config
        if not (isinstance(spec, dict) and spec.get("method") in ("ptd", "pctree")):
            return self._orig_create_engine_config(*args, **kwargs)
        device = _device_kind()
        vllm_spec, ours = rewrite_speculative_config(
            {k.replace("-", "_"): v for k, v in spec.items()}, device)
        self.speculative_config = vllm_spec
        self.additional_config = dict(self.additional_config or {})
        self.additional_config[ADDITIONAL_CONFIG_KEY] = ours
        if ours["method"] == "pctree":
            # The drafter's context is the target's hidden states of every prompt row;
            # prefix-cache hits skip those rows, so the cache must stay off.
            self.enable_prefix_caching = False
        if device == "cuda":
            # The runner patches live in the V1 model runner; tree rows need the Triton
            # attention backend with the project's tree kernel, and FULL CUDA graphs would
            # freeze attention metadata per step, so only PIECEWISE graphs.
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
            if self.attention_backend is None:
                self.attention_backend = "TRITON_ATTN"
            elif str(self.attention_backend).upper().split(".")[-1] != "TRITON_ATTN":
                raise ValueError(f"attention_backend {self.attention_backend!r} cannot carry "
                                 f"vllm-ptd's tree rows; use TRITON_ATTN (or leave it unset)")
            asked = getattr(self.compilation_config, "cudagraph_mode", None)
            if asked is not None and str(asked).upper().split(".")[-1] not in ("PIECEWISE", "NONE"):
                logger.warning("vllm-ptd: cudagraph_mode %s would capture attention (and its "
                               "tree rows) in full CUDA graphs; using PIECEWISE instead", asked)
            if asked is None or str(asked).upper().split(".")[-1] != "NONE":
                self.compilation_config.cudagraph_mode = "PIECEWISE"
        config = self._orig_create_engine_config(*args, **kwargs)
        if ours["method"] == "pctree":
            # refuse a drafter that does not fit here, before any engine process starts
            from vllm_ptd.pctree.checkpoint import check_drafter_fits
            from vllm_ptd.pctree.method import resolve_drafter_path

            hf_config = config.model_config.hf_config
            check_drafter_fits(resolve_drafter_path(ours["options"]["model"], hf_config), hf_config)
        return config
