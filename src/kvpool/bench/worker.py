"""The worker protocol of ``kvpool bench store``: one process per compared system.

Every system under test runs in its own *worker* process, driven by the controller
(:mod:`kvpool.bench.store`) over a pipe with one JSON object per line. The controller
asks the workers in turn for one cell at a time, so kvpool and its anchors are measured
interleaved in the same seconds of the same run (the machine is shared and noisy; ratios
of measurements taken side by side stay fair). A worker that cannot start or that
crashes costs its column, never the run.

Requests (:class:`kvpool.child.Request`, controller -> worker): ``open`` (args: target
"module:Class", cfg; result: the target's info), ``cell`` (args: spec, a
:class:`~kvpool.bench.harness.CellSpec`; result: a CellResult), ``drop`` (args: size),
``stats``; each is answered by a Reply or an Error with the reason. The end of the
worker's stdin closes the target and ends the worker.
"""

from __future__ import annotations

import importlib
import signal
import sys
from dataclasses import asdict, dataclass, field

from kvpool.bench.harness import Bench, CellResult, CellSpec, Target, Unavailable
from kvpool.child import ChildError, ChildProcess, Error, Request, WorkerChannel


def _load_target(path: str) -> Target:
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)()


def worker_main() -> None:
    """Entry of a worker process: Requests on stdin, Replies on the original stdout.

    Native libraries (Mooncake's glog) may print on stdout; the channel keeps them off
    it. Whatever the target started (servers, clusters, namespaces) is stopped when
    stdin ends (closed by the controller, or the controller died), on SIGTERM (sent by
    the stop ladder, or by the kernel when the controller dies) and on a failed "open".
    """
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    channel = WorkerChannel()
    state: dict = {}
    try:
        channel.serve(lambda request: _serve(request, state), (Exception,), _describe)
    finally:
        if "target" in state:
            state.pop("target").close()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, Unavailable):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"[:500]  # reported to the controller, which records it


def _serve(request: Request, state: dict) -> dict:
    """Answer one request; ``state`` holds the target and its :class:`Bench` once open."""
    args = request.args
    if request.op == "open":
        state["target"] = _load_target(args["target"])
        info = state["target"].open(args.get("cfg", {}))
        state["bench"] = Bench(state["target"])
        return info
    bench: Bench = state["bench"]
    if request.op == "cell":
        return asdict(bench.run(CellSpec(**args["spec"])))
    if request.op == "drop":
        bench.drop(args["size"])
        return {}
    if request.op == "stats":
        return bench.target.stats()
    raise ValueError(f"unknown request {request.op!r}")


# --------------------------------------------------------------------------- controller side


@dataclass
class Worker:
    """Controller's handle on one worker process running one target.

    ``prefix`` wraps the command (``ip netns exec NS`` or a private network namespace).
    ``absent`` holds the reason once the worker could not start or died: its column is
    then shown as absent with that reason.
    """

    column: str
    target: str
    cfg: dict = field(default_factory=dict)
    prefix: tuple[str, ...] = ()
    log_path: str | None = None
    timeout_s: float = 180.0
    absent: str | None = None
    info: dict = field(default_factory=dict)
    child: ChildProcess | None = None

    @property
    def proc(self):
        """The worker's :class:`subprocess.Popen` (None before start and after stop)."""
        return self.child.proc if self.child else None

    def start(self) -> bool:
        """Start the process and open the target; False (and ``absent`` set) on failure."""
        cmd = [*self.prefix, sys.executable, "-c",
               "from kvpool.bench.worker import worker_main; worker_main()"]
        try:
            self.child = ChildProcess(f"worker {self.column}", cmd, self.log_path, channel=True)
        except OSError as exc:
            self.absent = f"cannot start worker: {exc}"
            return False
        reply = self._answer("open", {"target": self.target, "cfg": self.cfg})
        if reply is None:
            return False
        if isinstance(reply, Error):
            self.absent = reply.reason or "failed to open"
            self.stop()
            return False
        self.info = reply.result
        return True

    def _answer(self, op: str, args: dict):
        """Send one request, wait for its Reply or Error (with a deadline); None (and
        ``absent`` set) if the worker died or did not answer."""
        if self.absent or self.child is None:
            return None
        try:
            return self.child.answer(self.child.send(op, args), self.timeout_s, op)
        except ChildError:
            code = self.child.proc.poll()
            why = "worker exited" if code is not None else "no reply within deadline"
            self.absent = f"{why} (rc={code}); see log {self.log_path}"
            self.stop()
            return None

    def ask(self, op: str, **args) -> dict | None:
        """The result of request ``op``; None when it failed or the worker is gone."""
        reply = self._answer(op, args)
        return None if reply is None or isinstance(reply, Error) else reply.result

    def cell(self, spec: CellSpec) -> CellResult:
        """Measure one cell in this worker."""
        reply = self._answer("cell", {"spec": asdict(spec)})
        if reply is None:
            return CellResult(error=self.absent)
        if isinstance(reply, Error):
            return CellResult(error=reply.reason)
        return CellResult(**reply.result)

    def stop(self) -> None:
        """Close the worker's stdin (it closes its target), then terminate and kill it."""
        child, self.child = self.child, None
        if child is None:
            return
        child.stop(20.0, close_stdin=True)
        for stream in (child.proc.stdin, child.proc.stdout):
            if stream:
                stream.close()
