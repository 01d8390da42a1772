"""Where a method's greedy output parts from plain decoding's in bf16, was plain decoding at a
near-tie there?

A forward over many rows rounds differently from a one-row forward, and in bf16 (or fp16)
that can flip the argmax where the target's top two logits lie within rounding of each other;
vLLM's own ``ngram`` does the same. A first divergence where plain decoding was sure of its
token is a bug (a wrong position, mask or K/V), so a run that finds divergences explains
them: after the timed run, the plain engine runs again, untimed, each batch in which some
method diverged, asking for its top-2 log-probabilities (their gap is the gap of the two
logits), and the gap at each first divergence is read off it. In fp32 nothing is explained:
outputs must be identical. The tests apply the same bound (``tests/test_vllm_bf16.py``).
"""
from __future__ import annotations

# bf16 logits of the embedded model (|logit| ~ 16-32) are spaced 0.125, and a forward over
# more rows rounds every one of its 30 layers differently: a few units of that spacing is a
# near-tie
TIE_GAP = 0.5
EXPLAINED_DTYPES = ("bfloat16", "bf16", "float16", "fp16", "half")
# what the reports' "identical" column adds in bf16
LEGEND = (f"n/m at near-ties: of the m outputs that part from plain decoding, n where its top-2 "
          f"logits were within {TIE_GAP} at the first divergence; unknown: plain decoding's "
          f"rerun with logprobs did not reproduce its timed output")


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter one's length where one is a
    prefix of the other); None where they are equal."""
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gaps(logprobs) -> list[float]:
    """Per output token, the gap between the top two log-probabilities (vLLM's
    ``CompletionOutput.logprobs``: one ``{token: Logprob}`` per token); inf with one entry."""
    gaps = []
    for lp in logprobs or []:
        best = sorted((v.logprob for v in lp.values()), reverse=True)
        gaps.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    return gaps


def plain_records(records: list[dict]) -> dict[tuple, dict]:
    """Plain decoding's record of each batch, by (dataset, batch size, repeat, chunk): what
    every other method's outputs are compared with."""
    return {(x["dataset"], x["batch_size"], x["repeat"], x["chunk"]): x
            for x in records if x["method"] == "none"}


def divergences(records: list[dict]) -> list[tuple[dict, dict, int, int]]:
    """(record, plain record of the same batch, output slot, first divergence) for every
    output of a method that is not plain decoding's."""
    plain = plain_records(records)
    out = []
    for x in records:
        ref = plain.get((x["dataset"], x["batch_size"], x["repeat"], x["chunk"]))
        if x["method"] == "none" or ref is None:
            continue
        for j, (a, b) in enumerate(zip(x["outputs"], ref["outputs"])):
            k = first_divergence(a, b)
            if k is not None:
                out.append((x, ref, j, k))
    return out


def gap_at_divergence(rerun_output: list[int], rerun_gaps: list[float],
                      timed_output: list[int], k: int) -> float | None:
    """Plain decoding's top-2 gap at token ``k`` from its rerun with logprobs; None where the
    rerun did not reproduce the timed output (its gaps then belong to another text)."""
    return rerun_gaps[k] if rerun_output == timed_output and k < len(rerun_gaps) else None


def explain_divergences(plain_engine, records: list[dict], prompts: dict[str, list[dict]],
                        say=print) -> int:
    """Sets ``divergence_gaps`` ({output slot: plain decoding's top-2 gap at the first
    divergence, or None where the plain rerun did not reproduce its timed output}) on every
    record with a divergence, rerunning each affected plain batch once with ``logprobs=2``
    (untimed: the run's timings are already taken). Returns how many outputs diverged."""
    found = divergences(records)
    reruns: dict[tuple, dict] = {}
    for x, ref, j, k in found:
        key = (ref["dataset"], ref["batch_size"], ref["chunk"])
        if key not in reruns:
            batch = [prompts[ref["dataset"]][i]["ids"] for i in ref["prompt_index"]]
            reruns[key] = plain_engine.generate(batch, ref["limits"], logprobs=2)
        rerun = reruns[key]
        x.setdefault("divergence_gaps", {})[j] = gap_at_divergence(
            rerun["outputs"][j], rerun["top2_gaps"][j], ref["outputs"][j], k)
    if found:
        gaps = [x["divergence_gaps"][j] for x, _, j, _ in found]
        near, known, differed = count_near_ties(gaps)
        shown = ", ".join("?" if g is None else f"{g:.3f}" for g in gaps[:12])
        say(f"[bench] {len(found)} outputs part from plain decoding; at {near} of the {known} "
            f"whose plain rerun reproduced the timed output, plain decoding's top-2 logits were "
            f"within {TIE_GAP} (a near-tie); {differed} left unknown, the rerun's own output "
            f"differing ({len(reruns)} plain batches rerun with logprobs); gaps: "
            f"{shown}{', ...' if len(gaps) > 12 else ''}")
    return len(found)


def explain_run(engines: list, records: list[dict], prompts: dict[str, list[dict]], dtype: str,
                say=print) -> None:
    """``explain_divergences`` where the run's dtype rounds coarsely (bf16, fp16) and its
    plain engine (label ``none``) is still up."""
    plain = next((e for e in engines if e.label == "none" and not e.error), None)
    if dtype not in EXPLAINED_DTYPES or plain is None:
        return
    try:
        explain_divergences(plain, records, prompts, say)
    except RuntimeError as e:  # EngineFailed: the plain engine died during the rerun
        say(f"[bench] divergences left unexplained: {e}")


def count_near_ties(gaps: list[float | None]) -> tuple[int, int, int]:
    """Of plain decoding's top-2 gaps at first divergences (None: unknown): (at a near-tie,
    with a known gap, unknown)."""
    known = [g for g in gaps if g is not None]
    return sum(g <= TIE_GAP for g in known), len(known), len(gaps) - len(known)


def near_tie_note(near: int, known: int, unknown: int) -> str:
    """What a report's identical cell adds in bf16: `` (n/m at near-ties; k unknown)``, the
    parts that are not empty, or nothing."""
    notes = ([f"{near}/{known} at near-ties"] if known else []) + \
        ([f"{unknown} unknown"] if unknown else [])
    return f" ({'; '.join(notes)})" if notes else ""


def near_tie_counts(records: list[dict]) -> tuple[int, int, int]:
    """``count_near_ties`` over ``records``' divergences (``explain_divergences``)."""
    return count_near_ties([g for x in records for g in x.get("divergence_gaps", {}).values()])
