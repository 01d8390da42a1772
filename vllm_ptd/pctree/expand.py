"""PCTree expansion (seed 001, "From Chains to Trees"): parent-conditioned trees from one
DSpark block, batched over requests and parents, no vLLM.

Given a request's base logits ``U`` ``[B, V]`` (one row per block slot) and the Markov head
``pi_d(v | p) = softmax_v(U_d(v) + W1[p] . W2[v])``:

* stage ``d = 0 .. depth-1`` builds tree level ``d + 1``. The frontier ``F_{d-1}`` (at most k
  parents; ``F_{-1} = {root}``) is evaluated in one batched call: every parent shares
  ``U_d`` and gets its own Markov bias. Each parent's local top-k children enter the pool
  with the joint score ``s(child) = s(parent) + log pi_d(child | parent)``; the next
  frontier is the k best *new* candidates (ties: earlier pool id first).
* after the last stage all pool nodes including the root (score 0) are ranked by score
  (descending), then depth (shallower first), then pool id (creation order), and the first
  ``max_nodes`` are kept (``max_nodes`` counts the root). Scores never increase along a path
  (log-probabilities are clamped to <= 0), so the kept set is prefix-closed and the ranked
  order is parents-first. Nodes with a -inf score are never kept.

Modes:

* ``"pctree"``: as above;
* ``"shared"`` (Shared-Markov control): the greedy chain is built first
  (``c_d = argmax(U_d + bias(c_{d-1}))``, ``c_{-1}`` = root), and every parent at depth
  ``d`` uses the chain's distribution ``q_d = pi_d(. | c_{d-1})``;
* ``"chain"`` (k = 1): the DSpark greedy chain, cut to ``max_nodes - 1`` nodes.

With k = 1 the child is the argmax of the logits (exactly chain DSpark's greedy token).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ptd.tree import FlatTree

from vllm_ptd.pctree.config import MODES, pool_capacity

__all__ = ["ExpansionResult", "expand_trees", "rank_nodes"]


def rank_nodes(scores: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """Pool ids ``[R, M]`` ordered by score (descending), then depth (ascending), then id
    (ascending): stable sorts, least significant key first."""
    o1 = torch.sort(depths, dim=1, stable=True).indices
    o2 = torch.sort(scores.gather(1, o1), dim=1, descending=True, stable=True).indices
    return o1.gather(1, o2)


def frontier_is_out(scores: torch.Tensor, frontier_scores: torch.Tensor, max_nodes: int) -> bool:
    """Whether no later stage can add a node to any request's top ``max_nodes``: a child
    scores at most its parent, and a deeper node loses a tie of score, so once every
    request's best frontier score is at most the ``max_nodes``-th best of its pool
    (``scores`` ``[R, M]``, root included), later stages change nothing that is kept. Why:
    a stage is a batched Markov bias, softmax and top-k over the draft vocabulary (at 4
    requests about a third of a millisecond), and a tree whose N best nodes are all
    shallow needs none of the later stages."""
    nth_best = scores.topk(max_nodes, dim=1).values[:, -1]
    return bool((frontier_scores.max(dim=1).values <= nth_best).all())


@dataclass
class ExpansionResult:
    trees: list[FlatTree]
    scores: list[list[float]]  # joint score of each kept node (root excluded)


def _stage_logits(U: torch.Tensor, d: int, parents: torch.Tensor, markov, hidden) -> torch.Tensor:
    """Markov-corrected logits ``[R, b, V]`` (float32) of stage d for parents ``[R, b]``."""
    base = U[:, d].unsqueeze(1).float()  # [R, 1, V]
    if markov is None:
        return base.expand(parents.shape[0], parents.shape[1], base.shape[-1])
    h = None if hidden is None else hidden[:, d].unsqueeze(1)
    return base + markov.bias(parents, h).float()


def _children(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob, token) ``[..., k]`` of the local top-k children; k = 1 takes the argmax of
    the logits themselves (DSpark's greedy token)."""
    logp = torch.log_softmax(logits, dim=-1)
    if k == 1:
        idx = logits.argmax(dim=-1, keepdim=True)
        vals = logp.gather(-1, idx)
    else:
        vals, idx = logp.topk(k, dim=-1)
    return vals.clamp(max=0.0), idx


