#!/usr/bin/env python3
"""Fetch and convert the embedded default model (SmolLM2-135M-Instruct, bf16); print its path.

Same as ``python -m vllm_ptd.model_store``. Honours VLLM_PTD_MODEL and VLLM_PTD_CACHE.
"""
import sys

from vllm_ptd.model_store import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
