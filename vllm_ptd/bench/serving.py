"""Online (serving) benchmark: OpenAI completions API with streaming, N concurrent clients.

Either it starts one server per method itself (``python -m vllm_ptd.cli serve MODEL ...``,
all at once on free local ports, logs in OUT/logs) and the methods take turns, the order
rotating per round, so that a shared machine's drift cancels in the ratios; or it measures
servers that are already running (``--base-url URL[,URL...]`` with ``--labels``).

  python scripts/bench_serving.py --methods none,ngram:6,ptd --clients 1,4 \
      --datasets mt_bench,gsm8k --num-prompts 8 --max-tokens 128 --repeats 2 --out results/serving
  python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --labels ptd --clients 4
  python scripts/benchmark.py --online ...     # the same

Each round sends every prompt once (greedy, prompts as chat-templated token ids, stop at EOS
or --max-tokens) from ``clients`` concurrent clients that pull the next prompt when their
previous request finishes. Measured per round: throughput = completion tokens (the server's
usage count) / wall time from the first request sent to the last response finished; per
request: TTFT (first streamed text), ITL (gaps between streamed chunks; with speculation one
chunk may carry several tokens), TPOT ((end - TTFT) / (tokens - 1)); mean / p50 / p90 over
all requests of all rounds. Speedup = throughput / throughput of ``none`` in the same
repeat and client count. For servers this script started, DE/AL/HR come from the proposer
trace (ptd/pctree) or the server's /metrics spec-decode counters (ngram), which are also
kept for every method as a cross-check.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from vllm_ptd.bench.aggregate import busy_steps, mean_sd, spec_summary
from vllm_ptd.bench.engines import engine_env, read_trace, traced
from vllm_ptd.bench.trace_steps import decode_speedup
from vllm_ptd.bench.host import REPO, host_info, resolve_common_args
from vllm_ptd.bench.methods import Method, int_list, parse_methods, safe_label
from vllm_ptd.bench.prompts import (load_held_out_prompts, load_token_prompts,
                                    per_prompt_limits, set_token_limits, token_limit_text)
from vllm_ptd.bench.report import fmt, fmt_pm, identical_cell

DEFAULT_METHODS = "none,ngram:6,ptd"

_PROM = {"vllm:spec_decode_num_drafts_total": "drafts",
         "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
         "vllm:spec_decode_num_accepted_tokens_total": "accepted",
         "vllm:generation_tokens_total": "generation_tokens",
         "vllm:prompt_tokens_total": "prompt_tokens"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One method's server: started by this script (``method``) or given (``url``)."""

    def __init__(self, label: str, url: str | None = None, method: Method | None = None):
        self.label = label
        self.method = method
        self.url = url.rstrip("/") if url else None
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.trace_path: str | None = None
        self.trace_pos = 0
        self.model_id: str | None = None
        self.error: str | None = None
        self.load_s: float | None = None
        self._t0 = 0.0

    def start(self, args, log_dir: Path, trace_dir: Path) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{safe_label(self.label)}.log"
        cmd = [sys.executable, "-m", "vllm_ptd.cli", "serve", args.model, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
               "--max-num-seqs", str(max(args.clients)), "--seed", str(args.seed)]
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # that variable wins when set
            cmd += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
        if not args.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if args.enforce_eager:
            cmd.append("--enforce-eager")
        if self.method.spec is not None:
            cmd += ["--speculative-config", json.dumps(self.method.spec)]
        env = engine_env(dict(os.environ))  # also for servers started without main()
        env.pop("VLLM_PTD_TRACE", None)
        if traced(self.method):
            self.trace_path = str(trace_dir / f"{safe_label(self.label)}.jsonl")
            open(self.trace_path, "w").close()
            env["VLLM_PTD_TRACE"] = self.trace_path
        log = open(self.log_path, "w")
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        self._t0 = time.time()
        # its own session, so that stop() reaches the engine processes it spawns
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(REPO), start_new_session=True)
        log.close()

    def poll_ready(self) -> bool:
        """True once the server answers (or has failed)."""
        import urllib.error
        import urllib.request

        if self.proc is not None and self.proc.poll() is not None:
            self.error = f"server exited with code {self.proc.returncode}"
            return True
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                data = json.loads(r.read())
            self.model_id = data["data"][0]["id"]
            self.load_s = time.time() - self._t0 if self._t0 else None
            return True
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError):
            return False

    def metrics(self) -> dict | None:
        """The server's spec-decode counters (None when /metrics is unavailable)."""
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            return None
        out = {v: 0 for v in _PROM.values()}
        pos: dict[int, int] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            head, _, val = line.rpartition(" ")
            name, rest = head.split("{", 1)[0], head
            try:
                value = float(val)
            except ValueError:
                continue
            if name in _PROM:
                out[_PROM[name]] += int(value)
            elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                p = rest.split('position="', 1)
                if len(p) == 2:
                    k = int(p[1].split('"', 1)[0])
                    pos[k] = pos.get(k, 0) + int(value)
        out["accepted_per_pos"] = [pos.get(i, 0) for i in range(max(pos) + 1)] if pos else []
        return out

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass

    def log_tail(self, n: int = 8) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except (OSError, AttributeError):
            return ""
        return "\n".join("      " + x[:300] for x in lines[-n:])


