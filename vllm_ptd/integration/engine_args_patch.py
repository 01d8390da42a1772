"""EngineArgsPatch: accept ``{"method": "ptd" | "pctree" | ..., ...}`` in speculative_config.

vLLM's SpeculativeConfig refuses unknown methods (a pydantic Literal) and unknown keys. This
patch, applied before the engine config is made (for ``LLM(...)`` and the serve command
alike), validates the method's keys, resolves its device- and model-dependent defaults, moves
them to ``additional_config["vllm_ptd"]`` (which reaches every worker) and rewrites the dict
to vLLM's ``custom_class`` method pointing at ``TreeProposer``, with
``num_speculative_tokens`` = the largest flattened tree, so the scheduler's per-step KV
reservation always covers a whole tree. Methods are looked up in :mod:`vllm_ptd.methods`.
"""
from __future__ import annotations

import dataclasses
import logging
import os

from vllm.engine.arg_utils import EngineArgs

from vllm_ptd import LOGGER_NAME
from vllm_ptd.config import ENGINE_KEYS, parse_speculative_config
from vllm_ptd.integration.patching import Patch
from vllm_ptd.methods import find_method, method_names

PROPOSER_CLASS = "vllm_ptd.integration.proposer.TreeProposer"
ADDITIONAL_CONFIG_KEY = "vllm_ptd"

logger = logging.getLogger(LOGGER_NAME)


def _device_kind() -> str:
    from vllm.platforms import current_platform

    return "cuda" if current_platform.device_type == "cuda" else "cpu"


def is_tree_method(spec) -> bool:
    return isinstance(spec, dict) and spec.get("method") in method_names()


def rewrite_speculative_config(spec: dict, device: str, target_config) -> tuple[dict, dict]:
    """(vLLM's speculative_config, our additional_config entry) for a tree-method dict."""
    parsed = parse_speculative_config(spec)
    opts = parsed.options.resolved(device, target_config)
    tree_nodes = opts.max_tree_nodes
    k = parsed.num_speculative_tokens
    if k is None:
        k = tree_nodes
    elif k < tree_nodes:
        raise ValueError(
            f"speculative_config['num_speculative_tokens'] = {k} is smaller than the largest "
            f"tree ({tree_nodes} nodes); leave it out, it is derived from the tree budgets")
    vllm_spec = {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": k}
    ours = {"method": parsed.method, "options": dataclasses.asdict(opts),
            **{key: getattr(parsed, key) for key in ENGINE_KEYS}}
    return vllm_spec, ours


def _target_config(args: EngineArgs):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code,
                                      revision=args.revision)


def _mode_name(value) -> str:
    return str(value).upper().split(".")[-1]


def use_gpu_tree_path(args: EngineArgs) -> None:
    """Engine settings a GPU tree engine needs, set on ``args`` before vLLM builds its
    config. The runner patches live in the V1 model runner; tree rows need the Triton
    attention backend with the project's tree kernel (asked for by ``attention_backend`` or
    ``attention_config.backend``, which vLLM takes as exclusive); FULL CUDA graphs would
    capture attention (and freeze its tree rows), so only PIECEWISE graphs, in which
    attention runs eagerly between the captured pieces. The mode is set as vLLM's enum:
    a string assigned after the config object was built skips its validator, and vLLM's
    config then calls enum methods on it."""
    from vllm.config import CUDAGraphMode

    # (the V1 runner needs no setting: vLLM runs a custom_class proposer on it, and an
    # engine that would run the V2 one is refused once its config is built)
    config_backend = getattr(args.attention_config, "backend", None)
    for name, asked in (("attention_backend", args.attention_backend),
                        ("attention_config.backend", config_backend)):
        if asked is not None and _mode_name(asked) != "TRITON_ATTN":
            raise ValueError(f"{name} {_mode_name(asked)} cannot carry vllm-ptd's tree rows; use "
                             f"TRITON_ATTN (or leave it unset)")
    if args.attention_backend is None and config_backend is None:
        args.attention_backend = "TRITON_ATTN"
    compilation = args.compilation_config
    asked = getattr(compilation, "cudagraph_mode", None)
    if asked is not None and _mode_name(asked) not in ("PIECEWISE", "NONE"):
        logger.warning("vllm-ptd: cudagraph_mode %s would capture attention (and its "
                       "tree rows) in full CUDA graphs; using PIECEWISE instead", asked)
    if asked is None or _mode_name(asked) != "NONE":
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
    keep_tree_ops_eager(compilation)


# the ops whose Python runs the tree: attention rewrites the tree rows, the cache write
# stashes the verify rows' K/V (``TreeKVStashMixin``)
EAGER_OPS = ("vllm::unified_attention_with_output", "vllm::unified_kv_cache_update")
# fusions that move the cache write out of ``do_kv_cache_update`` (the stash would miss the
# step's K/V) or quantize attention's output (the tree rows are not rewritten then)
TREE_BREAKING_FUSIONS = ("fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache", "fuse_attn_quant")


