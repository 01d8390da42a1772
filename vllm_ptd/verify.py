"""Tree verification: which nodes of a proposed tree the target accepts, and the bonus token.

Only a request's first ``tree.num_verify`` nodes (the candidate tree) can be accepted; draft
nodes ride along in the same forward for drafting and are never part of the accepted path.

Greedy (paper 3.2): from the root, follow the child whose token is the target's argmax at the
current node; the committed tokens are the accepted tokens plus the argmax at the last
accepted node (the bonus). Among duplicate sibling tokens the lowest index wins.

Sampling (paper App. E, proof App. F): at node v with children c1..cm the walk draws
r ~ U(0,1) per child and accepts the first child with r < P(ci), where P is v's target
distribution with every rejected token zeroed and the rest renormalised; if no child is
accepted the bonus is drawn from that residual distribution. Each token (inside the tree or
not) is then committed with exactly its target probability.
"""
from __future__ import annotations

from typing import Sequence

import torch

from vllm_ptd.tree import FlatTree

# A child whose token holds all the remaining mass (up to float64 rounding) is accepted
# outright: the exact walk accepts it with probability 1, while rounding could make
# r < P(c) fail and leave a residual of pure rounding noise to sample the bonus from.
_RESIDUAL_EPS = 1e-12


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first index of the largest value, as vLLM's greedy sampler
    takes it), shape ``(rows,)``.

    On CPU through ``max(dim).indices``, which returns the same first index: ``argmax``
    there is the slower reduction, and over bf16 logits the slowest (one core, 18 rows of
    49152 words: argmax 3.2 ms in bf16 and 1.2 ms in fp32, max 0.66 and 0.47 ms), which was
    most of a bf16 step's verification at batch 4. Elsewhere ``argmax`` itself."""
    if logits.device.type == "cpu":
        return logits.max(dim=-1).indices
    return logits.argmax(dim=-1)


def greedy_walk(tree: FlatTree, root_argmax: int,
                node_argmax: Sequence[int]) -> tuple[list[int], list[int]]:
    """Greedy acceptance on one tree.

    ``node_argmax[i]`` is the target's argmax at node i's row (only the verify nodes' entries
    are read). Returns (accepted node indices root-to-leaf, committed tokens)."""
    nv = tree.num_verify
    toks, parents = tree.tokens, tree.parents
    # children lists of the verify part only, in index order (lowest index first)
    kids: dict[int, list[int]] = {}
    for i in range(nv):
        kids.setdefault(parents[i], []).append(i)
    accepted: list[int] = []
    cur, want = -1, int(root_argmax)
    while True:
        nxt = -1
        for c in kids.get(cur, ()):
            if toks[c] == want:
                nxt = c
                break
        if nxt < 0:
            break
        accepted.append(nxt)
        cur, want = nxt, int(node_argmax[nxt])
    committed = [toks[i] for i in accepted]
    committed.append(want)
    return accepted, committed


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                 top_k: int = -1) -> torch.Tensor:
    """The target's sampling distribution for each row of ``logits`` ([R, V] or [V]).

    Order as in vLLM: divide by the temperature, then keep the top-k logits (ties with the
    k-th value are kept too, so no arbitrary tie break changes the distribution), then keep
    the smallest most-probable set whose mass reaches ``top_p`` (the token that crosses the
    threshold is kept), then renormalise. Returns float32 probabilities."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise ValueError(f"top_k must be -1 (off) or >= 1, got {top_k}")
    x = logits.float() / float(temperature)
    squeeze = x.dim() == 1
    if squeeze:
        x = x.unsqueeze(0)
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sp, si = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sp, dim=-1) - sp
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False  # the most probable token always stays
        drop = torch.zeros_like(drop_sorted).scatter_(1, si, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.squeeze(0) if squeeze else probs


def sampling_walk(tree: FlatTree, probs: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """Lossless sampling acceptance on one tree (paper App. E).

    ``probs``: [1 + num_verify, V] (more rows are allowed and ignored) target probabilities,
    row 0 the root, row i + 1 node i (see ``target_probs``). Returns (accepted node indices
    root-to-leaf, committed tokens = accepted tokens + bonus).

    A child whose token was already rejected at this node (a duplicate sibling) has residual
    probability 0 and is rejected without drawing. If a probability row carries no mass at
    all (all-zero or NaN input) the bonus falls back to the row's argmax so the walk never
    fails; with a proper distribution the residual always keeps mass (see _RESIDUAL_EPS)."""
    nv = tree.num_verify
    if probs.shape[0] < 1 + nv:
        raise ValueError(f"probs has {probs.shape[0]} rows, the tree needs 1 + {nv}")
    toks, parents = tree.tokens, tree.parents
    kids: dict[int, list[int]] = {}
    for i in range(nv):
        kids.setdefault(parents[i], []).append(i)
    edge_p: list[float] = []
    uniforms: list[float] = []
    if nv:
        # One gather for every edge's P(child token | parent) and one draw of all uniforms the
        # walk can need (each verify node is tried at most once), instead of per-child ops.
        dev = probs.device
        rows = torch.tensor([p + 1 for p in parents[:nv]], device=dev)
        cols = torch.tensor(toks[:nv], device=dev)
        edge_p = probs[rows, cols].double().tolist()
        gdev = generator.device if generator is not None else "cpu"
        uniforms = torch.rand(nv, generator=generator, device=gdev, dtype=torch.float64).tolist()
    u_next = 0
    accepted: list[int] = []
    cur = -1
    while True:
        row = probs[cur + 1]
        children = kids.get(cur, ())
        rejected: list[int] = []
        nxt = -1
        if children:
            total = float(row.sum(dtype=torch.float64))
            residual = total
            for c in children:
                t = toks[c]
                p = edge_p[c]
                if t in rejected or not p > 0.0:
                    continue  # already rejected here (P = 0) or outside the support
                rest = residual - p
                u = uniforms[u_next]
                u_next += 1
                if rest <= _RESIDUAL_EPS * total or u < p / residual:
                    nxt = c
                    break
                rejected.append(t)
                residual = rest
        if nxt >= 0:
            accepted.append(nxt)
            cur = nxt
            continue
        bonus = _sample_residual(row, rejected, generator)
        committed = [toks[i] for i in accepted]
        committed.append(bonus)
        return accepted, committed


def _sample_residual(row: torch.Tensor, rejected: list[int],
                     generator: torch.Generator | None) -> int:
    p = row.double()
    if rejected:
        p = p.clone()
        p[torch.tensor(rejected, device=p.device)] = 0.0
    s = float(p.sum())
    if not s > 0.0:  # nothing left (degenerate input): the row's own most likely token
        return int(torch.argmax(torch.nan_to_num(row.float(), nan=-1.0)))
    if generator is not None and generator.device != p.device:
        p = p.to(generator.device)
    return int(torch.multinomial(p, 1, generator=generator))
