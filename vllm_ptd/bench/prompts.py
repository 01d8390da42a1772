"""Benchmark prompts as chat-templated token ids."""
from __future__ import annotations



def load_token_prompts(model: str, datasets: list[str], n: int | None, data_dir: str | None,
                       max_len: int, say=print) -> dict[str, list[dict]]:
    from transformers import AutoTokenizer

    from vllm_ptd.datasets import chat_prompt_ids, load_prompts

    tok = AutoTokenizer.from_pretrained(model)
    out = {}
    for ds in datasets:
        items, skipped = [], 0
        for p in load_prompts(ds, n, data_dir=data_dir):
            ids = chat_prompt_ids(tok, p.text)
            if len(ids) > max_len:
                skipped += 1
                continue
            items.append({"id": p.id, "ids": ids})
        if skipped:
            say(f"[bench] {ds}: skipped {skipped} prompt(s) longer than {max_len} tokens "
                f"(max-model-len minus max-tokens)")
        if not items:
            raise SystemExit(f"[bench] {ds}: no prompt fits")
        out[ds] = items
    return out
