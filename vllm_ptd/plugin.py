"""Entry point of the ``vllm.general_plugins`` group.

vLLM calls ``register`` in every process (API server, engine core, workers). It must be
cheap, safe to call many times, and loud: vLLM only logs a plugin's exception, after which
users would see a confusing pydantic error for ``method: "ptd"``, so a wrong vLLM version
is reported here with a clear message before anything else happens.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm_ptd")

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm_ptd.integration.version import UnsupportedVLLMVersion, check_vllm_version

    try:
        check_vllm_version()
    except UnsupportedVLLMVersion as e:
        # vLLM would swallow the exception; say it where users look, then raise anyway.
        logger.error("%s", e)
        print(f"[vllm-ptd] ERROR: {e}", flush=True)
        raise
    if os.environ.get("VLLM_PTD_DISABLE") == "1":
        return
    from vllm_ptd.integration import apply_patches

    apply_patches()
    _registered = True
