"""PCTree as a :class:`~vllm_ptd.method.TreeMethod`: a DSpark drafter plus parent-conditioned
tree expansion, per-request drafter context, no vLLM.

Hidden states. ``needs_hidden = True`` and ``hidden_layer_ids`` are indices into Hugging
Face's ``output_hidden_states`` tuple: 0 = the embeddings, j = the output of decoder layer
j-1 = the input of decoder layer j (what vLLM's EAGLE-3 auxiliary hidden-state taps at layer
j return). They are the drafter's DeepSpec ``target_layer_ids`` plus one. The method takes
hidden rows as ``[rows, len(hidden_layer_ids) * hidden_size]``, the tapped states
concatenated in ``hidden_layer_ids`` order (:func:`~vllm_ptd.pctree.drafter.tap_hidden_states`
builds it from an HF ``hidden_states`` tuple); a ``[len(hidden_layer_ids), rows,
hidden_size]`` stack or a list of per-layer ``[rows, hidden_size]`` tensors is accepted too.

Per request:

* ``start``: ``prompt_hidden`` holds the prompt rows (all of them, or the last ones when a
  prefix was cached: rows are aligned to the end of the prompt); they become the drafter
  context at positions ``0 .. len(prompt)-1`` when the request first drafts. The first
  generated token (at position ``len(prompt)``) is the first root.
* ``observe``: ``outcome.hidden`` holds the rows ``[root, *accepted]`` of the forward; they
  are appended at the next positions. The new root (the bonus token) has no hidden state
  yet, so the context always ends right before the root, as in DeepSpec.
* ``skip``: the request sends no tree this step; its queue keeps only its last
  ``catch_up_rows`` rows (older positions are skipped: drafting quality only).
* ``propose``: one batched backbone call for all requests (block ``[root, MASK...]`` at the
  root's position), then one batched expansion (``mode``/``k``/``N``/``depth`` from
  :class:`~vllm_ptd.pctree.config.PCTreeConfig`). Unknown requests get an empty tree.
* State is bounded: a request's context is a sliding window of at most ``max_context`` rows,
  and everything is dropped on ``finish``.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from vllm_ptd.method import StepOutcome, TreeMethod
from vllm_ptd.pctree.checkpoint import check_drafter_fits, load_drafter, target_config_dict
from vllm_ptd.pctree.config import PCTreeConfig
from vllm_ptd.pctree.draft_vocab import draft_vocab_ids
from vllm_ptd.pctree.drafter import DraftContext, DSparkDrafter, LinearKernelFactory, NormKernelFactory
from vllm_ptd.pctree.expand import expand_trees
from vllm_ptd.tree import FlatTree

__all__ = ["ENV_DRAFTER", "PACKAGED_DRAFTERS", "DEFAULT_DRAFTER", "PCTreeMethod",
           "packaged_drafters", "resolve_drafter_path"]

ENV_DRAFTER = "VLLM_PTD_DSPARK"
PACKAGED_DRAFTERS = Path(__file__).resolve().parent / "drafters"
DEFAULT_DRAFTER = "dspark-smollm2-135m"

_TRAIN_HINT = ("train one with `python scripts/train_dspark.py --out <folder>` (about an hour on "
               "two CPU cores for SmolLM2-135M-Instruct), or download a DeepSpec DSpark checkpoint "
               "for your target (e.g. deepseek-ai/dspark_qwen3_4b_block7), then pass it as "
               f"speculative_config['model'] or set ${ENV_DRAFTER}=<folder>")


def packaged_drafters() -> list[Path]:
    """Drafter folders shipped in the package, the default one first."""
    if not PACKAGED_DRAFTERS.is_dir():
        return []
    found = sorted(p for p in PACKAGED_DRAFTERS.iterdir() if (p / "config.json").is_file())
    found.sort(key=lambda p: p.name != DEFAULT_DRAFTER)
    return found


def resolve_drafter_path(model: str | None, target_config: Any) -> Path:
    """Where the drafter comes from: ``model`` when given (a folder, or the name of a
    packaged drafter); else a packaged drafter that fits the target, the default one first;
    else ``$VLLM_PTD_DSPARK``; else a ValueError saying how to get one."""
    if model:
        p = Path(model).expanduser()
        if p.is_dir():
            return p
        packaged = {q.name: q for q in packaged_drafters()}
        if model in packaged:
            return packaged[model]
        names = ", ".join(packaged) or "none"
        raise ValueError(f"PCTree drafter {model!r} is neither a folder nor a packaged drafter "
                         f"({names}); {_TRAIN_HINT}")
    reasons = []
    for p in packaged_drafters():
        try:
            check_drafter_fits(p, target_config)
            return p
        except ValueError as e:
            reasons.append(str(e))
    env = os.environ.get(ENV_DRAFTER)
    if env:
        p = Path(env).expanduser()
        if not p.is_dir():
            raise ValueError(f"${ENV_DRAFTER}={env!r} is not a folder")
        return p
    why = f" (packaged drafters do not fit: {' | '.join(reasons)})" if reasons else ""
    raise ValueError(f"no PCTree drafter for this target{why}: {_TRAIN_HINT}")


PENDING_FLUSH_ROWS = 256  # bound on rows waiting for the drafter's context
# ``PCTreeMethod.warm_up``: its made-up requests, their prompt rows, the larger batch
WARM_UP_ID = "\0vllm_ptd_warm_up_"
WARM_UP_PROMPT_ROWS = 64
WARM_UP_REQUESTS = 4


class _Request:
    __slots__ = ("ctx", "pending", "pending_rows", "paused_rows")

    def __init__(self, ctx: DraftContext):
        self.ctx = ctx
        # hidden rows (the prompt's, then observed ones) not yet in the drafter's context,
        # to go in at ``ctx.next_position`` in one call when the request next drafts: a
        # request that sends no tree (drafting paused, or off at this batch size) costs no
        # drafter work, up to PENDING_FLUSH_ROWS rows
        self.pending: list[torch.Tensor] = []
        self.pending_rows = 0
        # how many of them waited through a step in which the request sent no tree
        self.paused_rows = 0

    def add_pending(self, rows: torch.Tensor) -> bool:
        """Queue rows; True when the bound is reached and they should be flushed."""
        self.pending.append(rows)
        self.pending_rows += rows.shape[0]
        return self.pending_rows >= PENDING_FLUSH_ROWS

    def keep_recent(self, limit: int) -> None:
        """Drop all but the last ``limit`` queued rows: their positions are skipped, and the
        drafter's context goes on from the rows kept (drafting quality only)."""
        drop = self.pending_rows - limit
        if drop <= 0:
            return
        self.ctx.next_position += drop
        self.pending_rows = limit
        # whole pieces off the front, and the rest of the one cut in two: a view where its
        # storage holds no more than ``limit`` rows, else a copy (a view of a long prompt
        # would hold all of its rows alive). Why: a paused request queues one row a step,
        # and concatenating its queue every step to cut one row off took 0.68 ms a step at
        # 16 requests in fp32 (1 % of a decode step here); copying the piece cut in two
        # every step (the prompt's last ``limit`` rows, one row fewer each step) was most
        # of the proposer's time in steps without a tree at 16 requests in bf16 (py-spy)
        pieces = self.pending
        whole = 0
        while whole < len(pieces) and pieces[whole].shape[0] <= drop:
            drop -= pieces[whole].shape[0]
            whole += 1
        del pieces[:whole]
        if drop:
            rest = pieces[0][drop:]
            if rest.untyped_storage().nbytes() > limit * rest.stride(0) * rest.element_size():
                rest = rest.clone()
            pieces[0] = rest


