"""Engine processes seen from the parent: start, send requests, read replies, stop.

A worker is ``python -m kvpool generate --worker ...`` (see :mod:`kvpool.engine.worker`),
a :class:`kvpool.child.ChildProcess` driven over its message channel: Progress lines
while it loads, one Ready (info: ``model``, ``pid``), then one Reply (or Error) per
``generate`` Request. Its stderr goes to a log file whose tail is shown when it fails.
Logits travel as base64 of little-endian float32.

This module imports neither torch nor transformers: the demo's parent stays light.
"""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np

from kvpool.child import ChildError, ChildProcess, kvpool_cmd


class EngineProcessError(ChildError):
    """An engine process died, timed out, or answered a request with an error."""


def encode_logits(values) -> str:
    """float32 vector (numpy array or list) -> base64 text of its little-endian bytes."""
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")


def decode_logits(text: str) -> np.ndarray:
    """Inverse of :func:`encode_logits`: a float32 numpy vector."""
    return np.frombuffer(base64.b64decode(text), dtype="<f4")


# a wait longer than this says what it is waiting for, again every interval
HEARTBEAT_S = 10.0


class EngineProcess(ChildProcess):
    """One worker process (start engines from the main thread: PDEATHSIG follows the
    forking thread).

    Args:
        name: label in progress lines and errors ("A", "B").
        worker_args: arguments after ``kvpool generate --worker``.
        log_path: file receiving the worker's stderr.
        on_progress: callable(name, text) for the worker's progress messages, and for a
            "still waiting" line every :data:`HEARTBEAT_S` seconds of a longer wait.
    """

    error = EngineProcessError

    def __init__(self, name: str, worker_args: list[str], log_path: Path, on_progress=None):
        self.name = name
        report = on_progress or (lambda name, text: None)
        super().__init__(f"engine {name}", kvpool_cmd("generate", "--worker", *worker_args),
                         log_path, channel=True, on_progress=lambda text: report(name, text))

    @property
    def heartbeat_s(self) -> float:
        return HEARTBEAT_S

    def call(self, request: dict, timeout_s: float = 300.0) -> dict:
        """Send one generate request (fields: :func:`kvpool.engine.worker.handle`) and
        wait for its result dict. Raises EngineProcessError."""
        return self.request("generate", request, timeout_s)

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """Close stdin (the worker exits at end of input), then terminate, then kill."""
        return super().stop(timeout_s, close_stdin=True)
