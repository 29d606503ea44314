"""kvpool as SGLang 0.5.23's HiCache L3 backend, checked against SGLang's own classes.

The checks (tests/sglang_side/check_sglang.py) run in a process of their own: importing
SGLang patches transformers and needs harness.py's torchvision placeholder, neither of
which may reach the rest of this test session. They start a real kvpool cluster (the
conftest fixtures) and a second SGLang-side process as engine B.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SIDE = Path(__file__).parent / "sglang_side"


def test_sglang_hicache_backend_checks():
    if importlib.util.find_spec("sglang") is None:
        if os.environ.get("CI"):
            pytest.fail("sglang is not installed: .ci/run runs scripts/setup-sglang.sh")
        pytest.skip("sglang is not installed (bash scripts/setup-sglang.sh)")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-o", "python_files=check_*.py", str(SIDE)],
                       capture_output=True, text=True, timeout=1200, env=env, cwd=SIDE.parent.parent)
    tail = r.stdout[-8000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    summary = re.search(r"(\d+) passed", r.stdout)
    assert summary and int(summary.group(1)) >= 20 and "failed" not in r.stdout.splitlines()[-1], tail
