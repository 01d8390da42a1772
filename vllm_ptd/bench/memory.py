"""How many engines the machine's memory holds (swapping engines make every timing meaningless)."""
from __future__ import annotations

import os


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


def check_memory(num_engines: int, opts: dict, avail_gib: float | None = None) -> None:
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
