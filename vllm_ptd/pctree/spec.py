"""PCTree's description for the method registry."""
from __future__ import annotations

from vllm_ptd.method import BuildContext, MethodSpec
from vllm_ptd.pctree.config import PCTreeConfig


def _build(options: PCTreeConfig, ctx: BuildContext):
    from vllm_ptd.pctree.method import PCTreeMethod

    return PCTreeMethod(options, ctx.target_config, ctx.target_embeddings,
                        dtype=options.drafter_torch_dtype(ctx.dtype, ctx.device),
                        device=ctx.device,
                        linear_kernel=options.drafter_linear_kernel(ctx.linear_kernel,
                                                                    ctx.int8_linear_kernel),
                        norm_kernel=ctx.norm_kernel)


def _hidden_layer_ids(options: PCTreeConfig, target_config) -> tuple[int, ...]:
    """The target layers the drafter reads (HF ``output_hidden_states`` indices, which are
    also vLLM's EAGLE-3 aux-layer indices), from the drafter's config alone."""
    from vllm_ptd.pctree.checkpoint import read_drafter_config
    from vllm_ptd.pctree.drafter import hidden_layer_ids_from_target_layer_ids
    from vllm_ptd.pctree.method import resolve_drafter_path

    path = resolve_drafter_path(options.model, target_config)
    return hidden_layer_ids_from_target_layer_ids(read_drafter_config(path).target_layer_ids)


def _engine_overrides(options: PCTreeConfig) -> dict:
    return {"enable_prefix_caching": (
        False, "the drafter's context is the target's hidden states of every prompt row, and "
               "prefix-cache hits skip those rows")}


def _check_engine(options: PCTreeConfig, target_config) -> None:
    from vllm_ptd.pctree.checkpoint import check_drafter_fits
    from vllm_ptd.pctree.method import resolve_drafter_path

    check_drafter_fits(resolve_drafter_path(options.model, target_config), target_config)


METHOD = MethodSpec(name="pctree", config_cls=PCTreeConfig, build=_build, needs_hidden=True,
                    hidden_layer_ids=_hidden_layer_ids, engine_overrides=_engine_overrides,
                    check_engine=_check_engine)
