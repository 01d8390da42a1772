"""TreeProposer: the per-step driver of a tree method inside vLLM's model runner.

vLLM knows it as a ``custom_class`` proposer. The runner patch calls it at three points of
one engine step:

1. ``prepare_step`` (end of ``_prepare_inputs``): look up each decoding request's stored tree,
   cut it to what the scheduler kept, rewrite the tree rows' positions (root + depth) and
   open the step on the channel the attention backends read.
2. ``verify`` (instead of the rejection sampler): greedy or sampling tree walk per request,
   move the accepted rows' K/V to the slots of their final positions, hand vLLM
   ``[accepted tokens..., bonus]`` per request.
3. ``propose`` (instead of vLLM's drafting call): feed the outcome back to the method (PTD
   grows its draft tree and pool; PCTree appends hidden states) and return next step's
   flattened trees.

Tensor parallelism: every rank runs the model and the tree attention, but only the first
rank of the tensor-parallel group drafts (its tokens are the ones vLLM schedules): in
``prepare_step`` it broadcasts the scheduled trees' shapes, so every rank lays out the same
rows, masks and positions, walks the same logits and moves the same K/V.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from vllm_ptd import LOGGER_NAME
from vllm_ptd.budget import (MISS_BACKOFFS, REALIZED_MARGIN, AcceptanceModel, StepCostModel,
                             TreeBudget, makespan_lead, makespan_weights)
from vllm_ptd.integration.kv_stash import bind_tree_attention
from vllm_ptd.integration.step_clock import StepClock
from vllm_ptd.integration.step import StepChannel, TreeStep, build_step
from vllm_ptd.method import BuildContext, StepOutcome, TreeMethod
from vllm_ptd.methods import find_method
from vllm_ptd.metrics import SpecMetrics
from vllm_ptd.tree import FlatTree
from vllm_ptd.verify import greedy_walk, row_argmax, sampling_walk, target_probs

logger = logging.getLogger(LOGGER_NAME)

GREEDY_EPS = 1e-5  # vLLM treats temperatures below this as greedy
# the tree of a request that ran without one (shared: outcomes only read it)
NO_TREE = FlatTree()
LOG_EVERY_STEPS = 500
SAVE_COST_EVERY_STEPS = 256
# cost of one more row relative to a one-row step, before anything is measured
PRIOR_ROW_SLOPE = {"cpu": 0.15, "cuda": 0.01}


def cost_cache_path(vllm_config, device_type: str, method: str) -> Path | None:
    """Where this machine's measured step costs for this model, engine set-up and method
    (whose drafting is part of the per-step overhead) are kept
    (``$VLLM_PTD_CACHE/cost/<key>.json``, default ``~/.cache/vllm_ptd``); None when
    ``VLLM_PTD_COST_CACHE=0``."""
    if os.environ.get("VLLM_PTD_COST_CACHE", "1") == "0":
        return None
    import torch

    if device_type == "cuda":
        machine = torch.cuda.get_device_name()
    else:
        machine = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                machine = next((ln.split(":", 1)[1].strip() for ln in f
                                if ln.startswith("model name")), machine)
        except OSError:
            pass
    mc = vllm_config.model_config
    key = json.dumps([method, machine, os.cpu_count(), torch.get_num_threads(), str(mc.model),
                      str(mc.dtype), str(vllm_config.compilation_config.mode),
                      vllm_config.parallel_config.tensor_parallel_size])
    root = Path(os.environ.get("VLLM_PTD_CACHE", Path.home() / ".cache" / "vllm_ptd"))
    return root / "cost" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


def _eos_ids(model_config) -> list[int]:
    ids: set[int] = set()
    for source in (model_config.hf_config, getattr(model_config, "hf_text_config", None)):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_config.model).eos_token_id
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    except Exception:  # no generation_config.json: the model config's ids are all there is
        pass
    return sorted(ids)


def _speculation_allowed(params) -> bool:
    """Tree walks implement temperature/top-p/top-k; requests asking for what they do not
    (logprobs, penalties, logit processors, structured output, a thinking budget, whose
    end vLLM's sampler forces) decode without a tree. So does a seeded request that
    samples: its draws would follow the shapes of its trees, which the budget sizes from
    measured times, and the same seed must give the same text (without a tree its draws
    are plain decoding's)."""
    if params is None:
        return False
    seeded_sampling = params.seed is not None and params.temperature >= GREEDY_EPS
    return (params.logprobs is None and params.prompt_logprobs is None
            and getattr(params, "logprob_token_ids", None) is None
            and not params.presence_penalty and not params.frequency_penalty
            and params.repetition_penalty == 1.0 and not params.bad_words
            and not params.logit_bias and not params.allowed_token_ids
            and not params.min_tokens and params.structured_outputs is None
            and not getattr(params, "min_p", 0.0)
            and getattr(params, "thinking_token_budget", None) is None
            and not seeded_sampling)


def _plain_argmax_samples(sm, spec_meta, rows_b: list[int]) -> bool:
    """Whether vLLM's sampler would give each of the batch rows ``rows_b`` (requests without
    drafts this step) the plain argmax of its logits row: every request greedy, no logprobs
    asked for, and nothing that edits logits before the argmax (allowed or bad tokens,
    penalties, a thinking budget, a logits processor that is not one of vLLM's built-in
    min-tokens and logit-bias ones or has a request to act on)."""
    if (not sm.all_greedy or sm.max_num_logprobs is not None
            or getattr(sm, "logprob_token_ids", None)):
        return False
    if (sm.allowed_token_ids_mask is not None or sm.bad_words_token_ids
            or not sm.no_penalties):
        return False
    holder = getattr(sm, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return False
    for processor in sm.logitsprocs.non_argmax_invariant:
        name = type(processor).__name__
        if not ((name == "MinTokensLogitsProcessor" and not processor.min_toks)
                or (name == "LogitBiasLogitsProcessor" and not processor.biases)):
            return False
    num_draft = spec_meta.num_draft_tokens
    return all(num_draft[b] == 0 for b in rows_b)


def gather_rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``hidden[rows]``, a tensor of its own (views of the step's tensor would keep all of
    it, a long prompt's rows among them, alive while a method queues them). Rows that lie
    next to each other (a decode step where no tree node was accepted) are sliced and
    copied instead of gathered through an index tensor: one op where there were three."""
    first = rows[0]
    if rows[-1] - first + 1 == len(rows) and rows == list(range(first, first + len(rows))):
        block = hidden[first: first + len(rows)]
        return block if len(rows) == hidden.shape[0] else block.clone()
    return hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=hidden.device))


def accepted_kv_moves(step: TreeStep, paths: list[list[int]]) -> tuple[list[int], list[int]]:
    """K/V moves of the accepted paths (``paths[i]``: request i's accepted node indices,
    root to leaf): (index into the step's stashed verify rows, batch row whose slot is the
    node's final position). Node k of a path belongs at position c + 1 + k, the slot vLLM
    gave row k of the request; nodes already there are skipped (the CPU backend, which lays
    other paths over those slots, puts them back: ``cpu_attention``)."""
    src, dst = [], []
    for i, path in enumerate(paths):
        r0, v0 = int(step.row_start[i]), step.verify_offsets[i]
        for k, node in enumerate(path):
            if node != k:
                src.append(v0 + node)
                dst.append(r0 + 1 + k)
    return src, dst


def move_kv(step: TreeStep, src_verify_rows: list[int], dst_rows: list[int]) -> None:
    """Re-write stashed verify rows' K/V into the slots of the given batch rows, through each
    layer's own cache writer (so any KV layout and dtype works). The index tensors are made
    once for all layers."""
    if not src_verify_rows:
        return
    src = dst = None
    for stash in step.kv_stash.values():
        if src is None:
            src = torch.tensor(src_verify_rows, device=stash.key.device)
            dst = torch.tensor(dst_rows, device=stash.slot_mapping.device)
        stash.impl.write_kv_rows(stash.layer, stash.key[src], stash.value[src], stash.kv_cache,
                                 stash.slot_mapping[dst])


def _cpu_vllm_ops(device: torch.device):
    """vLLM's custom ops module on a CPU device (importing it registers its ops), else None."""
    if device.type != "cpu":
        return None
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return None
    return ops


def _cpu_onednn_ops(device: torch.device):
    """vLLM's custom ops where they carry its oneDNN GEMMs (a CPU build), else None."""
    ops = _cpu_vllm_ops(device)
    return ops if getattr(ops, "_supports_onednn", False) else None


def engine_linear_kernel(device: torch.device):
    """The GEMM vLLM runs the target's linear layers with, for a method's own layers: on CPU,
    vLLM's oneDNN GEMM over a weight prepacked once (``ops.create_onednn_mm``; torch's CPU
    GEMM is several times slower at a drafter block's few rows); elsewhere None (torch's,
    i.e. cuBLAS). Each prepared weight is a copy held by the method. A weight whose GEMM
    oneDNN cannot build here runs on torch's: bf16 on a CPU without bf16 units (an AVX2-only
    AMD EPYC: "could not create a primitive descriptor for the matmul primitive"), which
    stopped a bf16 PCTree engine at start there."""
    ops = _cpu_onednn_ops(device)
    if ops is None:
        return None

    def make(weight: torch.Tensor, bias: torch.Tensor | None):
        try:
            handler = ops.create_onednn_mm(weight.t(), 32)
        except RuntimeError:
            w = weight.detach().clone()
            b = None if bias is None else bias.detach().clone()
            return lambda x: torch.nn.functional.linear(x, w, b)
        return lambda x: ops.onednn_mm(handler, x, bias)

    return make


def engine_int8_linear_kernel(device: torch.device):
    """Like :func:`engine_linear_kernel`, with int8 weights and activations: on CPU, vLLM's
    oneDNN int8 GEMM (``ops.create_onednn_scaled_mm``, as its W8A8 layers run) over a
    weight quantized once per output row, each call quantizing its input per row; elsewhere
    None. The output keeps the input's dtype. For a drafter only: its drafts choose what is
    verified, never what is output. Why: at a block's 28 rows (4 requests) its GEMMs took
    about 0.6 of the bf16 GEMM's time here (a 2-core AMD EPYC with AVX512-BF16 and VNNI,
    one thread: 4096 x 576 over 28 rows 395 against 637 us), with a relative error of about
    1 % against 0.3 %."""
    ops = _cpu_onednn_ops(device)
    if ops is None or not hasattr(ops, "create_onednn_scaled_mm"):
        return None

    def make(weight: torch.Tensor, bias: torch.Tensor | None):
        w = weight.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        quantized = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        out_features, in_features = weight.shape
        handler = ops.create_onednn_scaled_mm(quantized.t(), scale, weight.dtype, True, False, 32)
        # the handler reads the quantized weight and its scales where they lie: keep them
        handler.weight_and_scales = (quantized, scale)

        def run(x: torch.Tensor) -> torch.Tensor:
            rows = x.reshape(-1, in_features)
            xq, x_scale, _ = ops.onednn_scaled_int8_quant(rows, None, None, True)
            out = torch.empty(rows.shape[0], out_features, dtype=weight.dtype, device=x.device)
            ops.onednn_scaled_mm(handler, xq, out, x_scale, None, None, None)
            if bias is not None:
                out += bias
            return out.view(*x.shape[:-1], out_features)

        return run

    return make


def engine_rms_norm_kernel(device: torch.device):
    """vLLM's RMS norm op for a method's own norms, ``make(weight, eps) -> fn(x)``: on CPU,
    where the op is built; elsewhere None (torch's). Its input is made contiguous: the op
    reads rows at a fixed stride and gives wrong values for a view of a wider tensor (a
    head's slice of a fused projection). In bf16 it rounds once where torch's rounds twice."""
    if _cpu_vllm_ops(device) is None:
        return None
    try:
        op = torch.ops._C.rms_norm
    except (AttributeError, RuntimeError):  # a build without the op
        return None

    def make(weight: torch.Tensor, eps: float):
        def run(x: torch.Tensor) -> torch.Tensor:
            x = x.contiguous()
            out = torch.empty_like(x)
            op(out, x, weight, eps)
            return out

        return run

    return make


class TreeProposer:
    def __init__(self, vllm_config) -> None:
        entry = (vllm_config.additional_config or {}).get("vllm_ptd")
        if entry is None:
            raise RuntimeError("TreeProposer is set up by speculative_config method 'ptd' or "
                               "'pctree' (with the vllm-ptd plugin loaded), not by hand")
        self.spec = find_method(entry["method"])
        self.kind: str = self.spec.name
        self.options = self.spec.config_cls(**entry["options"])
        self.disable_by_batch_size: int | None = entry.get("disable_by_batch_size")
        self.request_calibration: bool = entry.get("request_calibration", True)
        self.realized_margin: float | None = entry.get("realized_margin", REALIZED_MARGIN)
        self.miss_backoff: str = entry.get("miss_backoff", MISS_BACKOFFS[0])
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.max_model_len = vllm_config.model_config.max_model_len
        self.num_spec = vllm_config.speculative_config.num_speculative_tokens
        self.method: TreeMethod | None = None  # built in load_model
        self.runner = None
        self.tp_group = None   # the tensor-parallel group when it has more than one rank
        self.is_driver = True  # drafts (the first rank of the tensor-parallel group)
        self.channel = StepChannel()
        self.trees: dict[str, FlatTree] = {}        # what the scheduler got last step
        self.outcomes: dict[str, StepOutcome] = {}  # what this step's verification found
        self.prompt_hidden: dict[str, list[torch.Tensor]] = {}
        self.metrics = SpecMetrics()
        self._steps = 0
        self.budget: TreeBudget | None = None  # made in bind (needs the device)
        # the budget's last sizing, for its calibration and the trace: accepted tokens it
        # expected per request, the step milliseconds it expected, the batch it sized for
        self._expected: dict[str, float] = {}
        self._predicted_ms = 0.0
        self._sized_requests = 0
        # requests the scheduler had waiting this step (SchedulerPatch; None: not known),
        # and whether requests arrived while others ran (then the batch has no end to aim at)
        self._num_waiting: int | None = None
        self._open_batch = False
        self.clock = StepClock()
        self.channel.clock = self.clock
        trace = os.environ.get("VLLM_PTD_TRACE")
        self.trace = open(trace, "a", buffering=1) if trace else None

    # ---- set-up -----------------------------------------------------------------------
    @property
    def needs_hidden(self) -> bool:
        return self.spec.needs_hidden

    def hidden_layer_ids(self) -> tuple[int, ...]:
        """The target layers the method reads (the GPU runner asks before the model loads)."""
        return self.spec.hidden_layer_ids(self.options, self.model_config.hf_config)

    def bind(self, runner) -> None:
        self.runner = runner
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        if group.world_size > 1:
            self.tp_group = group
            self.is_driver = group.rank_in_group == 0
        if getattr(self.options, "budget", "fixed") != "fixed" and self.is_driver:
            kind = "cuda" if runner.device.type == "cuda" else "cpu"
            self.budget = TreeBudget(
                StepCostModel(PRIOR_ROW_SLOPE[kind],
                              cost_cache_path(self.vllm_config, kind, self.kind)),
                AcceptanceModel(request_calibration=self.request_calibration),
                realized_margin=self.realized_margin, miss_backoff=self.miss_backoff)

    def load_model(self, target_model) -> None:
        """vLLM's runners (CPU and GPU alike) call this after loading the target."""
        if self.method is not None:
            return
        bind_tree_attention(self.runner, self.channel)
        if not self.is_driver:
            return  # other ranks draft nothing: their trees come from the first rank
        vocab = self.model_config.hf_config.vocab_size
        embed = target_model.model.embed_tokens.weight[:vocab]  # vLLM's decoder-only layout
        lm_head = getattr(target_model, "lm_head", None)
        head = lm_head.weight[:vocab] if lm_head is not None and hasattr(lm_head, "weight") else embed
        if self.tp_group is not None and self.spec.needs_hidden:
            # a tensor-parallel rank holds a slice of the vocabulary; a drafter that shares
            # the target's embeddings needs all of it, read once from the checkpoint
            from vllm_ptd.pctree.checkpoint import load_target_embeddings

            dev, dt = embed.device, embed.dtype
            embed, head = (t.to(dev, dt) for t in load_target_embeddings(self.model_config.model))
        ctx = BuildContext(target_config=self.model_config.hf_config,
                           eos_token_ids=_eos_ids(self.model_config),
                           tokenizer=self.model_config.tokenizer, device=embed.device,
                           dtype=embed.dtype, target_embeddings=(embed, head),
                           linear_kernel=engine_linear_kernel(embed.device),
                           int8_linear_kernel=engine_int8_linear_kernel(embed.device),
                           norm_kernel=engine_rms_norm_kernel(embed.device))
        self.method = self.spec.build(self.options, ctx)
        t0 = time.perf_counter()
        self.method.warm_up()
        logger.info("vllm-ptd %s: drafting warmed up in %.0f ms", self.kind,
                    1000 * (time.perf_counter() - t0))

    def num_offered(self, req_id: str, sent: int) -> int:
        """Candidate (verify) nodes among the ``sent`` leading tokens of the request's tree:
        what vLLM's spec-decode counters count as drafted."""
        tree = self.trees.get(req_id)
        return min(tree.num_verify, sent) if tree is not None else sent

    # ---- request life cycle -----------------------------------------------------------
    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self.trees.pop(req_id, None)
            self.outcomes.pop(req_id, None)
            self.prompt_hidden.pop(req_id, None)
            if self.method is not None:
                self.method.finish(req_id)
            if self.budget is not None:
                self.budget.forget(req_id)

    def num_tracked(self) -> int:
        return len(self.trees) + len(self.outcomes) + len(self.prompt_hidden) + (
            self.method.num_requests() if self.method is not None else 0)

    # ---- 1. before the forward --------------------------------------------------------
    def prepare_step(self, scheduler_output, num_scheduled_tokens: np.ndarray) -> None:
        self.channel.close()
        self._time_step(int(scheduler_output.total_num_scheduled_tokens),
                        int(self.runner.input_batch.num_reqs))
        self._num_waiting = getattr(scheduler_output, "vllm_ptd_num_waiting", None)
        self._open_batch = bool(getattr(scheduler_output, "vllm_ptd_open_batch", False))
        spec = scheduler_output.scheduled_spec_decode_tokens
        if not spec:
            return
        ib = self.runner.input_batch
        qsl = self.runner.query_start_loc.np
        req_ids, batch_idx, trees, starts, ctx, proposed = [], [], [], [], [], []
        for b, req_id in enumerate(ib.req_ids[: ib.num_reqs]):
            scheduled = spec.get(req_id)
            if not scheduled:
                continue
            stored = self.trees.get(req_id)
            n = len(scheduled)
            if stored is None or stored.tokens[:n] != list(scheduled):
                # Drafts the proposer did not make (cannot happen unless vLLM zeroed them):
                # verify them as the chain vLLM thinks they are.
                stored = FlatTree(list(scheduled), list(range(-1, n - 1)))
            assert num_scheduled_tokens[b] == n + 1, "a tree request must be one decode row + tree"
            req_ids.append(req_id)
            batch_idx.append(b)
            trees.append(stored.truncated(n))
            proposed.append(stored.num_nodes)
            starts.append(int(qsl[b]))
            ctx.append(int(ib.num_computed_tokens_cpu[b]))
        if not trees:
            return
        if self.tp_group is not None:
            trees = self._shared_trees(trees)
        step = build_step(req_ids, batch_idx, trees, starts, ctx, self.runner.positions)
        step.proposed_nodes = proposed
        self.clock.set_trees(len(trees), sum(t.num_nodes for t in step.trees),
                             self._predicted_ms)
        self.channel.open(step)

    def _shared_trees(self, trees: list[FlatTree]) -> list[FlatTree]:
        """The first rank's tree shapes on every rank (the tokens are the scheduler's, the same
        everywhere): one broadcast per step over the group's CPU channel."""
        shapes = [(t.parents, t.num_verify, t.causal_from) for t in trees] if self.is_driver else None
        shapes = self.tp_group.broadcast_object(shapes, src=0)
        if self.is_driver:
            return trees
        return [FlatTree(t.tokens, list(p), nv, cf) for t, (p, nv, cf) in zip(trees, shapes)]

    def _time_step(self, rows: int, requests: int) -> None:
        """Close the last step's clock: its forward time and overhead are the cost model's
        samples (a step followed by the engine waiting has no overhead sample: its host work
        went into ``idle_ms``), and with ``VLLM_PTD_TRACE`` its record goes to the trace."""
        record = self.clock.start_step(rows, requests)
        if record is None:
            return
        if self.budget is not None and record["forward_ms"] > 0:
            # drafting is charged by the budget where it is known, not as step overhead
            overhead = record["wall_ms"] - record["forward_ms"] - record["drafting_ms"]
            self.budget.observe_step(record["rows"], record["forward_ms"],
                                     None if record["idle_ms"] > 0 else overhead,
                                     record["trees"], record["requests"], record["nodes"],
                                     record["predicted_ms"],
                                     record["wall_ms"] - record["drafting_ms"],
                                     accepted=record["accepted"])
            if self.budget.cost.samples % SAVE_COST_EVERY_STEPS == 0:
                self.budget.cost.save()
        if self.trace is not None:
            self.trace.write(json.dumps({"step": {k: round(v, 3) for k, v in record.items()}})
                             + "\n")

    def forward_done(self) -> None:
        """Called when the step's logits exist (start of sampling)."""
        self.clock.forward_done()

    # ---- 2. instead of the rejection sampler ------------------------------------------
    def verify(self, logits: torch.Tensor, spec_meta, orig_sample) -> "SamplerOutput":  # noqa: F821
        """The step's tokens for every request, in named steps: vLLM's sampler for requests
        without a tree, the argmax at every tree row, the walks, the record of what each
        request learnt, the K/V moves; the output is built on the host and copied once."""
        with self.clock.part("verify"):
            return self._verify(logits, spec_meta, orig_sample)

    def _verify(self, logits: torch.Tensor, spec_meta, orig_sample):
        from vllm.v1.outputs import SamplerOutput

        step = self.channel.step
        sm = self.runner.input_batch.sampling_metadata
        num_draft = np.asarray(spec_meta.num_draft_tokens, dtype=np.int64)
        out = np.full((len(num_draft), int(num_draft.max()) + 1), -1, dtype=np.int32)
        # logits row of each request's root: requests own num_draft + 1 consecutive rows
        logits_start = np.cumsum(num_draft + 1) - (num_draft + 1)
        # the target's argmax at every row, once: the tree rows' (the greedy walk's input
        # and what PTD's draft rows predicted) and the plain requests' (their token, when
        # vLLM's sampler would take nothing else)
        argmax = row_argmax(logits).cpu().numpy()
        logprobs = self._sample_untreed(logits, spec_meta, orig_sample, step, sm, out,
                                        argmax[logits_start])
        root_rows = logits_start[step.batch_indices]
        tree_argmax = [argmax[r: r + 1 + t.num_nodes].tolist()
                       for r, t in zip(root_rows, step.trees)]
        walks = self._walk(logits, step, sm, root_rows, tree_argmax)
        for i, (_, committed) in enumerate(walks):
            out[step.batch_indices[i], : len(committed)] = committed
        self._record(step, tree_argmax, walks)
        move_kv(step, *accepted_kv_moves(step, [accepted for accepted, _ in walks]))
        return SamplerOutput(sampled_token_ids=torch.from_numpy(out).to(logits.device),
                             logprobs_tensors=logprobs)

    @staticmethod
    def _sample_untreed(logits, spec_meta, orig_sample, step: TreeStep, sm, out: np.ndarray,
                        first_row_argmax: np.ndarray):
        """Requests without a tree go through vLLM's own sampler, unchanged, and so do their
        logprobs: returned in vLLM's layout (one row per request and output column), the
        step's ``logprobs_tensors``. The sampler also draws for the tree requests (as
        chains); their seeded generators are kept untouched, and their logprobs rows are
        never read (a request that asks for logprobs gets no tree). Where the sampler would
        only take each row's argmax (``_plain_argmax_samples``), that argmax
        (``first_row_argmax``: each request's first logits row) is their token."""
        tree_b = set(step.batch_indices)
        if len(tree_b) == out.shape[0] and sm.max_num_logprobs is None:
            return None
        keep = [b for b in range(out.shape[0]) if b not in tree_b]
        if _plain_argmax_samples(sm, spec_meta, keep):
            # each of them has a single row (no drafts): what vLLM's sampler would return,
            # without running it (and its copy of the logits) over every row of the step
            out[keep, 0] = first_row_argmax[keep]
            return None
        saved = {b: sm.generators[b].get_state() for b in step.batch_indices if b in sm.generators}
        theirs = orig_sample(logits.clone(), spec_meta)
        for b, state in saved.items():
            sm.generators[b].set_state(state)
        out[keep] = theirs.sampled_token_ids[keep, : out.shape[1]].cpu().numpy()
        return theirs.logprobs_tensors

    @staticmethod
    def _walk(logits, step: TreeStep, sm, root_rows,
              tree_argmax: list[list[int]]) -> list[tuple[list[int], list[int]]]:
        """(accepted node indices, committed tokens) per tree request (``tree_argmax[i]``:
        the argmax at its root then at each node): the greedy walk on the host (a walk
        visits a few nodes, so a Python loop per request takes microseconds where batched
        tensor ops took 0.3-0.8 ms), then the sampling walk for requests that sample."""
        walks = [greedy_walk(tree, am[0], am[1:]) for tree, am in zip(step.trees, tree_argmax)]
        if sm.all_greedy or sm.temperature is None:
            return walks
        temps = sm.temperature.cpu().tolist()
        for i, (b, tree) in enumerate(zip(step.batch_indices, step.trees)):
            if temps[b] < GREEDY_EPS:
                continue
            r, nv = int(root_rows[i]), tree.num_verify
            probs = target_probs(logits[r: r + nv + 1].float(), float(temps[b]),
                                 float(sm.top_p[b]) if sm.top_p is not None else 1.0,
                                 int(sm.top_k[b]) if sm.top_k is not None else -1)
            walks[i] = sampling_walk(tree, probs, sm.generators.get(b))
        return walks

    def _record(self, step: TreeStep, tree_argmax: list[list[int]], walks) -> None:
        """Each request's StepOutcome for ``propose``, the metrics and the trace (on the
        drafting rank)."""
        if not self.is_driver:
            return
        expected = accepted_total = 0.0
        for i, (req_id, tree) in enumerate(zip(step.req_ids, step.trees)):
            n = tree.num_nodes
            accepted, committed = walks[i]
            self.outcomes[req_id] = StepOutcome(tree=tree, root_argmax=tree_argmax[i][0],
                                                node_argmax=tree_argmax[i][1:],
                                                accepted=accepted, committed=committed)
            self.metrics.record(committed=len(committed), accepted=len(accepted),
                                verify_rows=tree.num_verify, draft_rows=n - tree.num_verify)
            accepted_total += len(accepted)
            if self.budget is not None:
                self.budget.observe(req_id, tree, accepted)
                expected += max(0.0, self._expected.get(req_id, 0.0))
            if self.trace is not None:
                self.trace.write(json.dumps({
                    "req": req_id, "nodes": n, "proposed": step.proposed_nodes[i],
                    "verify": tree.num_verify, "accepted": len(accepted),
                    "committed": len(committed),
                    "expected": round(self._expected.get(req_id, -1.0), 3)}) + "\n")
        self.clock.set_accepted(int(accepted_total))
        if self.budget is not None:
            self.budget.calibration.observe_tokens(self._sized_requests, expected,
                                                   accepted_total)
        self._steps += 1
        if self._steps % LOG_EVERY_STEPS == 0:
            logger.info("vllm-ptd %s: %s; per step %s", self.kind, self.metrics.summary(),
                        self.clock.summary())

    def _batch_end(self, ready_b: list[int]) -> tuple[list[float] | None, float]:
        """What a token of each ready request (batch rows ``ready_b``) is worth when no
        request waits for room and none arrived while others ran (a closed batch:
        ``budget.makespan_weights``), and how far the critical path leads
        (``budget.makespan_lead``); no weights while requests wait, in an open batch (a
        server's clients sending as others finish), or with ``budget: "per_step"``: then
        every token counts the same."""
        if (self.options.budget != "auto" or self._num_waiting is None
                or self._num_waiting > 0 or self._open_batch):
            return None, math.inf
        ib = self.runner.input_batch
        remaining = []
        for req_id in ib.req_ids[: ib.num_reqs]:
            state = self.runner.requests.get(req_id)
            if state is None:
                remaining.append(0)
                continue
            params = state.sampling_params
            cap = self.max_model_len - state.num_tokens
            if params is not None and params.max_tokens is not None:
                cap = min(cap, params.max_tokens - len(state.output_token_ids))
            remaining.append(max(0, cap))
        weights = makespan_weights(remaining, self.budget.cost.request_share(ib.num_reqs))
        return [weights[b] for b in ready_b], float(makespan_lead(remaining))

    # ---- 3. drafting --------------------------------------------------------------------
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                hidden: torch.Tensor | None = None) -> list[list[int]]:
        """Next step's flattened tree per request of the batch (empty: no speculation).
        ``hidden``: the tapped hidden states of every row of the step, for methods that
        need them."""
        out: list[list[int]] = [[] for _ in range(len(sampled_token_ids))]
        if not self.is_driver:
            return out  # vLLM schedules the first rank's drafts
        ib = self.runner.input_batch
        # the batch's row starts as Python ints, once (numpy scalars cost per use)
        qsl = self.runner.query_start_loc.np[: ib.num_reqs + 1].tolist()
        method = self.method
        observe_ids, observe_outcomes, ready_ids, ready_last, ready_b = [], [], [], [], []
        hidden_rows: list[int] = []  # per observed request: its rows [root, *accepted]
        for b, req_id in enumerate(ib.req_ids[: ib.num_reqs]):
            toks = sampled_token_ids[b]
            if method.has(req_id):
                if not toks:
                    continue
                outcome = self.outcomes.pop(req_id, None)
                if outcome is None:  # the request ran without a tree this step
                    outcome = StepOutcome(NO_TREE, toks[-1], [], [], list(toks))
                if hidden is not None:
                    r0 = qsl[b]
                    hidden_rows.append(r0)
                    hidden_rows.extend(r0 + 1 + a for a in outcome.accepted)
                observe_ids.append(req_id)
                observe_outcomes.append(outcome)
            else:
                if hidden is not None:
                    # prompt rows (maybe one chunk of several): the drafter's first context
                    self.prompt_hidden.setdefault(req_id, []).append(hidden[qsl[b]: qsl[b + 1]])
                if not toks:
                    continue
                params = self.runner.requests[req_id].sampling_params \
                    if req_id in self.runner.requests else None
                if not _speculation_allowed(params):
                    self.prompt_hidden.pop(req_id, None)
                    continue
                n = int(num_tokens_no_spec[b])
                prompt_hidden = None
                if hidden is not None:
                    prompt_hidden = torch.cat(self.prompt_hidden.pop(req_id))
                method.start(req_id, token_ids_cpu[b, : n - 1].tolist(), prompt_hidden)
            ready_ids.append(req_id)
            ready_last.append(int(toks[-1]))
            ready_b.append(b)
        if observe_ids:
            if hidden is not None:  # one gather for the batch, a view per request
                parts = gather_rows(hidden, hidden_rows).split(
                    [1 + len(oc.accepted) for oc in observe_outcomes])
                for oc, part in zip(observe_outcomes, parts):
                    oc.hidden = part
            with self.clock.part("drafting"):
                method.observe(observe_ids, observe_outcomes)
        if not ready_ids:
            return out
        disabled = (self.disable_by_batch_size is not None
                    and ib.num_reqs >= self.disable_by_batch_size)
        if disabled or (self.budget is not None and not self.budget.should_draft()):
            # no trees this step: speculation is off at this batch size (vLLM's
            # disable_by_batch_size), or drafting has not paid lately
            for req_id in ready_ids:
                self.trees.pop(req_id, None)
            method.skip(ready_ids, ready_last)
            return out
        t0 = time.perf_counter()
        with self.clock.part("drafting"):
            budget = self.budget
            trees = method.propose(
                ready_ids, ready_last,
                max_depth=None if budget is None else budget.draft_depth(ib.num_reqs),
                max_branching=None if budget is None else budget.draft_branching(ib.num_reqs))
        self.clock.set_draft_shape(method.drafted_depth, method.drafted_branching)
        self.clock.set_paused(method.paused_ms)
        if self.budget is not None:
            # what drafting again next step would cost: not the rows earlier steps left for
            # the method (a new request's prompt, the rows of a pause), which whichever
            # proposal comes first pays; charged to it, a try after a pause or a new request
            # looked like a miss and paused drafting again (served with 4 clients, PCTree
            # proposed on 291 of 1908 steps of 4 requests; a proposal right after another
            # took a median 9.2 ms, one after 13 or more steps without 11.6)
            drafting_ms = max(0.0, 1000 * (time.perf_counter() - t0) - method.catch_up_ms)
            weights, lead = self._batch_end(ready_b)
            with self.clock.part("budget"):
                trees = self.budget.size(ready_ids, trees, base_rows=ib.num_reqs,
                                         num_requests=ib.num_reqs, drafting_ms=drafting_ms,
                                         weights=weights, catch_up_ms=method.catch_up_ms,
                                         critical_lead=lead, paused_ms=method.paused_ms)
            self._expected = dict(zip(ready_ids, self.budget.last.expected))
            self._predicted_ms = self.budget.last.step_ms
            self._sized_requests = ib.num_reqs
        for req_id, b, tree in zip(ready_ids, ready_b, trees):
            # the scheduler keeps positions below max_model_len: send what fits; the
            # stored tree is cut to what was scheduled in the next prepare_step
            room = max(self.max_model_len - 1 - int(num_tokens_no_spec[b]), 0)
            # depth first: the longest path leads, so its rows need no tree mask
            tree = tree.truncated(self.num_spec).depth_first()
            self.trees[req_id] = tree
            out[b] = tree.tokens[:room]
        return out
