"""Soak test of a serving method: many concurrent streaming clients, a share of them
disconnecting mid-stream, round after round, on loopback only.

  python scripts/soak.py --method ptd --clients 32 --abort-share 0.25 --rounds 6 \\
      --max-tokens 64 --out results/soak_ptd

It starts ``vllm-ptd serve`` for the method and one for plain decoding (the reference
outputs), both on 127.0.0.1 (``--method none`` soaks plain decoding itself, with one
server: the memory baseline to read a method's figures against). Each round sends
``--requests`` prompts (default: 2 per client) from ``--clients`` concurrent clients; a
client marked to abort closes its connection after ``--abort-after`` streamed chunks. After
each round it waits for the server to have no request running or waiting, then records:

* errors: non-200 answers and failed requests that were not aborted on purpose;
* identical: finished (not aborted) outputs equal to plain decoding's for the same prompt
  (greedy, fp32 by default, so equality is exact);
* left running: ``vllm:num_requests_running`` + ``waiting`` once the round is over (after a
  grace period of ``--drain-timeout`` seconds);
* memory: resident memory of the server's process tree (API server + engine) in MiB.

A slow leak shows as memory rising round over round: the report gives each round's figure and
the least-squares slope over rounds 2..N (round 1 includes warm-up allocations). Bounded:
``--rounds`` and ``--round-timeout`` cap the run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from vllm_ptd.bench.host import REPO, host_info, resolve_common_args
from vllm_ptd.bench.methods import parse_method
from vllm_ptd.bench.prompts import load_token_prompts
from vllm_ptd.bench.serving import Server, start_servers, stream_chunks


def tree_rss_mib(pid: int) -> float | None:
    """Resident memory of a process and all its descendants, MiB (from /proc)."""
    def children(p: int) -> list[int]:
        out = []
        try:
            for t in Path(f"/proc/{p}/task").iterdir():
                txt = (t / "children").read_text().split()
                out += [int(c) for c in txt]
        except OSError:
            pass
        return out

    total, stack, seen = 0, [pid], set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
        stack += children(p)
    return total / 1024 if seen else None


def running_requests(server: Server) -> int | None:
    import urllib.request

    try:
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    n = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            n += float(line.rsplit(" ", 1)[1])
    return int(n)


async def one_request(session, server: Server, ids: list[int], max_tokens: int,
                      abort_after: int | None) -> dict:
    payload = {"model": server.model_id, "prompt": ids, "max_tokens": max_tokens,
               "temperature": 0.0, "stream": True}
    text, chunks, error, aborted = [], 0, None, False
    try:
        async with session.post(server.url + "/v1/completions", json=payload) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            else:
                async for obj in stream_chunks(resp):
                    for ch in obj.get("choices") or []:
                        if ch.get("text"):
                            text.append(ch["text"])
                            chunks += 1
                    if abort_after is not None and chunks >= abort_after:
                        aborted = True
                        resp.close()  # the client goes away mid-stream
                        break
    except Exception as e:  # noqa: BLE001 - counted, the soak goes on
        error = f"{type(e).__name__}: {e}"
    return {"text": "".join(text), "error": error, "aborted": aborted}


async def run_round(server: Server, jobs: list[tuple[int, list[int], int | None]],
                    clients: int, max_tokens: int, timeout: float) -> list[dict]:
    import aiohttp

    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    results: dict[int, dict] = {}
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=30, sock_read=600)) as session:
        async def client():
            while True:
                try:
                    k, ids, abort_after = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                res = await one_request(session, server, ids, max_tokens, abort_after)
                results[k] = res

        await asyncio.wait_for(asyncio.gather(*(client() for _ in range(clients))), timeout)
    return [results[k] for k, _, _ in jobs]


def slope(ys: list[float]) -> float | None:
    """Least-squares slope of ys against 0, 1, 2, ..."""
    if len(ys) < 2:
        return None
    xs = list(range(len(ys)))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--method", default="ptd", help="as in scripts/benchmark.py --methods")
    ap.add_argument("--model", default=None)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=None, help="per round (default 2 x clients)")
    ap.add_argument("--abort-share", type=float, default=0.25)
    ap.add_argument("--abort-after", type=int, default=4, help="streamed chunks before aborting")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--round-timeout", type=float, default=1800)
    ap.add_argument("--drain-timeout", type=float, default=30)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--datasets", default="mt_bench,gsm8k,humaneval,mbpp")
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts per dataset")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--kv-cache-gib", type=float, default=None)
    ap.add_argument("--server-timeout", type=float, default=900)
    ap.add_argument("--out", default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    resolve_common_args(args)
    args.prefix_caching = False
    args.start_jobs = 2
    out = Path(args.out or REPO / "results" / time.strftime("soak-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    nreq = args.requests or 2 * args.clients
    args.clients = [args.clients]  # Server.start sizes --max-num-seqs from this list
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    by = load_token_prompts(args.model, datasets, args.num_prompts, None,
                            args.max_model_len - args.max_tokens)
    prompts = [p["ids"] for d in datasets for p in by[d]]
    method = parse_method(args.method)
    plain = parse_method("none")
    # --method none soaks plain decoding itself (the memory baseline for the tree methods):
    # one server gives the reference outputs and then takes the rounds
    baseline = method.label == plain.label
    servers, failed = start_servers(args, [plain] if baseline else [plain, method], out)
    if failed:
        for s in servers:
            s.stop()
        raise SystemExit(f"[soak] servers failed to start: {failed}")
    ref_server, server = servers[0], servers[-1]
    rng = random.Random(args.seed)
    rounds = []
    try:
        # reference outputs: plain decoding of every prompt, one at a time
        ref = asyncio.run(run_round(ref_server, [(i, p, None) for i, p in enumerate(prompts)],
                                    4, args.max_tokens, args.round_timeout))
        ref_text = [r["text"] for r in ref]
        if not baseline:
            ref_server.stop()
        for r in range(args.rounds):
            jobs = []
            for k in range(nreq):
                i = rng.randrange(len(prompts))
                jobs.append((k, prompts[i], args.abort_after if rng.random() < args.abort_share
                             else None, i))
            t0 = time.time()
            res = asyncio.run(run_round(server, [(k, p, a) for k, p, a, _ in jobs],
                                        args.clients[0], args.max_tokens, args.round_timeout))
            wall = time.time() - t0
            deadline = time.time() + args.drain_timeout
            left = running_requests(server)
            while left and time.time() < deadline:
                time.sleep(1)
                left = running_requests(server)
            mem = tree_rss_mib(server.proc.pid) if server.proc else None
            finished = [(x, jobs[k][3]) for k, x in enumerate(res)
                        if not x["aborted"] and not x["error"]]
            same = sum(x["text"] == ref_text[i] for x, i in finished)
            rec = {"round": r + 1, "wall_s": wall, "requests": nreq,
                   "aborted": sum(x["aborted"] for x in res),
                   "errors": sum(1 for x in res if x["error"] and not x["aborted"]),
                   "error_samples": [x["error"] for x in res if x["error"]][:3],
                   "finished": len(finished), "identical": same, "left_running": left,
                   "rss_mib": mem}
            rounds.append(rec)
            print(f"[soak] round {r + 1}/{args.rounds}: {rec['finished']} finished "
                  f"({same} identical to plain), {rec['aborted']} aborted, {rec['errors']} "
                  f"errors, {left} left running, server RSS {mem:.0f} MiB, {wall:.0f}s",
                  flush=True)
    finally:
        for s in servers:
            s.stop()
    mems = [x["rss_mib"] for x in rounds if x["rss_mib"] is not None]
    growth = slope(mems[1:]) if len(mems) > 2 else None
    summary = {"method": method.label, "spec": method.spec, "clients": args.clients[0],
               "requests_per_round": nreq, "abort_share": args.abort_share,
               "rounds": rounds, "errors": sum(x["errors"] for x in rounds),
               "identical": sum(x["identical"] for x in rounds),
               "finished": sum(x["finished"] for x in rounds),
               "left_running_max": max((x["left_running"] or 0) for x in rounds),
               "rss_slope_mib_per_round": growth, "host": host_info(), "args": vars(args)}
    lines = [f"# Soak: {method.label}, {args.clients[0]} clients, {nreq} requests a round, "
             f"{args.abort_share:.0%} aborting after {args.abort_after} chunks, "
             f"{args.max_tokens} tokens, {args.dtype}", "",
             "| round | finished | identical to plain | aborted | errors | left running | "
             "server RSS MiB | wall s |", "|---|---|---|---|---|---|---|---|"]
    for x in rounds:
        lines.append(f"| {x['round']} | {x['finished']} | {x['identical']} | {x['aborted']} | "
                     f"{x['errors']} | {x['left_running']} | {x['rss_mib']:.0f} | "
                     f"{x['wall_s']:.0f} |")
    lines += ["", f"Memory slope over rounds 2..{len(rounds)}: "
              + (f"{growth:+.1f} MiB per round" if growth is not None else "—"), ""]
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    (out / "soak.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print("\n".join(lines))
    ok = summary["errors"] == 0 and summary["identical"] == summary["finished"] \
        and summary["left_running_max"] == 0
    return 0 if ok else 1
