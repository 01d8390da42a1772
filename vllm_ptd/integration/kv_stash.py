"""TreeKVStashMixin: keep a copy of the verify rows' K/V of each layer, write accepted rows
to their final slots. Shared by the CPU and GPU tree backends.

After the walk, accepted node k of a path must sit in the KV slot of position c + 1 + k,
but the forward wrote it to the slot of its tree row. The mixin copies the K/V of every row
that can be accepted (the verify nodes) while the forward writes the cache, and the
proposer later re-writes the accepted ones through the backend's own cache writer, so any
KV layout and dtype works.

Why a copy: under torch.compile the ``key``/``value`` handed to the cache-update op are
buffers of the compiled graph, and inductor reuses those buffers for later layers'
intermediates once the op returns. A reference kept past the op reads whatever the graph
wrote there next (eager mode keeps the tensor alive, which hid this).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_ptd.integration.step import StepChannel


class StashedKV(NamedTuple):
    impl: object                # the layer's attention impl (owner of the cache writer)
    layer: torch.nn.Module
    key: torch.Tensor           # [V, num_kv_heads, head_dim] copy, V = the step's verify rows
    value: torch.Tensor
    kv_cache: torch.Tensor      # the layer's paged cache (written in place)
    slot_mapping: torch.Tensor  # [num_tokens] the step's slot of every batch row


class TreeKVStashMixin:
    """Mix in before a vLLM attention impl that has ``do_kv_cache_update``. Also the mark of
    a tree attention impl: ``tree_channel`` is set by ``bind_tree_attention`` when the model
    is loaded (None: no tree method runs, the impl is vLLM's own)."""

    tree_channel: StepChannel | None = None

    def refuse_what_tree_rows_leave_out(self) -> None:
        """Call at the end of ``__init__``: attention features vLLM's kernel applies to every
        row and the tree rows' path does not are refused, not lost (the tree rows attend
        causally over prefix and ancestors, nothing else)."""
        from vllm.v1.attention.backend import AttentionType

        window = getattr(self, "sliding_window", None)  # CPU: -1 for none; Triton: (-1, -1)
        if isinstance(window, tuple):
            window = window[0]
        features = {"ALiBi": getattr(self, "alibi_slopes", None) is not None,
                    "a sliding window": window not in (None, -1),
                    "attention sinks": getattr(self, "sinks", None) is not None,
                    "a logit soft-cap": bool(getattr(self, "logits_soft_cap", 0)),
                    "chunked local attention": getattr(self, "chunk_lookback", -1) != -1,
                    "non-decoder attention": getattr(self, "attn_type", AttentionType.DECODER)
                    != AttentionType.DECODER}
        used = [name for name, on in features.items() if on]
        if used:
            raise ValueError(f"vllm-ptd tree attention supports plain causal decoder attention; "
                             f"this model uses {', '.join(used)}")

    @property
    def tree_step(self):
        return self.tree_channel.step if self.tree_channel is not None else None

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        step = self.tree_step
        if step is None or kv_cache.numel() == 0 or step.num_verify_rows == 0:
            return
        rows = step.verify_rows_on(key.device)
        step.kv_stash[id(layer)] = StashedKV(self, layer, key[rows], value[rows], kv_cache,
                                             slot_mapping)

    def write_kv_rows(self, layer, key, value, kv_cache, slots) -> None:
        """Write K/V rows to the given slots with the backend's own cache writer."""
        super().do_kv_cache_update(layer, key, value, kv_cache, slots)


def bind_tree_attention(runner, channel: StepChannel) -> None:
    """Hand the step channel to every attention layer of the runner's model. Every layer
    must run the project's tree backend: any other backend would attend causally over the
    tree rows and keep no K/V for the accepted-row moves, so the output would silently
    differ from plain decoding."""
    impls = [layer.impl for layer in runner.compilation_config.static_forward_context.values()
             if getattr(layer, "impl", None) is not None]
    other = sorted({type(impl).__name__ for impl in impls
                    if not isinstance(impl, TreeKVStashMixin)})
    if other:
        want = "CPU_ATTN" if runner.device.type == "cpu" else "TRITON_ATTN"
        raise ValueError(f"vllm-ptd tree speculation needs the {want} attention backend with "
                         f"tree rows; this model's attention layers use {', '.join(other)}")
    for impl in impls:
        impl.tree_channel = channel
