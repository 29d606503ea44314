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
echo "torch==2.13.0" > "$CONSTRAINTS"
$PIP install -q -c "$CONSTRAINTS" torch==2.13.0
$PIP install -q -c "$CONSTRAINTS" lmcache==0.5.6
$PIP install -q -c "$CONSTRAINTS" --no-deps -e .
# kvpool's own runtime dependencies, read from pyproject.toml (numpy stays LMCache's)
REQS=$(mktemp)
trap 'rm -f "$CONSTRAINTS" "$REQS"' EXIT
"$VENV/bin/python" - > "$REQS" <<'PY'
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith("numpy")))
PY
$PIP install -q -c "$CONSTRAINTS" -r "$REQS" pytest
