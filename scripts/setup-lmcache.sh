#!/usr/bin/env bash
# Creates .venv-lmcache: a second virtual environment for the LMCache integration tests.
# LMCache 0.5.6 pins numpy<=2.2.6 and pulls cupy, cuda-python and nvtx, so it stays out
# of the main environment (whose numpy the core runs on). torch is pinned to the same
# CPU build as the main environment; kvpool is installed --no-deps with its small deps.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-lmcache
[ -x "$VENV/bin/python" ] || $PY -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"
$PIP install -q -c "$CONSTRAINTS" torch==2.13.0
$PIP install -q -c "$CONSTRAINTS" lmcache==0.5.6
$PIP install -q -c "$CONSTRAINTS" --no-deps -e .
$PIP install -q -c "$CONSTRAINTS" msgspec xxhash pytest uvloop pyyaml prometheus-client aiohttp tqdm
