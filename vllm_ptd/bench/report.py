"""The run's markdown report."""
from __future__ import annotations

import math

from vllm_ptd.bench.aggregate import ALL
from vllm_ptd.bench.methods import Method
from vllm_ptd.bench.near_ties import EXPLAINED_DTYPES, LEGEND, near_tie_note
from vllm_ptd.bench.prompts import token_limit_text


def fmt(x, nd=2) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def fmt_pm(s: dict, nd=2) -> str:
    if s["mean"] is None:
        return "—"
    if s["sd"] is None:
        return f"{s['mean']:.{nd}f}"
    return f"{s['mean']:.{nd}f} ± {s['sd']:.{nd}f}"


def identical_cell(r: dict) -> str:
    """``same/compared``, and where divergences were explained (bf16), how many of them were
    at near-ties of plain decoding."""
    if r.get("method", r.get("label")) == "none":
        return "ref"
    if not r["compared"]:
        return "—"
    return f"{r['identical']}/{r['compared']}" + near_tie_note(
        r.get("near_ties", 0), r.get("explained", 0), r.get("unexplained", 0))


def _metric_cells(spec: dict, method_name: str) -> list[str]:
    if spec.get("source") is None:
        return ["—"] * 5 + [fmt(spec.get("DE_all")), fmt(spec.get("rows_all"), 1)]
    return [fmt(spec.get("DE")), fmt(spec.get("AL")), fmt(spec.get("HR")),
            f"{fmt(spec.get('Dft'), 1)}/{fmt(spec.get('Ver'), 1)}", spec["source"],
            fmt(spec.get("DE_all")), fmt(spec.get("rows_all"), 1)]


def _method_cells(r: dict, method_name: str) -> str:
    """tok/s | speedup | DE .. rows/step | identical, of one aggregate row."""
    return " | ".join([fmt_pm(r["tok_s"], 1), fmt_pm(r["speedup"])]
                      + _metric_cells(r["spec"], method_name) + [identical_cell(r)])


