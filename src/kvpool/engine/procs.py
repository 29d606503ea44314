"""Engine processes seen from the parent: start, send requests, read replies, stop.

A worker is ``python -m kvpool generate --worker ...`` (see :mod:`kvpool.engine.worker`).
It speaks JSON lines: one request per line on its stdin, and on its stdout one line per
event (``{"event": "progress" | "ready", ...}``) or reply (``{"id": n, "result": {...}}``
or ``{"id": n, "error": "..."}``). Its stderr goes to a log file whose tail is shown
when it fails. Logits travel as base64 of little-endian float32.

This module imports neither torch nor transformers: the demo's parent stays light.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from kvpool.errors import KVPoolError
from kvpool.launch import child_preexec, wait_or_kill

_SRC = str(Path(__file__).resolve().parents[2])  # so children import this kvpool


class EngineProcessError(KVPoolError):
    """An engine process died, timed out, or answered a request with an error."""


def encode_logits(values) -> str:
    """float32 vector (numpy array or list) -> base64 text of its little-endian bytes."""
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")


def decode_logits(text: str) -> np.ndarray:
    """Inverse of :func:`encode_logits`: a float32 numpy vector."""
    return np.frombuffer(base64.b64decode(text), dtype="<f4")


# a wait longer than this says what it is waiting for, again every interval
HEARTBEAT_S = 10.0


class EngineProcess:
    """One worker process.

    Every message of the worker is read once, so each wait remembers what it saw: the
    ready event (:meth:`wait_ready` returns it again at once) and the end of the stream
    (every later wait fails at once with the exit status and the log tail, instead of
    waiting for a message that can no longer come).

    Args:
        name: label in progress lines and errors ("A", "B").
        worker_args: arguments after ``kvpool generate --worker``.
        log_path: file receiving the worker's stderr.
        on_progress: callable(name, text) for the worker's progress events, and for a
            "still waiting" line every :data:`HEARTBEAT_S` seconds of a longer wait.
    """

    def __init__(self, name: str, worker_args: list[str], log_path: Path, on_progress=None):
        self.name = name
        self.log_path = Path(log_path)
        self.on_progress = on_progress or (lambda name, text: None)
        env = dict(os.environ)
        env["PYTHONPATH"] = _SRC + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "kvpool", "generate", "--worker", *worker_args]
        # the worker dies with the demo (SIGTERM on parent death), even if it is SIGKILLed;
        # start engines from the main thread: PDEATHSIG follows the forking thread
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, env=env, preexec_fn=child_preexec())
        self._inbox: queue.Queue = queue.Queue()
        self._next_id = 0
        self.info: dict = {}  # the ready event, once seen
        self._ended = False  # the worker's stdout reached its end (it exited)
        threading.Thread(target=self._read_stdout, name=f"engine-{name}-reader",
                         daemon=True).start()

    def _read_stdout(self) -> None:
        """Parse each stdout line into the inbox; None marks the end of the stream."""
        for line in self.proc.stdout:
            try:
                self._inbox.put(json.loads(line))
            except ValueError:
                self._inbox.put({"event": "progress", "text": line.decode(errors="replace")})
        self._inbox.put(None)

    def _exited(self) -> EngineProcessError:
        self._ended = True
        code = self.proc.wait()
        return EngineProcessError(f"engine {self.name} exited with status {code}"
                                  f"\n{self.log_tail()}")

    def _next_message(self, what: str, deadline: float, started: float) -> dict:
        """The next message; raises at once if the worker has exited, or at ``deadline``."""
        while not self._ended:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineProcessError(
                    f"engine {self.name}: no reply within {deadline - started:.0f} s "
                    f"({what})\n{self.log_tail()}")
            try:
                msg = self._inbox.get(timeout=min(left, HEARTBEAT_S))
            except queue.Empty:
                self.on_progress(self.name, f"still {what} "
                                 f"({time.monotonic() - started:.0f} s)")
                continue
            if msg is None:
                break
            return msg
        raise self._exited()

    def _until(self, accept, what: str, timeout_s: float) -> dict:
        """Read messages, passing progress events on, until ``accept(msg)`` is true."""
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            msg = self._next_message(what, deadline, started)
            if msg.get("event") == "ready":
                self.info = msg  # whoever reads it: the worker sends it only once
            if msg.get("event") == "progress":
                self.on_progress(self.name, msg.get("text", ""))
            elif accept(msg):
                return msg

    def wait_ready(self, timeout_s: float = 300.0) -> dict:
        """Wait for the worker's ready event (model loaded, store connected); returns it.

        Idempotent: once the event was seen, returns it at once (the worker sends it
        only once). Raises EngineProcessError at once when the worker has exited, or
        after ``timeout_s`` seconds without the event.
        """
        if self.info:
            return self.info
        return self._until(lambda m: m.get("event") == "ready", "loading", timeout_s)

    def send(self, request: dict) -> int:
        """Send one request (see :mod:`kvpool.engine.worker`); returns its id."""
        self._next_id += 1
        line = json.dumps({**request, "id": self._next_id}) + "\n"
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise EngineProcessError(f"engine {self.name} is gone\n{self.log_tail()}") from None
        return self._next_id

    def reply(self, request_id: int, timeout_s: float = 300.0) -> dict:
        """The result dict of request ``request_id``. Raises EngineProcessError."""
        msg = self._until(lambda m: m.get("id") == request_id,
                          f"working on request {request_id}", timeout_s)
        if "error" in msg:
            raise EngineProcessError(f"engine {self.name}: {msg['error']}")
        return msg["result"]

    def call(self, request: dict, timeout_s: float = 300.0) -> dict:
        """Send ``request`` and wait for its result."""
        return self.reply(self.send(request), timeout_s)

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """Close stdin (the worker exits at end of input), then terminate, then kill."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                wait_or_kill(self.proc, timeout_s)
        return self.proc.returncode
