"""Memory of PTD's per-request drafting state, measured (no vLLM, no model).

  python scripts/bench_state_memory.py --requests 1,64,512 --gen-tokens 512
  python scripts/bench_state_memory.py --requests 32 --gen-tokens 64 --churn-rounds 8
  python scripts/bench_state_memory.py --requests 32 --gen-tokens 64 --churn-rounds 80 \
      --history-tokens 100000

Each request starts with a benchmark prompt (chat template applied) and then commits
``--gen-tokens`` tokens, one step at a time, as a decoding engine would: every step it
proposes a tree, and the outcome commits the next token of a text (another prompt, so the
text is real but not a copy of the request's own) and grows the draft tree from arbitrary
argmax tokens. Reported per configuration: Python heap bytes per request (``tracemalloc``,
the state's true size), the method's own estimate (``PTDMethod.nbytes``), and the nodes all
pools hold against the engine-wide cap ``engine_pool_nodes``. With ``--churn-rounds`` the
finished requests' texts go into the engine's history (``history_tokens``; off unless
``--history-tokens`` is given, so that the rounds show the per-request state alone): it
grows until it holds its cap, then stays under twice that.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import tracemalloc

from vllm_ptd.bench.methods import int_list


def _texts(model: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from vllm_ptd.datasets import chat_prompt_ids, load_prompts

    tok = AutoTokenizer.from_pretrained(model)
    out = []
    for name in ("mt_bench", "gsm8k", "humaneval", "mbpp"):
        out += [chat_prompt_ids(tok, p.text) for p in load_prompts(name, max(1, n // 4 + 1))]
    return out


def _decode(m, ids: list[str], texts: list[list[int]], first: int, gen_tokens: int,
            rng: random.Random) -> None:
    """Start ``ids`` on texts from index ``first`` on and decode ``gen_tokens`` steps: each
    step proposes a tree and commits the next token of what the request "generates" (other
    prompts' tokens, end to end), growing the draft tree from arbitrary argmax tokens."""
    from vllm_ptd.method import StepOutcome

    streams = []
    for i, rid in enumerate(ids):
        m.start(rid, texts[(first + i) % len(texts)])
        stream: list[int] = []
        k = first + i + 1
        while len(stream) < gen_tokens + 1:
            stream += texts[k % len(texts)]
            k += 1
        streams.append(stream)
    for step in range(gen_tokens):
        trees = m.propose(ids, [s[step] for s in streams])
        m.observe(ids, [StepOutcome(tree, s[step + 1],
                                    [rng.randrange(1, 49152) for _ in range(tree.num_nodes)],
                                    [], [s[step + 1]]) for tree, s in zip(trees, streams)])


def measure(config, texts: list[list[int]], requests: int, gen_tokens: int,
            seed: int = 0) -> dict:
    from vllm_ptd.ptd.method import PTDMethod

    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    m = PTDMethod(config, [2])
    _decode(m, [f"r{i}" for i in range(requests)], texts, 0, gen_tokens, random.Random(seed))
    gc.collect()
    heap = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {"requests": requests, "gen_tokens": gen_tokens,
            "heap_bytes_per_request": heap / requests,
            "estimate_bytes_per_request": m.nbytes() / requests,
            "pool_nodes": m.pool_nodes(), "engine_pool_nodes": config.engine_pool_nodes}


def measure_churn(config, texts: list[list[int]], requests: int, gen_tokens: int,
                  rounds: int, seed: int = 0) -> list[int]:
    """Rounds of ``requests`` requests that start, decode ``gen_tokens`` tokens and finish,
    as a server's rounds of clients; the method's heap bytes left after each round (what a
    leak of per-request state would grow)."""
    from vllm_ptd.ptd.method import PTDMethod

    rng = random.Random(seed)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    m = PTDMethod(config, [2])
    left = []
    for rnd in range(rounds):
        ids = [f"round{rnd}-{i}" for i in range(requests)]
        _decode(m, ids, texts, rnd, gen_tokens, rng)
        for rid in ids:
            m.finish(rid)
        gc.collect()
        left.append(tracemalloc.get_traced_memory()[0] - base)
    tracemalloc.stop()
    return left


def main(argv: list[str] | None = None) -> int:
    from vllm_ptd.model_store import default_model_path
    from vllm_ptd.ptd.config import PTDConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--requests", type=int_list, default=[1, 64, 512])
    ap.add_argument("--gen-tokens", type=int, default=512)
    ap.add_argument("--engine-pool-nodes", type=int, default=None,
                    help="the engine-wide pool cap (default: PTDConfig's)")
    ap.add_argument("--churn-rounds", type=int, default=0,
                    help="instead: this many rounds of --requests requests that start, decode "
                         "and finish; the heap left after each round")
    ap.add_argument("--history-tokens", type=int, default=0,
                    help="the engine's history of finished texts (PTDConfig.history_tokens; "
                         "default 0: off)")
    ap.add_argument("--out", default=None, help="JSON file for the records")
    args = ap.parse_args(argv)
    opts = {"history_tokens": args.history_tokens}
    if args.engine_pool_nodes is not None:
        opts["engine_pool_nodes"] = args.engine_pool_nodes
    config = PTDConfig(**opts).resolved("cpu")
    texts = _texts(default_model_path(), max(args.requests))
    if args.churn_rounds:
        left = measure_churn(config, texts, args.requests[0], args.gen_tokens, args.churn_rounds)
        print("| round | heap KiB left after the round |\n|---|---|")
        for rnd, b in enumerate(left, start=1):
            print(f"| {rnd} | {b / 1024:.0f} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"requests": args.requests[0], "gen_tokens": args.gen_tokens,
                           "heap_bytes_after_round": left}, f, indent=1)
        return 0
    print("| requests | generated tokens | heap KiB / request | estimate KiB / request | "
          "pool nodes (cap) |\n|---|---|---|---|---|")
    records = []
    for n in args.requests:
        r = measure(config, texts, n, args.gen_tokens)
        records.append(r)
        print(f"| {n} | {r['gen_tokens']} | {r['heap_bytes_per_request'] / 1024:.0f} | "
              f"{r['estimate_bytes_per_request'] / 1024:.0f} | {r['pool_nodes']} "
              f"({r['engine_pool_nodes']}) |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    return 0
