"""The registry of tree methods: every sub-package of ``vllm_ptd`` with a ``spec.py``.

Adding a method is one new folder ``vllm_ptd/<name>/`` with ``spec.py`` exporting
``METHOD`` (a :class:`~vllm_ptd.method.MethodSpec`); nothing else is edited. Discovery reads
the package folders without importing the other sub-packages.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from pathlib import Path

from vllm_ptd.method import MethodSpec

_ROOT = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def registered() -> dict[str, MethodSpec]:
    found: dict[str, MethodSpec] = {}
    for pkg in sorted(p for p in _ROOT.iterdir() if (p / "__init__.py").is_file()):
        if not any(m.name == "spec" for m in pkgutil.iter_modules([str(pkg)])):
            continue
        spec = importlib.import_module(f"vllm_ptd.{pkg.name}.spec").METHOD
        if not isinstance(spec, MethodSpec):
            raise TypeError(f"vllm_ptd.{pkg.name}.spec.METHOD is not a MethodSpec")
        if spec.name in found:
            raise ValueError(f"two methods named {spec.name!r}")
        found[spec.name] = spec
    return found


def method_names() -> tuple[str, ...]:
    return tuple(registered())


def find_method(name: str) -> MethodSpec:
    methods = registered()
    if name not in methods:
        raise ValueError(f"speculative_config['method'] = {name!r}: allowed values are "
                         f"{list(methods)}")
    return methods[name]
