#!/usr/bin/env bash
# Installs SGLang 0.5.23 for the HiCache backend tests, without changing what the core
# runs on: sglang itself --no-deps (its requirements pin another torch and transformers),
# then the few packages its storage and host-pool modules import. torch, numpy and
# transformers are held at their installed versions by a constraints file.
# torchvision is left out on purpose: PyPI's wheels are CUDA builds that do not load next
# to torch's CPU build (the checks stand in for its names, see tests/sglang_side/harness.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
$PY -m pip freeze | grep -iE '^(torch|numpy|transformers|tokenizers)==' > "$CONSTRAINTS"
grep -q '^torch==' "$CONSTRAINTS" || echo "torch==2.13.0" >> "$CONSTRAINTS"
$PY -m pip install -q -c "$CONSTRAINTS" --no-deps sglang==0.5.23 triton==3.8.0 \
    apache-tvm-ffi==0.1.15.post2 compressed-tensors==0.20.1
$PY -m pip install -q -c "$CONSTRAINTS" pybase64 pyzmq starlette dill loguru sentencepiece \
    orjson ipython traitlets
