#!/usr/bin/env bash
# Demo of vllm-ptd: set-up (idempotent), then plain decoding vs vLLM ngram vs PTD (vs PCTree
# when its drafter exists) on the embedded model, one prompt per benchmark. Arguments go to
# scripts/demo.py (e.g. --max-tokens 128, --enforce-eager). KV cache: 1 GiB per engine in fp32,
# 0.5 GiB in bf16, unless VLLM_CPU_KVCACHE_SPACE is set.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