class PCTreeMethod(TreeMethod[_Request]):
    """PCTree (or its chain / Shared-Markov controls) over a DSpark drafter.

    ``PCTreeMethod(config, target_config, target_embeddings=None, *, drafter=None,
    dtype=torch.float32, device="cpu", max_context=4096)``

    * ``config``: :class:`PCTreeConfig` (``model``: drafter folder or None for the default
      lookup, see :func:`resolve_drafter_path`; ``branching`` k; ``max_nodes`` N including
      the root; ``depth`` B or None for the drafter's block size; ``mode``).
    * ``target_config``: the target's HF config (``PretrainedConfig``, dict, or model folder).
    * ``target_embeddings``: the target's embedding / lm_head weights (tensor when tied, a
      pair, or a dict); needed by compact drafters unless ``target_config`` names the
      target's folder.
    * ``drafter``: an already built :class:`DSparkDrafter` (skips loading; tests).
    * ``linear_kernel``: the engine's matmul for fixed weights (see
      :meth:`DSparkDrafter.use_linear_kernel`); None keeps torch's.
    * ``norm_kernel``: the engine's RMS norm (see :meth:`DSparkDrafter.use_norm_kernel`);
      None keeps torch's.
    """

    needs_hidden = True

    def __init__(self, config: PCTreeConfig, target_config: Any, target_embeddings: Any = None, *,
                 drafter: DSparkDrafter | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", max_context: int | None = 4096,
                 linear_kernel: LinearKernelFactory | None = None,
                 norm_kernel: NormKernelFactory | None = None):
        if not isinstance(config, PCTreeConfig):
            raise ValueError(f"PCTreeMethod needs a PCTreeConfig, got {type(config).__name__}")
        super().__init__()
        self.target_config = target_config_dict(target_config)
        if drafter is None:
            path = resolve_drafter_path(config.model, target_config)
            drafter = load_drafter(path, target_config, target_embeddings, dtype=dtype, device=device)
            self.drafter_path: Path | None = path
        else:
            self.drafter_path = None
        self.drafter = drafter.eval()
        self.drafter.restrict_vocab(draft_vocab_ids(self.drafter_path, config.draft_vocab,
                                                    drafter.config.vocab_size))
        if linear_kernel is not None:
            self.drafter.use_linear_kernel(linear_kernel)
        if norm_kernel is not None:
            self.drafter.use_norm_kernel(norm_kernel)
        self.config = config.for_block_size(drafter.block_size)
        self.hidden_layer_ids = tuple(drafter.hidden_layer_ids)
        if max(self.hidden_layer_ids) > int(self.target_config["num_hidden_layers"]) - 1:
            raise ValueError(f"drafter taps hidden states {self.hidden_layer_ids}, beyond the target's "
                             f"{self.target_config['num_hidden_layers']} layers")
        self.max_context = max_context

    # ---- TreeMethod -------------------------------------------------------------------
    @property
    def max_tree_nodes(self) -> int:
        return self.config.max_tree_nodes

    def start(self, req_id: str, prompt_token_ids: list[int], prompt_hidden: torch.Tensor | None = None) -> None:
        if prompt_hidden is None:
            raise ValueError("PCTree needs the prompt's hidden states (needs_hidden=True): pass "
                             f"prompt_hidden tapped at hidden_layer_ids={self.hidden_layer_ids}")
        rows = self.drafter.as_rows(prompt_hidden)
        P = len(prompt_token_ids)
        if rows.shape[0] > P:
            raise ValueError(f"prompt_hidden has {rows.shape[0]} rows for a {P}-token prompt")
        ctx = self.drafter.new_context(self.max_context)
        ctx.next_position = P - rows.shape[0]  # where the pending prompt rows go
        st = self._requests[req_id] = _Request(ctx)
        if rows.shape[0]:
            # queued, not put in: whether they are depends on the request's first step
            # (``propose`` or ``skip``), which the engine runs right after this
            st.add_pending(rows)
            if self.max_context is not None:  # rows the sliding window would drop at once
                st.keep_recent(self.max_context)

    def observe(self, req_ids: list[str], outcomes: list[StepOutcome]) -> None:
        if len(req_ids) != len(outcomes):
            raise ValueError(f"{len(req_ids)} request ids but {len(outcomes)} outcomes")
        for rid, out in zip(req_ids, outcomes):
            st = self._requests.get(rid)
            if st is None:
                continue
            if out.hidden is None:
                raise ValueError(f"request {rid!r}: PCTree needs StepOutcome.hidden (rows of "
                                 f"[root, *accepted] at hidden_layer_ids={self.hidden_layer_ids})")
            rows = self.drafter.as_rows(out.hidden)
            want = 1 + len(out.accepted)
            if rows.shape[0] != want:
                raise ValueError(f"request {rid!r}: StepOutcome.hidden has {rows.shape[0]} rows, "
                                 f"expected {want} (root + {len(out.accepted)} accepted)")
            if st.add_pending(rows):
                self._flush([st])

    def _flush(self, states: list[_Request]) -> float:
        """Pending rows into the drafters' contexts, all requests in one call; returns the
        share of those rows that a pause held (``_Request.paused_rows``)."""
        waiting = [st for st in states if st.pending]
        if not waiting:
            return 0.0
        rows = [torch.cat(st.pending) if len(st.pending) > 1 else st.pending[0]
                for st in waiting]
        total = sum(st.pending_rows for st in waiting)
        paused = sum(min(st.paused_rows, st.pending_rows) for st in waiting)
        for st in waiting:
            st.pending, st.pending_rows, st.paused_rows = [], 0, 0
        self.drafter.append_contexts([st.ctx for st in waiting], rows)
        return paused / max(total, 1)

    def skip(self, req_ids: list[str], last_tokens: list[int]) -> None:
        """While a request does not draft, its queue keeps only the last ``catch_up_rows``
        rows: what the drafter catches up on when drafting resumes is bounded, and a
        request that never drafts (a batch size where no tree pays) costs no drafter work.
        Why: putting a row in costs the packaged drafter 21 us in bf16 and 47 us in fp32
        (one thread, here), and a try at 16 requests comes after some 50 steps without,
        when every request's prompt may still wait: up to some 3,000 rows, at a batch
        size where no tree pays. (Served with 16 clients this bounded a round's drafting
        at 0.46 s against 0.49 s with every row kept: a try's own drafter block is most
        of it.)"""
        limit = self.config.catch_up_rows
        for req_id in req_ids:
            st = self._requests.get(req_id)
            if st is not None:
                if limit is not None:
                    st.keep_recent(limit)
                st.paused_rows = st.pending_rows

    @torch.no_grad()
    def warm_up(self) -> None:
        """Draft once for one request and once for ``WARM_UP_REQUESTS``, each with a prompt
        of ``WARM_UP_PROMPT_ROWS`` zero rows, and forget them. Why: the drafter's first
        proposal in an engine took 97-358 ms in fp32 here (later ones 5-20 ms): charged to
        the budget as a failed try, it paused drafting for some 330 steps of 4 requests."""
        rows = torch.zeros(WARM_UP_PROMPT_ROWS, self.drafter.context_dim,
                           dtype=self.drafter.dtype, device=self.drafter.device)
        for n in (1, WARM_UP_REQUESTS):
            ids = [f"{WARM_UP_ID}{i}" for i in range(n)]
            for req_id in ids:
                self.start(req_id, [0] * WARM_UP_PROMPT_ROWS, rows)
            self.propose(ids, [0] * n)
            for req_id in ids:
                self.finish(req_id)
        self.catch_up_ms = self.paused_ms = 0.0
        self.drafted_depth = self.drafted_branching = 0

    @torch.no_grad()
    def propose(self, req_ids: list[str], last_tokens: list[int],
                max_depth: int | None = None,
                max_branching: int | None = None) -> list[FlatTree]:
        """Trees from one drafter block for all requests; with ``max_depth`` the block has
        that many rows (at most the drafter's block size) and the expansion that many
        stages; with ``max_branching`` the expansion's k is at most that (``branching``
        is the most); ``draft_shape: "full"`` ignores both. Why: the block's GEMMs and the
        expansion's stages cost in proportion to its rows, and the stages with their width
        (at 4 requests in bf16 here a proposal took a median 8.8-11.8 ms, a plain step
        about 26 ms), while a budget that keeps one or two nodes per request uses
        the first rows only; a block cut after its third row drafted as well as the
        whole one at depth 3 (``scripts/bench_pctree.py -N 6 --depth 3``, 12 prompts:
        tau 1.684 against 1.680: the MASK rows after a position tell it little)."""
        if len(req_ids) != len(last_tokens):
            raise ValueError(f"{len(req_ids)} request ids but {len(last_tokens)} last tokens")
        live = [i for i, r in enumerate(req_ids) if r in self._requests]
        out = [FlatTree() for _ in req_ids]
        c = self.config
        self.catch_up_ms = self.paused_ms = 0.0
        self.drafted_depth = self.drafted_branching = 0
        if not live or c.max_nodes < 2 or c.depth == 0:
            return out
        states = [self._requests[req_ids[i]] for i in live]
        if any(st.pending for st in states):
            t0 = time.perf_counter()
            paused_share = self._flush(states)
            self.catch_up_ms = 1000 * (time.perf_counter() - t0)
            self.paused_ms = paused_share * self.catch_up_ms
        ctxs = [st.ctx for st in states]
        roots = [int(last_tokens[i]) for i in live]
        if c.draft_shape == "full":
            max_depth = max_branching = None
        depth = c.depth if max_depth is None else max(1, min(c.depth, int(max_depth)))
        U, h = self.drafter.draft_block(ctxs, roots, rows=depth)
        k = c.branching if max_branching is None else max(1, min(c.branching, int(max_branching)))
        self.drafted_depth, self.drafted_branching = depth, k
        res = expand_trees(U, roots, markov=self.drafter.markov_head, hidden=h, k=k,
                           max_nodes=c.max_nodes, depth=depth, mode=c.mode, return_scores=True,
                           vocab_ids=self.drafter.draft_vocab)
        for i, t, joint in zip(live, res.trees, res.scores):
            # the drafter's P(node | parent): its joint log-score minus its parent's; calibrated
            # per depth by the budget
            t.scores = [math.exp(min(0.0, s - (joint[p] if p >= 0 else 0.0)))
                        for s, p in zip(joint, t.parents)]
            t.groups = t.depths()
            out[i] = t
        return out
