"""Which implementation a kernel call runs: the Triton kernel or its plain torch twin.

Rule: Triton runs when every tensor argument is on CUDA, or when the Triton interpreter was
active (``TRITON_INTERPRET=1``) at the time the kernel modules were imported, in which case it
also runs on CPU tensors. Everything else runs the torch twin.

The interpreter state is read once, at import: ``triton.jit`` decides at decoration time
whether a kernel is compiled or interpreted, so setting the variable later cannot turn a
compiled kernel into one that accepts CPU pointers. Tests and scripts that want the
interpreter therefore set ``TRITON_INTERPRET=1`` before importing ``vllm_ptd.kernels`` (or run
in a fresh process).
"""
from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # a CPU-only install without Triton still gets the torch twins
    HAVE_TRITON = False

INTERPRETED = HAVE_TRITON and os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when a call with these tensors should run the Triton kernel."""
    if not HAVE_TRITON:
        return False
    if INTERPRETED:
        return True
    return all(t.is_cuda for t in tensors)


def backend_name(*tensors: torch.Tensor) -> str:
    """"triton" or "torch": what the dispatchers will run for these tensors."""
    return "triton" if use_triton(*tensors) else "torch"


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def host_list(t: torch.Tensor) -> list[int]:
    """Small index tensors the launch geometry depends on, read on the host (one sync on GPU)."""
    return [int(x) for x in t.tolist()]
