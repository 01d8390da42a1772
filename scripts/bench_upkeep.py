#!/usr/bin/env python
"""A method's engine time outside the forward, in fresh processes: ``vllm_ptd.bench.upkeep``."""
import sys

from vllm_ptd.bench.upkeep import main

if __name__ == "__main__":
    sys.exit(main())
