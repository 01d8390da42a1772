#!/usr/bin/env python
"""Offline benchmark of speculative-decoding methods in vLLM: ``vllm_ptd.bench.cli`` (its
docstring and ``--help`` describe the run and every figure)."""
import sys

from vllm_ptd.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
