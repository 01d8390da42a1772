"""The interleaved run: every engine runs every batch in turn, the order rotating."""
from __future__ import annotations

import time

from vllm_ptd.bench.engines import Engine, EngineFailed


def prompts_per_call(num_prompts: int, batch_size: int, continuous: bool) -> int:
    """Prompts one generate call carries: a closed batch of ``batch_size``, or with
    ``continuous`` batching all of a dataset's ``num_prompts``."""
    return max(1, num_prompts) if continuous else batch_size


def run_interleaved(engines: list[Engine], prompts: dict[str, list[dict]], batch_sizes: list[int],
                    repeats: int, max_tokens: int, settle: float, warmup: bool,
                    progress: bool = True, on_repeat_done=None, say=print,
                    warmup_prompts: dict[str, list[dict]] | None = None,
                    continuous: bool = False) -> list[dict]:
    """Every engine runs every batch of prompts in turn; the order rotates per batch.
    Returns one record per (engine, dataset, batch size, repeat, batch).

    Closed batches (the default) submit ``bs`` prompts together and wait for all of them:
    a batch lasts as long as its slowest request. ``continuous`` submits each dataset's
    prompts in one call (one "batch" per dataset and repeat, chunk 0) to engines started
    with ``max_num_seqs`` = the batch size, so vLLM's scheduler starts a waiting request
    whenever one finishes, as in offline use of ``LLM.generate`` over many prompts.

    The warm-up (``warmup``) runs, unrecorded, one batch of each size per dataset on
    ``warmup_prompts`` (held-out prompts of that dataset, repeated to fill the batch); a
    dataset without any is warmed up on its first measured batch reversed."""
    try:
        from tqdm import tqdm
    except ImportError:  # the [bench] extra has it; plain progress lines otherwise
        tqdm = None
    work = []
    for r in range(repeats):
        for ds, items in prompts.items():
            for bs in batch_sizes:
                step = prompts_per_call(len(items), bs, continuous)
                for ci, start in enumerate(range(0, len(items), step)):
                    work.append((r, ds, bs, ci, list(range(start, min(start + step, len(items))))))
    live = list(engines)
    records: list[dict] = []

    def turn(order, item, record: bool, bar=None, max_tok: int = max_tokens, warm=False):
        r, ds, bs, ci, idx = item
        batch = [prompts[ds][i]["ids"] for i in idx]
        # a prompt's own limit (``max_tokens`` in its dict, see --min-tokens-limit)
        limits = [min(prompts[ds][i].get("max_tokens", max_tok), max_tok) for i in idx]
        if warm:
            batch = batch[:bs]  # a continuous run warms up on one batch's worth
            # a text no measured request holds, so a method that remembers earlier requests
            # (suffix decoding's global cache) learns nothing of the measured outputs
            spare = (warmup_prompts or {}).get(ds) or []
            batch = ([spare[i % len(spare)]["ids"] for i in range(len(batch))] if spare
                     else [list(reversed(ids)) for ids in batch])
            limits = limits[:len(batch)]
        for e in order:
            if e not in live:
                continue
            if bar is not None:
                bar.set_postfix_str(f"{ds} bs={bs} rep={r} {e.label}", refresh=False)
            try:
                res = e.generate(batch, limits)
            except EngineFailed as err:
                live.remove(e)
                say(f"[bench] engine {e.label} failed and leaves the run: {err}\n{e.log_tail()}")
                continue
            finally:
                if bar is not None:
                    bar.update(1)
            if settle > 0:
                time.sleep(settle)  # let the finished engine's worker stop spinning
            if record:
                records.append({"method": e.label, "dataset": ds, "batch_size": bs, "repeat": r,
                                "chunk": ci, "prompt_index": idx, "limits": limits,
                                "wall": res["wall"],
                                "tokens": sum(len(o) for o in res["outputs"]),
                                "outputs": res["outputs"], "counters": res["counters"],
                                "trace": res["trace"], "steps": res.get("steps", [])})

    if warmup:  # one-time costs (first shapes, allocator) out of the measurement
        seen = set()
        for item in work:
            key = (item[2], item[1]) if warmup_prompts else item[2]  # (size, dataset) or size
            if key not in seen:
                seen.add(key)
                turn(list(live), item, record=False, max_tok=min(32, max_tokens), warm=True)
    total = len(work) * len(live)
    bar = tqdm(total=total, desc="benchmark", unit="gen", dynamic_ncols=True) \
        if (progress and tqdm is not None) else None
    last_r = 0
    for k, item in enumerate(work):
        if item[0] != last_r and on_repeat_done is not None:
            on_repeat_done(records, last_r)
        last_r = item[0]
        shift = k % max(1, len(engines))
        order = engines[shift:] + engines[:shift]
        turn(order, item, record=True, bar=bar)
        if bar is None and progress:
            say(f"[bench] {k + 1}/{len(work)} batches")
    if bar is not None:
        bar.close()
    return records
