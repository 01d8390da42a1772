#!/usr/bin/env python
"""Online (serving) benchmark: ``vllm_ptd.bench.serving`` (its docstring and ``--help``
describe the run and every figure)."""
import sys

from vllm_ptd.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
