"""What this machine's processor does fast, for defaults that depend on it. No vLLM import."""
from __future__ import annotations

from pathlib import Path


def _cpuinfo() -> str | None:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def _first(cpuinfo: str, field: str) -> str | None:
    """The value of the first ``field`` line of /proc/cpuinfo's text (the first core's)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == field:
            return value.strip()
    return None


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The processor's feature flags (``cpuinfo``: /proc/cpuinfo's text, default: read it;
    empty where it cannot be read)."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    return set((_first(text, "flags") or "").split()) if text else set()


def cpu_has_fast_bf16() -> bool:
    """The CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16), which vLLM's CPU GEMM
    (oneDNN) needs to run bf16 fast; without them bf16 matmuls fall back to slow paths."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_has_fast_int8() -> bool:
    """The CPU has int8 dot-product instructions (AVX512-VNNI, AVX-VNNI or AMX-INT8), which
    vLLM's int8 CPU GEMM (oneDNN) needs to beat its fp32 one. Without them it is slower:
    PCTree's drafter at batch 1 on one core of an AVX2-only AMD EPYC took 34.6 ms a call on
    it against 13.3 ms in fp32 (``scripts/bench_drafter.py --threads 1 --cold-mib 600``)."""
    return bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


MATMUL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16",
                "amx_int8")


def cpu_description(cpuinfo: str | None = None) -> str | None:
    """The processor's model name and which of ``MATMUL_FLAGS`` it has, e.g. ``"Intel(R)
    Xeon(R) Processor (avx2 avx512f avx512_bf16 amx_bf16)"``: what a benchmark's figures
    depend on (this project's VMs have had AMD processors with AVX2 only and with
    AVX512-BF16, and Intel ones with AMX, whose row costs differ), kept with them.
    ``cpuinfo``: that file's text (default: read it); None where it cannot be read."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    if text is None:
        return None
    name = _first(text, "model name") or "unknown processor"
    flags = cpu_flags(text)
    have = " ".join(f for f in MATMUL_FLAGS if f in flags)
    return f"{name} ({have})" if have else name
