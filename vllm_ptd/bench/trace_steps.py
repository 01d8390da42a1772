"""Steps of a proposer trace grouped by how many requests they ran and whether any carried a
tree: mean rows, wall, forward, verification and host ms (``VLLM_PTD_TRACE`` step records;
steps of 1 s or more are the engine waiting and left out).

  python -m vllm_ptd.bench.trace_steps results/bs4_16/traces/ptd.jsonl [--requests 16]
"""
from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict

from vllm_ptd.bench.aggregate import busy_steps


def step_groups(lines, requests: int | None = None) -> dict[tuple[int, bool], dict]:
    """``{(requests, with trees): {"steps", "rows", "wall", "forward", "verify", "host"}}``;
    host = wall - forward - drafting (vLLM's and the proposer's host work)."""
    records = [json.loads(line)["step"] for line in lines if line.startswith('{"step"')]
    groups: dict[tuple[int, bool], list[dict]] = defaultdict(list)
    for s in busy_steps(records):
        if "requests" in s and requests in (None, s["requests"]):
            groups[(s["requests"], s["trees"] > 0)].append(s)
    out = {}
    for key, steps in sorted(groups.items()):
        n = len(steps)

        def mean(k: str) -> float:
            return sum(s[k] for s in steps) / n

        out[key] = {"steps": n, "rows": mean("rows"), "wall": mean("wall_ms"),
                    "forward": mean("forward_ms"), "verify": mean("verify_ms"),
                    "host": mean("wall_ms") - mean("forward_ms") - mean("drafting_ms")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a VLLM_PTD_TRACE file (.jsonl or .jsonl.gz)")
    ap.add_argument("--requests", type=int, default=None, help="only steps that ran this many")
    args = ap.parse_args(argv)
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        groups = step_groups(f, args.requests)
    print("| requests | trees | steps | rows | wall ms | forward ms | verification ms | host ms |")
    print("|---|---|---|---|---|---|---|---|")
    for (req, trees), g in groups.items():
        print(f"| {req} | {'yes' if trees else 'no'} | {g['steps']} | {g['rows']:.1f} | "
              f"{g['wall']:.1f} | {g['forward']:.1f} | {g['verify']:.1f} | {g['host']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
