#!/usr/bin/env python
"""Soak test of ``vllm-ptd serve``: concurrent streaming clients, some disconnecting, round
after round, loopback only: ``vllm_ptd.bench.soak`` (its docstring and ``--help``)."""
import sys

from vllm_ptd.bench.soak import main

if __name__ == "__main__":
    sys.exit(main())
