"""Benchmark prompts as chat-templated token ids."""
from __future__ import annotations

import zlib


def _token_prompts(tok, ds: str, start: int, stop: int | None, data_dir: str | None,
                   max_len: int) -> tuple[list[dict], int]:
    """Prompts ``start:stop`` of dataset ``ds`` that fit in ``max_len`` tokens, and how many
    did not fit."""
    from vllm_ptd.datasets import chat_prompt_ids, load_prompts

    items, skipped = [], 0
    for p in load_prompts(ds, stop, data_dir=data_dir)[start:]:
        ids = chat_prompt_ids(tok, p.text)
        if len(ids) > max_len:
            skipped += 1
            continue
        items.append({"id": p.id, "ids": ids})
    return items, skipped


def token_limit(dataset: str, prompt_id, lo: int | None, hi: int) -> int:
    """A prompt's own limit on new tokens: ``hi`` when ``lo`` is None, else drawn from
    ``[lo, hi]`` by a hash of the dataset and the prompt's id, so that every method and
    repeat (and every run) gives the prompt the same limit."""
    if lo is None or lo >= hi:
        return hi
    return lo + zlib.crc32(f"{dataset}/{prompt_id}".encode()) % (hi - lo + 1)


def set_token_limits(prompts: dict[str, list[dict]], lo: int | None, hi: int) -> None:
    """Give every prompt of ``prompts`` (per dataset) its own limit, ``p["max_tokens"]``
    (:func:`token_limit`)."""
    for ds, items in prompts.items():
        for p in items:
            p["max_tokens"] = token_limit(ds, p["id"], lo, hi)


def per_prompt_limits(max_tokens: int | list[int], n: int) -> list[int]:
    """``n`` prompts' limits on new tokens from one limit for all, or one per prompt."""
    return list(max_tokens) if isinstance(max_tokens, list) else [max_tokens] * n


def token_limit_text(max_tokens: int, lo: int | None) -> str:
    """How a report names the limit on new tokens (see :func:`token_limit`)."""
    return f"max {max_tokens}" if lo is None else f"each prompt's own limit of {lo}-{max_tokens}"


def load_token_prompts(model: str, datasets: list[str], n: int | None, data_dir: str | None,
                       max_len: int, say=print) -> dict[str, list[dict]]:
    """The first ``n`` prompts of each dataset (all when ``None``), less those longer than
    ``max_len`` tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    out = {}
    for ds in datasets:
        items, skipped = _token_prompts(tok, ds, 0, n, data_dir, max_len)
        if skipped:
            say(f"[bench] {ds}: skipped {skipped} prompt(s) longer than {max_len} tokens "
                f"(max-model-len minus max-tokens)")
        if not items:
            raise SystemExit(f"[bench] {ds}: no prompt fits")
        out[ds] = items
    return out


def load_held_out_prompts(model: str, datasets: list[str], after: int, count: int,
                          data_dir: str | None, max_len: int) -> dict[str, list[dict]]:
    """Up to ``count`` prompts of each dataset from those after its first ``after``: real text
    of the measured kind that no measured request holds, to warm engines up with. A method
    that learns across requests (suffix decoding's global cache, PTD's engine-wide
    acceptance estimates) then starts the measurement as it would in service, neither primed
    with the measured outputs nor misled by an artificial text. A dataset with none left
    maps to an empty list."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return {ds: _token_prompts(tok, ds, after, after + count, data_dir, max_len)[0]
            for ds in datasets}