def start_servers(args, methods: list[Method], out: Path, say=print) -> tuple[list, dict]:
    log_dir, trace_dir = out / "logs", out / "traces"
    log_dir.mkdir(parents=True, exist_ok=True)
    trace_dir.mkdir(parents=True, exist_ok=True)
    pending = [Server(m.label, method=m) for m in methods]
    started = list(pending)
    loading, ready, failed = [], [], {}
    try:
        _start_loop(args, pending, loading, ready, failed, log_dir, trace_dir, say)
    except BaseException:  # interrupted: do not leave servers behind
        for s in started:
            s.stop()
        raise
    order = {m.label: i for i, m in enumerate(methods)}
    return sorted(ready, key=lambda s: order[s.label]), failed


def _start_loop(args, pending, loading, ready, failed, log_dir, trace_dir, say) -> None:
    while pending or loading:
        while pending and len(loading) < max(1, args.start_jobs):
            s = pending.pop(0)
            s.start(args, log_dir, trace_dir)
            say(f"[serve] starting {s.label} at {s.url} (log: {s.log_path})")
            loading.append(s)
        time.sleep(2)
        for s in list(loading):
            timed_out = time.time() - s._t0 > args.server_timeout
            if s.poll_ready() or timed_out:
                loading.remove(s)
                if s.model_id and not s.error:
                    ready.append(s)
                    say(f"[serve] {s.label} ready in {s.load_s:.0f}s")
                else:
                    s.error = s.error or f"not ready after {args.server_timeout:.0f}s"
                    failed[s.label] = s.error
                    say(f"[serve] SKIPPING {s.label}: its server failed to start: {s.error}\n"
                        f"      last lines of {s.log_path}:\n{s.log_tail()}")
                    s.stop()