def keep_tree_ops_eager(compilation) -> None:
    """Keep attention and the KV-cache write outside every captured CUDA graph, each step's
    Python running: vLLM's default piecewise split does (its splitting ops are both), and
    three settings would not, each turned back here with a warning naming it: Inductor's
    graph partition (which splits at attention only, capturing the cache write), a
    ``splitting_ops`` list without them, and the fusions in ``TREE_BREAKING_FUSIONS``."""
    if getattr(compilation, "use_inductor_graph_partition", None):
        logger.warning("vllm-ptd: use_inductor_graph_partition would capture the KV-cache "
                       "write, where the tree's K/V are kept, in CUDA graphs; turned off")
        compilation.use_inductor_graph_partition = False
    ops = getattr(compilation, "splitting_ops", None)
    if ops:  # a list of the user's own; None: vLLM's, which has both
        for op in EAGER_OPS:
            if op not in ops:
                logger.warning("vllm-ptd: splitting_ops gains %s (tree speculation runs "
                               "Python there every step)", op)
                ops.append(op)
    passes = getattr(compilation, "pass_config", None)
    for name in TREE_BREAKING_FUSIONS:
        if passes is None or not hasattr(passes, name) or getattr(passes, name) is False:
            continue
        if getattr(passes, name):
            logger.warning("vllm-ptd: pass_config.%s cannot carry tree rows; turned off", name)
        setattr(passes, name, False)


def refuse_what_trees_cannot_carry(config, device: str = "cpu") -> None:
    """Engine features a tree step would silently get wrong, refused with a line naming
    them: on GPU, vLLM's V2 model runner, which the runner patches do not reach (CPU engines
    run their own runner); a recurrent (hybrid) model advances its state along the tree rows in order, not
    along the accepted path; M-RoPE models read their positions from a buffer the tree's
    positions are not written to; a KV connector saves the step's cache before the
    accepted rows are moved into place; breakable CUDA graphs capture the KV-cache write,
    where the tree's K/V are kept."""
    model = config.model_config
    found = []
    if device == "cuda" and getattr(config, "use_v2_model_runner", False):
        found.append("vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1, or a feature that "
                     "needs it)")
    if getattr(model, "is_hybrid", False):
        found.append("a hybrid (recurrent-state) model")
    if getattr(model, "uses_mrope", False):
        found.append("M-RoPE positions")
    if getattr(config, "kv_transfer_config", None) is not None:
        found.append("a KV connector (kv_transfer_config)")
    if os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "0") == "1":
        found.append("VLLM_USE_BREAKABLE_CUDAGRAPH=1")
    if found:
        raise ValueError(f"vllm-ptd tree speculation cannot run with {', '.join(found)}")


def warn_of_dropped_logits_processors() -> list[str]:
    """Logits-processor plugins installed (entry points ``vllm.logits_processors``) act on
    every request in plain decoding; vLLM does not load them once any speculative method is
    configured (``logits_processors=`` it refuses outright), so outputs would differ from
    plain decoding's without a word. Says so, naming them; returns their names."""
    from importlib.metadata import entry_points

    names = sorted(e.name for e in entry_points(group="vllm.logits_processors"))
    if names:
        logger.warning("vllm-ptd: the logits-processor plugins %s are installed, and vLLM does "
                       "not apply them with speculative decoding: outputs will differ from "
                       "plain decoding with them", ", ".join(names))
    return names


class EngineArgsPatch(Patch):
    target = EngineArgs

    def create_engine_config(self, *args, **kwargs):
        orig = EngineArgsPatch.original("create_engine_config")
        spec = self.speculative_config
        if not is_tree_method(spec):
            return orig(self, *args, **kwargs)
        if (self.pipeline_parallel_size or 1) > 1:
            raise ValueError(
                f"pipeline_parallel_size = {self.pipeline_parallel_size}: vllm-ptd's tree "
                f"verification needs every layer's K/V and the logits on the ranks that walk "
                f"the trees; use tensor parallelism (tensor_parallel_size) instead")
        device = _device_kind()
        vllm_spec, ours = rewrite_speculative_config(
            {k.replace("-", "_"): v for k, v in spec.items()}, device, _target_config(self))
        method = find_method(ours["method"])
        self.speculative_config = vllm_spec
        self.additional_config = dict(self.additional_config or {})
        self.additional_config[ADDITIONAL_CONFIG_KEY] = ours
        options = method.config_cls(**ours["options"])
        for name, (value, why) in (method.engine_overrides(options) if method.engine_overrides
                                   else {}).items():
            if getattr(self, name, None) != value:
                logger.info("vllm-ptd %s: %s = %r (%s)", method.name, name, value, why)
            setattr(self, name, value)
        if device == "cuda":
            use_gpu_tree_path(self)
        config = orig(self, *args, **kwargs)
        refuse_what_trees_cannot_carry(config, device)
        warn_of_dropped_logits_processors()
        max_len = config.model_config.max_model_len
        k = vllm_spec["num_speculative_tokens"]
        if k + 1 > max_len:
            raise ValueError(
                f"the tree budget of {k} nodes per step (num_speculative_tokens, from the "
                f"method's node budgets) does not fit max_model_len {max_len}; lower the "
                f"budgets below {max_len - 1} nodes")
        if method.check_engine is not None:
            # refuse what cannot run here before any engine process starts
            method.check_engine(options, config.model_config.hf_config)
        return config