@torch.no_grad()
def expand_trees(U: torch.Tensor, roots, *, markov=None, hidden: torch.Tensor | None = None,
                 k: int, max_nodes: int, depth: int | None = None, mode: str = "pctree",
                 return_scores: bool = False, vocab_ids: torch.Tensor | None = None):
    """Expand one tree per request.

    ``U``: base logits ``[R, B, V]`` (or ``[B, V]`` for one request); ``roots``: the last
    committed token of each request (``[R]``, or an int); ``markov``: the drafter's
    :class:`~vllm_ptd.pctree.drafter.MarkovHead` (None: no Markov bias); ``hidden``: block
    hidden ``[R, B, d]`` (gated Markov heads only); ``k``: branching (frontier size and
    children per parent); ``max_nodes``: N, nodes kept including the root; ``depth``: stages
    (default B); ``vocab_ids``: the token id of each of ``U``'s ``V`` columns when the
    drafter drafts from a part of the vocabulary (``DSparkDrafter.draft_vocab``; None: column
    = token id). Returns a list of :class:`FlatTree` (root excluded, parents first, ranked),
    or an :class:`ExpansionResult` with ``return_scores``.
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: allowed {list(MODES)}")
    if mode == "chain" and k != 1:
        raise ValueError(f"mode 'chain' expands with k=1, got k={k}")
    if k < 1:
        raise ValueError(f"branching k={k} must be >= 1")
    if max_nodes < 1:
        raise ValueError(f"max_nodes={max_nodes} must be >= 1 (it counts the root)")
    single = U.dim() == 2
    if single:
        U = U.unsqueeze(0)
        if hidden is not None:
            hidden = hidden.unsqueeze(0)
    R, Bsz, V = U.shape
    dev = U.device
    D = Bsz if depth is None else int(depth)
    if not 0 <= D <= Bsz:
        raise ValueError(f"depth {D} exceeds the block size {Bsz}")
    k = min(k, V)
    if vocab_ids is not None and vocab_ids.numel() != V:
        raise ValueError(f"vocab_ids has {vocab_ids.numel()} token ids for {V} logit columns")

    def token_ids(cols: torch.Tensor) -> torch.Tensor:
        return cols if vocab_ids is None else vocab_ids[cols]

    roots_t = torch.as_tensor(roots, dtype=torch.long, device=dev).reshape(-1)
    if roots_t.numel() != R:
        raise ValueError(f"{R} requests but {roots_t.numel()} roots")

    M = pool_capacity(k, D)
    neg = float("-inf")
    pool_tok = torch.zeros(R, M, dtype=torch.long, device=dev)
    pool_par = torch.zeros(R, M, dtype=torch.long, device=dev)
    pool_score = torch.full((R, M), neg, dtype=torch.float32, device=dev)
    pool_depth = torch.zeros(R, M, dtype=torch.long, device=dev)
    pool_tok[:, 0] = roots_t
    pool_score[:, 0] = 0.0

    shared_logits = None
    if mode == "shared" and D > 0:
        shared_logits = []
        prev = roots_t.unsqueeze(1)
        for d in range(D):
            lg = _stage_logits(U, d, prev, markov, hidden)  # [R, 1, V]
            shared_logits.append(lg)
            prev = token_ids(lg.argmax(dim=-1))

    f_idx = torch.zeros(R, 1, dtype=torch.long, device=dev)
    f_score = torch.zeros(R, 1, dtype=torch.float32, device=dev)
    f_tok = roots_t.unsqueeze(1)
    nxt = 1
    for d in range(D):
        b = f_idx.shape[1]
        if shared_logits is not None:
            vals, idx = _children(shared_logits[d], k)  # same children for every parent
            vals, idx = vals.expand(R, b, k), idx.expand(R, b, k)
        else:
            vals, idx = _children(_stage_logits(U, d, f_tok, markov, hidden), k)
        idx = token_ids(idx)
        cs = (f_score.unsqueeze(-1) + vals).reshape(R, b * k)
        n_new = b * k
        sl = slice(nxt, nxt + n_new)
        pool_tok[:, sl] = idx.reshape(R, n_new)
        pool_par[:, sl] = f_idx.unsqueeze(-1).expand(R, b, k).reshape(R, n_new)
        pool_score[:, sl] = cs
        pool_depth[:, sl] = d + 1
        order = torch.sort(cs, dim=1, descending=True, stable=True).indices[:, :k]
        f_idx = nxt + order
        f_score = cs.gather(1, order)
        f_tok = pool_tok.gather(1, f_idx)
        nxt += n_new
        if d + 1 < D and nxt >= max_nodes and frontier_is_out(pool_score[:, :nxt], f_score,
                                                              max_nodes):
            break

    # global ranking: score desc, then depth asc, then pool id asc (stable sorts, last key first)
    used = nxt
    sc, dp = pool_score[:, :used], pool_depth[:, :used]
    order = rank_nodes(sc, dp)
    N = min(max_nodes, used)
    sel = order[:, :N]  # [R, N], column 0 is the root
    sel_score = sc.gather(1, sel)
    inv = torch.full((R, used), -2, dtype=torch.long, device=dev)
    inv.scatter_(1, sel, torch.arange(-1, N - 1, device=dev).expand(R, N))
    nodes = sel[:, 1:]
    toks = pool_tok.gather(1, nodes)
    pars = inv.gather(1, pool_par.gather(1, nodes))
    counts = torch.isfinite(sel_score[:, 1:]).sum(dim=1)

    toks_l, pars_l, counts_l = toks.tolist(), pars.tolist(), counts.tolist()
    scores_l = sel_score[:, 1:].tolist() if return_scores else None
    trees, scores = [], []
    for r in range(R):
        n = counts_l[r]
        trees.append(FlatTree(toks_l[r][:n], pars_l[r][:n]))
        if return_scores:
            scores.append(scores_l[r][:n])
    if return_scores:
        return ExpansionResult(trees, scores)
    return trees
