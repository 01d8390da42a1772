"""PTD's description for the method registry."""
from __future__ import annotations

from vllm_ptd.method import BuildContext, MethodSpec
from vllm_ptd.ptd.config import PTDConfig


def _build(options: PTDConfig, ctx: BuildContext):
    from vllm_ptd.ptd.method import PTDMethod

    decode = None
    if options.seeding == "entity":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ctx.tokenizer)
        decode = lambda t: tok.decode([t])  # noqa: E731
    return PTDMethod(options, ctx.eos_token_ids, decode)


METHOD = MethodSpec(name="ptd", config_cls=PTDConfig, build=_build)
