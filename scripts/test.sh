#!/usr/bin/env bash
# Run the test suite: set up (idempotent), then pytest on tests/ with any extra arguments.
#   bash scripts/test.sh -q -k datasets
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! bash scripts/setup.sh; then
    echo "[test] scripts/setup.sh failed" >&2
    exit 1
fi
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

.venv/bin/python -m pytest tests "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "[test] pytest collected no tests (exit 5): treating as a failure" >&2
    exit 1
fi
exit "$rc"
