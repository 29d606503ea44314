"""Running the ``kvpool`` command of this checkout in a subprocess, as a user would.

``python -m kvpool`` in a child imports whatever kvpool its sys.path finds first (an
editable install may point at another checkout), so the child gets this checkout's
``src`` first on PYTHONPATH. Also: polls with deadlines, and test bodies run on many
threads at once (:func:`in_threads`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

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


def poll_until(check, timeout_s: float = 20.0, every_s: float = 0.01):
    """Call ``check()`` every ``every_s`` s until it is truthy or ``timeout_s`` passes;
    returns its last value (falsy when the time ran out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    return check()


def wait_for(check, timeout_s: float = 10.0, what: str = "condition", every_s: float = 0.02):
    """:func:`poll_until` that fails the test ("timed out waiting for WHAT") when
    ``check()`` stays falsy for ``timeout_s`` s; returns its truthy value."""
    value = poll_until(check, timeout_s, every_s)
    if not value:
        pytest.fail(f"timed out waiting for {what}")
    return value


def wait_ready_file(proc: subprocess.Popen, ready: Path, timeout_s: float = 60.0,
                    what: str = "serve") -> dict:
    """Wait for ``proc`` to write its ``--ready-file`` ``ready``; returns the file's JSON.

    Fails the test ("WHAT did not come up") when ``proc`` exits first or ``timeout_s``
    s pass; ``proc`` is then killed.
    """
    poll_until(lambda: ready.exists() or proc.poll() is not None, timeout_s, 0.05)
    if not ready.exists() or proc.poll() is not None:
        proc.kill()
        pytest.fail(f"{what} did not come up (status {proc.poll()})")
    return json.loads(ready.read_text())


def in_threads(body, n: int, timeout_s: float = 120.0) -> list[str]:
    """Run ``body(t)`` for t in 0..n-1, each on its own thread, all at once; returns what
    they raised (``"thread t: exc"``), and a line per thread still running after
    ``timeout_s``: an empty list means every body ran to its end."""
    import threading

    errors: list[str] = []

    def run(t: int) -> None:
        try:
            body(t)
        except Exception as exc:  # collected and reported by the caller
            errors.append(f"thread {t}: {exc!r}")

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout_s
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    return errors + [f"{th.name} still running" for th in threads if th.is_alive()]


def scraped(http_addr: str, name: str, **labels) -> float:
    """The sum of the samples named ``name`` with these ``labels`` on the Prometheus
    ``/metrics`` page of ``http_addr`` (a master's or node's --http-port)."""
    with urllib.request.urlopen(f"http://{http_addr}/metrics", timeout=10) as resp:
        body = resp.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(body) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
