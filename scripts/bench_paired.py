#!/usr/bin/env python
"""Engines side by side in one process, step kind by step kind: ``vllm_ptd.bench.paired``."""
import sys

from vllm_ptd.bench.paired import main

if __name__ == "__main__":
    sys.exit(main())
