"""What this machine's processor does fast, for defaults that depend on it. No vLLM import."""
from __future__ import annotations

from pathlib import Path


def cpu_has_fast_bf16() -> bool:
    """The CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16), which vLLM's CPU GEMM
    (oneDNN) needs to run bf16 fast; without them bf16 matmuls fall back to slow paths."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
