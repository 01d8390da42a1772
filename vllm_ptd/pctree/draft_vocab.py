"""The words a PCTree drafter drafts from (its *draft vocabulary*), no vLLM.

A drafter's output projection and the tree expansion's softmax and top-k run over the
whole vocabulary (49152 words for SmolLM2): on a CPU most of a drafting step. The most
frequent few thousand words carry nearly every token a draft is accepted for (FR-Spec, Zhao
et al. 2025), so the drafter may draft from those only; the target still verifies every
token, so outputs do not change, only which drafts can be accepted.

A drafter folder may hold ``draft_vocab.json``::

    {"ranked": [ids...], "size": 8192, "source": "..."}

``ranked``: token ids by how often the target wrote them in the drafter's training
continuations (most first; ties by id); the ids not listed follow in ascending order (a BPE
vocabulary's ids follow its merge order, roughly frequency in the tokenizer's corpus).
``size``: the folder's default draft-vocabulary size (0: the whole vocabulary).
``speculative_config["draft_vocab"]`` overrides it (0: the whole vocabulary; n: the first n
of the ranking). A folder without the file drafts from the whole vocabulary by default.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

DRAFT_VOCAB_NAME = "draft_vocab.json"

__all__ = ["DRAFT_VOCAB_NAME", "rank_tokens", "write_draft_vocab", "draft_vocab_ids"]


def rank_tokens(sequences: Iterable[Sequence[int]]) -> list[int]:
    """Token ids of ``sequences`` by count (most first), ties by id."""
    counts = Counter(int(t) for seq in sequences for t in seq)
    return [t for t, _ in sorted(counts.items(), key=lambda tc: (-tc[1], tc[0]))]


def write_draft_vocab(folder: str | Path, ranked: Sequence[int], size: int, source: str) -> Path:
    path = Path(folder) / DRAFT_VOCAB_NAME
    path.write_text(json.dumps({"size": int(size), "source": source,
                                "ranked": [int(t) for t in ranked]}) + "\n", encoding="utf-8")
    return path


def draft_vocab_ids(folder: str | Path | None, size: int | None, vocab_size: int) -> list[int] | None:
    """The draft vocabulary of the drafter at ``folder`` (None: the whole vocabulary).
    ``size``: ``speculative_config["draft_vocab"]`` (None: the folder's default)."""
    path = None if folder is None else Path(folder) / DRAFT_VOCAB_NAME
    info = json.loads(path.read_text(encoding="utf-8")) if path is not None and path.is_file() else {}
    if size is None:
        size = int(info.get("size", 0))
    if size == 0 or size >= vocab_size:
        if size > vocab_size:
            raise ValueError(f"speculative_config['draft_vocab'] = {size} exceeds the drafter's "
                             f"vocabulary of {vocab_size} words")
        return None
    ranked = [int(t) for t in info.get("ranked", []) if 0 <= int(t) < vocab_size]
    seen = set(ranked)
    out = ranked[:size]
    for t in range(vocab_size):
        if len(out) >= size:
            break
        if t not in seen:
            out.append(t)
    return out
