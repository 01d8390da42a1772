#!/usr/bin/env python
"""Memory of PTD's per-request drafting state: ``vllm_ptd.bench.state_memory``."""
import sys

from vllm_ptd.bench.state_memory import main

if __name__ == "__main__":
    sys.exit(main())
