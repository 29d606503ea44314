"""The worker protocol of ``kvpool bench store``: one process per compared system.

Every system under test runs in its own *worker* process, driven by the controller
(:mod:`kvpool.bench.store`) over a pipe with one JSON object per line. The controller
asks the workers in turn for one cell at a time, so kvpool and its anchors are measured
interleaved in the same seconds of the same run (the machine is shared and noisy; ratios
of measurements taken side by side stay fair). A worker that cannot start or that
crashes costs its column, never the run.

Commands (controller -> worker): ``open`` (target "module:Class", cfg), ``cell`` (a
:class:`~kvpool.bench.harness.CellSpec`), ``drop`` (size), ``stats``, ``close``; every
reply is ``{"ok": bool, ...}`` (``reason`` when not ok).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from kvpool.bench.harness import Bench, CellResult, CellSpec, Target, Unavailable


def _load_target(path: str) -> Target:
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)()


def worker_main() -> None:
    """Entry of a worker process: JSON commands on stdin, JSON replies on the original stdout.

    Native libraries (Mooncake's glog) may print on stdout, so fd 1 is pointed at stderr
    and replies go to a private duplicate of the original stdout. Whatever the target
    started (servers, clusters, namespaces) is stopped on "close", on a failed "open" and
    when stdin ends (the controller died).
    """
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(reply_fd, "w", buffering=1)
    state: dict = {}
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["cmd"] == "close":
                break
            out.write(json.dumps(_serve(msg, state)) + "\n")
    finally:
        if "target" in state:
            state.pop("target").close()
    out.write(json.dumps({"ok": True}) + "\n")


def _serve(msg: dict, state: dict) -> dict:
    """Answer one command; ``state`` holds the target and its :class:`Bench` once open."""
    cmd = msg["cmd"]
    try:
        if cmd == "open":
            state["target"] = _load_target(msg["target"])
            info = state["target"].open(msg.get("cfg", {}))
            state["bench"] = Bench(state["target"])
            return {"ok": True, "info": info}
        bench: Bench = state["bench"]
        if cmd == "cell":
            return {"ok": True, "result": asdict(bench.run(CellSpec(**msg["spec"])))}
        if cmd == "drop":
            bench.drop(msg["size"])
            return {"ok": True}
        if cmd == "stats":
            return {"ok": True, "stats": bench.target.stats()}
        return {"ok": False, "reason": f"unknown command {cmd!r}"}
    except Unavailable as exc:
        return {"ok": False, "reason": str(exc)}
    except Exception as exc:  # reported to the controller, which records it
        return {"ok": False, "reason": f"{type(exc).__name__}: {exc}"[:500]}


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
    proc: subprocess.Popen | None = None

    def start(self) -> bool:
        """Start the process and open the target; False (and ``absent`` set) on failure."""
        cmd = [*self.prefix, sys.executable, "-c",
               "from kvpool.bench.worker import worker_main; worker_main()"]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, bufsize=1)
        except OSError as exc:
            self.absent = f"cannot start worker: {exc}"
            return False
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        reply = self.ask({"cmd": "open", "target": self.target, "cfg": self.cfg})
        if reply is None:
            return False
        if not reply.get("ok"):
            self.absent = reply.get("reason", "failed to open")
            self.stop()
            return False
        self.info = reply.get("info", {})
        return True

    def ask(self, msg: dict) -> dict | None:
        """Send one command and wait for its reply (with a deadline); None if the worker died."""
        if self.absent or self.proc is None:
            return None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
            line = self.proc.stdout.readline() if ready else ""
        except (BrokenPipeError, OSError) as exc:
            line, ready = "", [exc]
        if not line:
            why = "no reply within deadline" if not ready else "worker exited"
            self.absent = f"{why} (rc={self.proc.poll()}); see log {self.log_path}"
            self.stop()
            return None
        return json.loads(line)

    def cell(self, spec: CellSpec) -> CellResult:
        """Measure one cell in this worker."""
        reply = self.ask({"cmd": "cell", "spec": asdict(spec)})
        if reply is None:
            return CellResult(error=self.absent)
        if not reply.get("ok"):
            return CellResult(error=reply.get("reason"))
        return CellResult(**reply["result"])

    def stop(self) -> None:
        """Close the target politely, then terminate and kill the process."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None and proc.stdin and not proc.stdin.closed:
            try:
                proc.stdin.write(json.dumps({"cmd": "close"}) + "\n")
                proc.stdin.flush()
                proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for action in (proc.terminate, proc.kill):
            if proc.poll() is not None:
                break
            action()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                continue
        for stream in (proc.stdin, proc.stdout):
            if stream:
                stream.close()
