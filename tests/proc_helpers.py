"""Running the ``kvpool`` command of this checkout in a subprocess, as a user would.

``python -m kvpool`` in a child imports whatever kvpool its sys.path finds first (an
editable install may point at another checkout), so the child gets this checkout's
``src`` first on PYTHONPATH.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvpool

SRC = str(Path(kvpool.__file__).resolve().parents[1])
KVPOOL = [sys.executable, "-m", "kvpool"]


def kvpool_env(**extra: str) -> dict:
    """os.environ with this checkout's src first on PYTHONPATH, offline HF, plus ``extra``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **extra}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_kvpool(*args: str, env: dict | None = None, timeout_s: float = 60,
               **popen) -> subprocess.CompletedProcess:
    """Run ``kvpool ARGS`` of this checkout in its own process group and wait for it.

    A command that should refuse at once but starts working instead (a cluster, a
    benchmark, a model load) is stopped at ``timeout_s`` and fails the test.
    """
    proc = subprocess.Popen([*KVPOOL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, env=env or kvpool_env(),
                            start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"kvpool {' '.join(args)} still running after {timeout_s} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def poll_until(check, timeout_s: float = 20.0, every_s: float = 0.01) -> bool:
    """Call ``check()`` until it is true or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every_s)
    return bool(check())