def markdown_report(agg: dict, meta: dict, methods: list[Method], failed: dict) -> str:
    rows = agg["rows"]
    names = {m.label: m.name for m in methods}
    labels = [m.label for m in methods if m.label not in failed]
    dsets = []
    for r in rows:
        if r["dataset"] not in dsets:
            dsets.append(r["dataset"])
    bss = sorted({r["batch_size"] for r in rows})
    get = {(r["method"], r["batch_size"], r["dataset"]): r for r in rows}
    L = ["# Speculative decoding benchmark", ""]
    limit = token_limit_text(meta["max_tokens"], meta.get("min_tokens_limit"))
    L.append(f"- model: `{meta['model']}`, dtype {meta['dtype']}, greedy, {limit} "
             f"new tokens, {meta['repeats']} repeat(s), batch sizes {meta['batch_sizes']}"
             + (" (continuous batching: each dataset's prompts in one call, at most the batch "
                "size running)" if meta.get("batching") == "continuous" else ""))
    L.append("- prompts per dataset: " + ", ".join(f"{d} {n}" for d, n in meta["prompts"].items()))
    cpu = meta["host"].get("cpu")
    L.append(f"- host: {meta['host']['cpus']} CPUs{' of ' + cpu if cpu else ''}, "
             f"{meta['host']['platform']}; vLLM "
             f"{meta['host'].get('vllm')}, torch {meta['host'].get('torch')}; "
             f"started {meta['started']}, {meta['elapsed_s']:.0f}s")
    L.append("- methods interleaved in one run (each in its own engine process, order rotating "
             "per batch); speedup = tok/s / tok/s of `none` per dataset, batch size and repeat; "
             "`a ± b` = mean ± sample standard deviation over repeats")
    if failed:
        L.append("- skipped: " + "; ".join(f"`{k}` ({v})" for k, v in failed.items()))
    L.append("")
    for bs in bss:
        L += [f"## Speedup over plain decoding, batch size {bs}", ""]
        L.append("| method | " + " | ".join(dsets) + " |")
        L.append("|---|" + "---|" * len(dsets))
        for m in labels:
            L.append(f"| {m} | " + " | ".join(
                fmt_pm(get[(m, bs, d)]["speedup"]) if (m, bs, d) in get else "—" for d in dsets) + " |")
        L.append("")
    summary = ALL if ALL in dsets else dsets[0]
    for bs in bss:
        L += [f"## Methods, batch size {bs}, {summary if summary != ALL else 'all datasets pooled'}", ""]
        L.append("| method | tok/s | speedup | DE | AL | HR | Dft/Ver | src | DE_all | rows/step "
                 "| identical |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for m in labels:
            r = get.get((m, bs, summary))
            if r is None:
                continue
            L.append(f"| {m} | {_method_cells(r, names[m])} |")
        L.append("")
    if len(dsets) > 1:
        L += ["## Per dataset", ""]
        L.append("| bs | dataset | method | tok/s | speedup | DE | AL | HR | Dft/Ver | src | DE_all "
                 "| rows/step | identical |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for bs in bss:
            for d in dsets:
                if d == ALL:
                    continue
                for m in labels:
                    r = get.get((m, bs, d))
                    if r is None:
                        continue
                    L.append(f"| {bs} | {d} | {m} | {_method_cells(r, names[m])} |")
        L.append("")
    timed = [(bs, m, get[(m, bs, summary)]["step_times"]) for bs in bss for m in labels
             if (m, bs, summary) in get and get[(m, bs, summary)].get("step_times")]
    if timed:
        L += ["## Where a step's time goes (ms per engine step, mean)", "",
              "| bs | method | rows | wall | forward (model + logits) | of which tree attention "
              "| verification | drafting | budget | vLLM host work | accepted / drafted |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
        for bs, m, t in timed:
            v = get[(m, bs, summary)]["spec"].get("vllm", {})
            rate = v.get("draft_acceptance_rate")
            L.append(f"| {bs} | {m} | {t['rows']:.1f} | {t['wall']:.1f} | {t['forward']:.1f} | "
                     f"{t['tree_attention']:.1f} | {t['verify']:.1f} | {t['drafting']:.1f} | "
                     f"{t['budget']:.1f} | {t['other']:.1f} | {fmt(rate)} |")
        L += ["", "Timed by the proposer on every engine step (prefill steps and steps without "
              "a tree included); vLLM host work = wall - the timed parts.", ""]
    L += ["## Cross-check: proposer trace against vLLM's spec-decode counters (all runs)", "",
          "| method | trace steps | vLLM drafts | trace accepted | vLLM accepted | vLLM draft tokens "
          "| vLLM mean acceptance length | generated (outputs) | vLLM generation_tokens |",
          "|---|---|---|---|---|---|---|---|---|"]
    for m in labels:
        p = agg["pooled"][m]
        v = p["vllm"]
        L.append(f"| {m} | {p['trace_steps']} | {v['drafts']} | {p['trace_accepted']} | "
                 f"{v['accepted']} | {v['draft_tokens']} | {fmt(v['mean_acceptance_length'])} | "
                 f"{p['gen_tokens']} | {v['generation_tokens']} |")
    L += ["", "Columns: DE = committed tokens per speculative step (= tau), AL = committed tokens "
          "per hit step, HR = steps with >= 1 accepted draft token, Dft/Ver = draft/verify rows "
          "per speculative step; src = trace (proposer trace) or vllm (vLLM counters: ngram); "
          "DE_all = generated tokens / request-steps over all steps including prefill and "
          "steps without a draft; rows/step = extra rows per request-step over all steps; "
          "identical = outputs token-identical to `none` (same prompt, batch, repeat; bf16 "
          "flips near-ties, use --dtype float32 for an identity check"
          + (f"; {LEGEND}" if meta.get("dtype") in EXPLAINED_DTYPES else "") + ").", ""]
    return "\n".join(L)