async def stream_chunks(resp):
    """The JSON objects of an OpenAI streaming response (``data:`` lines), up to ``[DONE]``."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


async def _one_request(session, server: Server, ids: list[int], max_tokens: int) -> dict:
    payload = {"model": server.model_id, "prompt": ids, "max_tokens": max_tokens,
               "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    text, usage, error = [], None, None
    try:
        async with session.post(server.url + "/v1/completions", json=payload) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            else:
                async for obj in stream_chunks(resp):
                    now = time.perf_counter()
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for ch in obj.get("choices") or []:
                        if ch.get("text"):
                            if first is None:
                                first = now
                            else:
                                gaps.append(now - last)
                            last = now
                            text.append(ch["text"])
    except Exception as e:  # noqa: BLE001 - one failed request is reported, not fatal
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    ntok = int(usage["completion_tokens"]) if usage else None
    return {"start": t0, "end": end, "ttft": (first - t0) if first else None, "itl": gaps,
            "tokens": ntok, "text": "".join(text), "error": error,
            "tpot": ((end - first) / (ntok - 1)) if (first and ntok and ntok > 1) else None}


async def _round(server: Server, prompts: list[list[int]], clients: int,
                 max_tokens: int | list[int]) -> dict:
    """One round: ``clients`` streaming clients take the prompts in order (``max_tokens``:
    one limit, or one per prompt)."""
    limits = per_prompt_limits(max_tokens, len(prompts))
    import aiohttp

    queue: asyncio.Queue = asyncio.Queue()
    for i, p in enumerate(prompts):
        queue.put_nowait((i, p))
    results: list[dict | None] = [None] * len(prompts)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=1800)
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        async def client():
            while True:
                try:
                    i, p = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results[i] = await _one_request(session, server, p, limits[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"wall": wall, "requests": results}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _dist(xs: list[float]) -> dict:
    xs = [1000 * x for x in xs if x is not None]
    return {"mean": statistics.fmean(xs) if xs else None, "p50": _pct(xs, 0.5),
            "p90": _pct(xs, 0.9), "n": len(xs)}


def arrival_waves(requests: list[dict]) -> int | None:
    """How many groups the round's requests were sent in: sorted by send time, a request
    sent more than half a step after the one before it (a step: the median gap between
    streamed chunks of the round) starts a new group. In a closed loop whose requests all
    run to one limit, requests that end in one step send their successors together, and
    those prompts are prefilled in one step; a method that ends requests in different steps
    (speculation does) spreads the same prompts over more steps, each then carrying a
    prefill beside its decodes: fewer waves, longer waits for the first token; more waves,
    longer gaps between chunks."""
    starts = sorted(q["start"] for q in requests if q.get("start") is not None)
    gaps = sorted(g for q in requests for g in (q.get("itl") or []))
    if not starts or not gaps:
        return None
    half_step = gaps[len(gaps) // 2] / 2
    return 1 + sum(1 for a, b in zip(starts, starts[1:]) if b - a > half_step)


def engine_time(rounds_steps: list[list[dict]], clients: int) -> dict | None:
    """What the engine did per round, from the proposer's step clock (traced methods only):
    seconds of steps (the engine's waits between steps left out: ``aggregate.busy_steps``),
    of forward, verification and drafting, and how many steps ran with fewer rows than
    there are clients (a client between two requests, or the round's tail: throughput lost
    to occupancy, not to the step's own cost); ``decode_speedup``: decoding against the
    engine's own plain steps, drafting counted (``trace_steps.decode_speedup``; None without
    plain decode steps or from servers whose step records lack ``accepted``). Prefill steps
    are the same with or without trees, and a machine that slows for a round or two moves
    both sides of it."""
    if not any(rounds_steps):
        return None
    n = len(rounds_steps)
    steps = busy_steps(s for rs in rounds_steps for s in rs)
    if not steps:
        return None

    def seconds(key: str) -> float:
        return sum(s.get(key, 0.0) for s in steps) / 1000 / n

    all_have_accepted = all("accepted" in s for s in steps)
    decoding = decode_speedup(steps)

    return {"busy_s": seconds("wall_ms"), "forward_s": seconds("forward_ms"),
            "verify_s": seconds("verify_ms"), "drafting_s": seconds("drafting_ms"),
            "steps": len(steps) / n, "tree_steps": sum(1 for s in steps if s.get("trees")) / n,
            "short_steps": sum(1 for s in steps if s["rows"] < clients) / n,
            "short_busy_s": sum(s["wall_ms"] for s in steps if s["rows"] < clients) / 1000 / n,
            "decode_speedup": decoding.get("speedup") if all_have_accepted else None}


def summarize(rounds: list[dict], labels: list[str], client_counts: list[int],
              repeats: int) -> list[dict]:
    rows = []
    get = {(r["label"], r["clients"], r["repeat"]): r for r in rounds}
    for c in client_counts:
        for lab in labels:
            mine = [get[(lab, c, k)] for k in range(repeats) if (lab, c, k) in get]
            if not mine:
                continue
            tput = []
            for r in mine:
                toks = sum(q["tokens"] or 0 for q in r["requests"])
                tput.append(toks / r["wall"] if r["wall"] > 0 else None)
            speed = []
            for k in range(repeats):
                a, b = get.get((lab, c, k)), get.get(("none", c, k))
                if a and b:
                    ta = sum(q["tokens"] or 0 for q in a["requests"]) / a["wall"]
                    tb = sum(q["tokens"] or 0 for q in b["requests"]) / b["wall"]
                    speed.append(ta / tb if tb else None)
            reqs = [q for r in mine for q in r["requests"]]
            same = total = 0
            for k in range(repeats):
                a, b = get.get((lab, c, k)), get.get(("none", c, k))
                if a and b:
                    for x, y in zip(a["requests"], b["requests"]):
                        total += 1
                        same += int(x["text"] == y["text"] and not x["error"] and not y["error"])
            counters = {}
            for r in mine:
                for k, v in (r.get("counters") or {}).items():
                    if k == "accepted_per_pos":
                        old = counters.get(k, [])
                        counters[k] = [(old[i] if i < len(old) else 0) + (v[i] if i < len(v) else 0)
                                       for i in range(max(len(old), len(v)))]
                    else:
                        counters[k] = counters.get(k, 0) + v
            trace = [row for r in mine for row in r.get("trace", [])]
            gen = sum(q["tokens"] or 0 for q in reqs)
            spec = spec_summary(trace, counters, gen, len(reqs)) if (trace or counters) else None
            engine = engine_time([r.get("steps") or [] for r in mine], c)
            waves = [w for w in (arrival_waves(r["requests"]) for r in mine) if w is not None]
            rows.append({"label": lab, "clients": c, "throughput": mean_sd(tput), "engine": engine,
                         "speedup": mean_sd(speed), "ttft_ms": _dist([q["ttft"] for q in reqs]),
                         "itl_ms": _dist([g for q in reqs for g in q["itl"]]),
                         "tpot_ms": _dist([q["tpot"] for q in reqs]), "requests": len(reqs),
                         "arrival_waves": mean_sd(waves),
                         "errors": sum(1 for q in reqs if q["error"]),
                         "identical": same, "compared": total, "spec": spec})
    return rows


def report(rows: list[dict], meta: dict, failed: dict) -> str:
    f = fmt
    L = ["# Serving benchmark (OpenAI completions, streaming)", "",
         f"- model `{meta['model']}`, dtype {meta['dtype']}, greedy, "
         f"{token_limit_text(meta['max_tokens'], meta.get('min_tokens_limit'))} new "
         f"tokens, {meta['num_requests']} requests per round, {meta['repeats']} repeat(s); "
         f"servers: {meta['servers']}",
         f"- host: {(meta.get('host') or {}).get('cpus')} CPUs of "
         f"{(meta.get('host') or {}).get('cpu') or 'an unrecorded processor'}",
         "- methods take turns per round, order rotating; speedup = throughput / throughput of "
         "`none` in the same repeat and client count; `a ± b` = mean ± sample sd over repeats",
         "- TTFT / ITL / TPOT in ms as mean / p50 / p90 over all requests (ITL: gaps between "
         "streamed chunks; TPOT: (end - first text) / (tokens - 1) per request)",
         "- waves: groups the round's requests were sent in (a new group where a request "
         "follows the one before by more than half a step), per round: requests that end "
         "in one step send their successors together, and their prompts share a prefill step"]
    if failed:
        L.append("- skipped: " + "; ".join(f"`{k}` ({v})" for k, v in failed.items()))
    L += ["", "| clients | method | throughput tok/s | speedup | TTFT ms | ITL ms | TPOT ms | waves | DE "
          "| AL | HR | identical | errors |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def d3(x):
        return f"{f(x['mean'], 1)} / {f(x['p50'], 1)} / {f(x['p90'], 1)}"

    for r in rows:
        s = r["spec"] or {}
        has = s.get("source") is not None
        L.append(f"| {r['clients']} | {r['label']} | {fmt_pm(r['throughput'], 1)} | "
                 f"{fmt_pm(r['speedup'])} | {d3(r['ttft_ms'])} | {d3(r['itl_ms'])} | "
                 f"{d3(r['tpot_ms'])} | {fmt_pm(r.get('arrival_waves') or mean_sd([]), 0)} | "
                 f"{f(s.get('DE')) if has else '—'} | "
                 f"{f(s.get('AL')) if has else '—'} | {f(s.get('HR')) if has else '—'} | "
                 f"{identical_cell(r)} | {r['errors']} |")
    engine = [r for r in rows if r.get("engine")]
    if engine:
        L += ["", "Engine time per round, from the tree proposer's step clock (traced methods; "
              "the engine's waits between steps left out): *busy* = the steps' wall time, "
              "*short steps* = steps with fewer rows than clients (a client between requests, "
              "or the round's tail), *decode x* = decoding's speedup over the same engine's "
              "plain decode steps, drafting counted (prefill steps left out).", "",
              "| clients | method | busy s | forward s | verification s | drafting s | steps | "
              "with trees | short steps (s) | decode x |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for r in engine:
            e = r["engine"]
            L.append(f"| {r['clients']} | {r['label']} | {f(e['busy_s'])} | {f(e['forward_s'])} | "
                     f"{f(e['verify_s'])} | {f(e['drafting_s'])} | {f(e['steps'], 0)} | "
                     f"{f(e['tree_steps'], 0)} | {f(e['short_steps'], 0)} ({f(e['short_busy_s'])}) | "
                     f"{f(e.get('decode_speedup'))} |")
    L.append("")
    return "\n".join(L)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--base-url", default=None,
                    help="running server(s), comma separated; no server is started")
    ap.add_argument("--labels", default=None,
                    help="with --base-url: one label per URL (a `none` label is the reference)")
    ap.add_argument("--model", default=None, help="HF model folder (default: the embedded model)")
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--datasets", default="mt_bench,gsm8k,humaneval")
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts per dataset")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--clients", type=int_list, default=[4],
                    help="concurrent clients, a list runs each count")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--min-tokens-limit", type=int, default=None,
                    help="as scripts/benchmark.py --min-tokens-limit: each prompt's own limit "
                         "on new tokens, drawn from [this, --max-tokens], fixed per prompt")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="as scripts/benchmark.py --dtype")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="KV cache per server (default 0.5 GiB, 1 GiB in float32); an "
                         "environment VLLM_CPU_KVCACHE_SPACE (integer GiB) overrides it")
    ap.add_argument("--start-jobs", type=int, default=2)
    ap.add_argument("--server-timeout", type=float, default=900)
    ap.add_argument("--settle", type=float, default=1.2, help="untimed pause between rounds")
    ap.add_argument("--out", default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    resolve_common_args(args)
    engine_env()  # the servers' environment, and what host_info records
    out = Path(args.out or REPO / "results" / time.strftime("serving-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    prompts_by = load_token_prompts(args.model, datasets, args.num_prompts, args.data_dir,
                                       args.max_model_len - args.max_tokens)
    prompts = [p["ids"] for ds in datasets for p in prompts_by[ds]]
    set_token_limits(prompts_by, args.min_tokens_limit, args.max_tokens)
    limits = [p["max_tokens"] for ds in datasets for p in prompts_by[ds]]
    # warm-up on one held-out prompt per dataset (none left: the first measured one)
    spare = load_held_out_prompts(args.model, datasets, args.num_prompts, 1, args.data_dir,
                                  args.max_model_len - args.max_tokens)
    warm = [p["ids"] for ds in datasets for p in spare[ds]] or prompts[:1]
    t_start = time.time()
    failed: dict[str, str] = {}
    if args.base_url:
        urls = [u.strip() for u in args.base_url.split(",") if u.strip()]
        labels = ([x.strip() for x in args.labels.split(",")] if args.labels
                  else (["none"] if len(urls) == 1 else [f"server{i}" for i in range(len(urls))]))
        if len(labels) != len(urls):
            raise SystemExit("--labels needs one label per --base-url")
        servers = [Server(lab, url=u) for lab, u in zip(labels, urls)]
        for s in servers:
            if not s.poll_ready():
                raise SystemExit(f"[serve] no server answering at {s.url}/v1/models")
        owned = False
    else:
        try:
            methods = parse_methods(args.methods)
        except ValueError as e:
            raise SystemExit(f"[serve] {e}")
        servers, failed = start_servers(args, methods, out)
        owned = True
        if not any(s.label == "none" for s in servers):
            print("[serve] the plain server (none) did not start: speedups are not available")
    rounds: list[dict] = []
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    try:
        if not servers:
            raise SystemExit("[serve] no server to measure")
        for s in servers:  # warm-up
            asyncio.run(_round(s, warm, len(warm), min(32, args.max_tokens)))
        plan = [(k, c) for k in range(args.repeats) for c in args.clients]
        bar = tqdm(total=len(plan) * len(servers), desc="serving", unit="round") if tqdm else None
        for n, (k, c) in enumerate(plan):
            shift = n % len(servers)
            for s in servers[shift:] + servers[:shift]:
                if bar is not None:
                    bar.set_postfix_str(f"rep={k} clients={c} {s.label}", refresh=False)
                before = s.metrics()
                _, _, s.trace_pos = read_trace(s.trace_path, s.trace_pos)
                res = asyncio.run(_round(s, prompts, c, limits))
                after = s.metrics()
                trace, steps, s.trace_pos = read_trace(s.trace_path, s.trace_pos)
                counters = None
                if before is not None and after is not None:
                    counters = {kk: after[kk] - before[kk] for kk in _PROM.values()}
                    a, b = after["accepted_per_pos"], before["accepted_per_pos"]
                    counters["accepted_per_pos"] = [a[i] - (b[i] if i < len(b) else 0)
                                                    for i in range(len(a))]
                rounds.append({"label": s.label, "clients": c, "repeat": k, **res,
                               "counters": counters, "trace": trace, "steps": steps})
                if bar is not None:
                    bar.update(1)
                if args.settle:
                    time.sleep(args.settle)
        if bar is not None:
            bar.close()
    finally:
        if owned:
            for s in servers:
                s.stop()
    labels = [s.label for s in servers]
    rows = summarize(rounds, labels, args.clients, args.repeats)
    meta = {"model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens,
            "min_tokens_limit": args.min_tokens_limit,
            "repeats": args.repeats, "num_requests": len(prompts), "clients": args.clients,
            "datasets": {d: len(v) for d, v in prompts_by.items()},
            "servers": ", ".join(f"{s.label}={s.url}" for s in servers),
            "methods": {s.label: (s.method.spec if s.method else None) for s in servers},
            "load_s": {s.label: s.load_s for s in servers}, "args": vars(args),
            "host": host_info(), "elapsed_s": time.time() - t_start}
    md = report(rows, meta, failed)
    for r in rounds:
        for q in r["requests"]:
            q["text_len"] = len(q.pop("text"))
        r["trace_steps"] = len(r.pop("trace"))
        r.pop("steps", None)
    (out / "serving.md").write_text(md + "\n")
    (out / "serving.json").write_text(json.dumps({"meta": meta, "failed": failed, "summary": rows,
                                                  "rounds": rounds}, indent=1, default=str) + "\n")
    print(md)
    print(f"[serve] wrote {out / 'serving.md'} and {out / 'serving.json'}")
    return 0
