"""kvpool as an LMCache 0.5.6 remote storage plugin, checked against LMCache's own classes.

LMCache pins numpy<=2.2.6 and pulls cupy and cuda-python, so it lives in a second
environment, .venv-lmcache (scripts/setup-lmcache.sh, run by .ci/run). The checks
(tests/lmcache_side/check_lmcache.py) run there as a subprocess, on a real kvpool cluster,
with a second LMCache instance as a further process.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
VENV_PY = ROOT / ".venv-lmcache" / "bin" / "python"


def test_lmcache_connector_checks():
    if not VENV_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VENV_PY} is missing: .ci/run runs scripts/setup-lmcache.sh")
        pytest.skip("no .venv-lmcache (bash scripts/setup-lmcache.sh creates it)")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([str(VENV_PY), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-o", "python_files=check_*.py", str(ROOT / "tests" / "lmcache_side")],
                       capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT)
    tail = r.stdout[-8000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    summary = re.search(r"(\d+) passed", r.stdout)
    assert summary and int(summary.group(1)) >= 7 and "failed" not in r.stdout.splitlines()[-1], tail
