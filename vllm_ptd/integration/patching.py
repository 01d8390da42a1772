"""Arctic-Inference-style patches: a small class per target, applied in one place.

A ``Patch`` subclass names its ``target`` class; every function defined on the patch
replaces the target's attribute of the same name, and the original stays reachable as
``_orig_<name>`` on the target. Applying twice is a no-op (plugins load once per process,
but tests and the serve wrapper may call ``register`` again).
"""
from __future__ import annotations

from typing import ClassVar

_SKIP = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "target",
         "__annotations__", "__static_attributes__", "__firstlineno__"}


class Patch:
    target: ClassVar[type]

    @classmethod
    def apply(cls) -> None:
        marker = f"_vllm_ptd_patched_by_{cls.__name__}"
        if getattr(cls.target, marker, False):
            return
        for name, value in vars(cls).items():
            if name in _SKIP or name.startswith("_Patch"):
                continue
            if hasattr(cls.target, name):
                setattr(cls.target, f"_orig_{name}", getattr(cls.target, name))
            setattr(cls.target, name, value)
        setattr(cls.target, marker, True)
