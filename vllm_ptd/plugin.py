"""Entry point of the ``vllm.general_plugins`` group.

vLLM calls ``register`` in every process (API server, engine core, workers). It must be
cheap, safe to call many times, and never break a vLLM it was not written for: with an
unsupported vLLM version it warns once and stays inactive, except for one guard that refuses
a tree method (``{"method": "ptd"}`` ...) with the clear message, where vLLM would otherwise
answer with a confusing pydantic error.
"""
from __future__ import annotations

import logging
import os

from vllm_ptd import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    if os.environ.get("VLLM_PTD_DISABLE") == "1":
        return
    from vllm_ptd.integration.version import UnsupportedVLLMVersion, check_vllm_version

    try:
        check_vllm_version()
    except UnsupportedVLLMVersion as e:
        logger.warning("vllm-ptd is inactive: %s", e)
        print(f"[vllm-ptd] WARNING: inactive: {e}", flush=True)
        from vllm_ptd.integration.version import refuse_tree_methods

        refuse_tree_methods(str(e))
        _registered = True
        return
    from vllm_ptd.integration import apply_patches

    apply_patches()
    _registered = True
