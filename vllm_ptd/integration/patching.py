"""Arctic-Inference-style patches: a small class per target, applied in one place.

A ``Patch`` subclass names its ``target`` class; every function defined on the patch
replaces the target's attribute of the same name. The originals stay on the patch class
(``ThePatch.original("name")``), not on vLLM's class. Applying a patch twice is a no-op
(plugins load once per process, but tests and the serve wrapper may call ``register``
again); a second, different patch of a target already patched is refused loudly, so two
patches can never silently wrap each other.
"""
from __future__ import annotations

import logging
from typing import Any, ClassVar

from vllm_ptd import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

_SKIP = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "target",
         "__annotations__", "__static_attributes__", "__firstlineno__", "__orig_bases__",
         "__parameters__"}

# target class -> the Patch subclass applied to it
_APPLIED: dict[type, type] = {}


class Patch:
    target: ClassVar[type]
    _originals: ClassVar[dict[str, Any]]

    @classmethod
    def replaced_names(cls) -> list[str]:
        return [n for n, v in vars(cls).items()
                if n not in _SKIP and not n.startswith("_Patch") and callable(v)]

    @classmethod
    def original(cls, name: str) -> Any:
        """The target's attribute ``name`` as it was before this patch."""
        return cls._originals[name]

    @classmethod
    def apply(cls) -> bool:
        """Replace the target's attributes; False when this patch was applied already."""
        owner = _APPLIED.get(cls.target)
        if owner is cls:
            return False
        if owner is not None:
            raise RuntimeError(f"{cls.target.__module__}.{cls.target.__qualname__} is already "
                               f"patched by {owner.__name__}; refusing {cls.__name__}")
        names = cls.replaced_names()
        cls._originals = {n: getattr(cls.target, n) for n in names if hasattr(cls.target, n)}
        for n in names:
            setattr(cls.target, n, vars(cls)[n])
        _APPLIED[cls.target] = cls
        logger.info("vllm-ptd patched %s.%s: %s", cls.target.__module__,
                    cls.target.__qualname__, ", ".join(names))
        return True
