"""Child processes: start one with its log, tie it to our life, wait, read its log, stop it.

Every process kvpool starts (master and node by :mod:`kvpool.launch`, engine workers by
:mod:`kvpool.engine.procs`, bench workers by :mod:`kvpool.bench.worker`) is a
:class:`ChildProcess`. A child that is driven by requests talks over its stdin/stdout
through one channel: one JSON object per line, each a tagged :mod:`msgspec` struct
(field ``msg`` names the type): :class:`Request` from the parent; :class:`Progress`,
:class:`Ready` (once), :class:`Reply` and :class:`Error` from the child. The child side is
:class:`WorkerChannel`; the parent side is :meth:`ChildProcess.request` and
:meth:`ChildProcess.wait_ready` of a child started with ``channel=True``.

This module imports only the standard library, msgspec and :mod:`kvpool.errors`, so any
parent (the demo, the bench controller) stays light.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Union

import msgspec

from kvpool.errors import KVPoolError

SRC = str(Path(__file__).resolve().parent.parent)  # so children import this kvpool
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl():
    # Resolved in the parent: after fork a child may only call async-signal-safe code,
    # so no dlopen there.
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def child_preexec(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` for :class:`subprocess.Popen` that makes the child die with us.

    The child asks the kernel for ``sig`` (default SIGTERM, so a node still unmounts and
    unlinks its shared memory) when its parent goes away, by
    ``prctl(PR_SET_PDEATHSIG, sig)`` (Linux prctl(2)); if the parent is already gone when
    the child gets there, the child signals itself. Caveat from prctl(2): the signal
    fires when the *thread* that forked the child exits, not the whole process, so start
    long-lived children from the main thread (or a thread that lives as long as they).

    Returns: the function to pass as ``preexec_fn``, or None where prctl is unavailable
    (not Linux): there the children must be stopped explicitly.
    """
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


# ------------------------------------------------------------------------------ stop signals
#
# Python's own SIGINT handler raises KeyboardInterrupt at whatever bytecode the main
# thread is at, also inside the standard library's lock handling: Popen.poll takes its
# waitpid lock with acquire(False) before its try block, so an interrupt landing between
# the two leaves the lock taken, and every later Popen.wait() blocks for good (seen in
# CI: `kvpool serve` hung on a Ctrl-C during its start; 14 leaked locks in 2,000
# interrupted poll loops here). A launcher therefore only records the signal, and its
# own waits raise the KeyboardInterrupt where no lock is held.

STOP_POLL_S = 0.05  # how often a wait looks for a recorded stop signal: a Ctrl-C's latency
_stop_signal = 0  # the first stop signal recorded by stop_on_signals (0: none)


def _record_stop(signum, frame) -> None:
    global _stop_signal
    _stop_signal = _stop_signal or signum


@contextlib.contextmanager
def stop_on_signals(signals=(signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Within the block, ``signals`` only record that a stop was asked: the waits of
    this module (:meth:`ChildProcess.wait_ready`, :meth:`ChildProcess.request`,
    :func:`pause`; :meth:`kvpool.launch.Child.wait_ready` through :func:`pause`) raise
    KeyboardInterrupt within :data:`STOP_POLL_S` seconds, at a point where no library
    lock is held, and a child started meanwhile is recorded by its launcher before the
    stop, which then stops it. The previous handlers are back, and the record cleared,
    when the block ends. A signal is recorded also in a forked child between fork and
    exec, where it does nothing. Raises ValueError off the main thread (signal(2) is
    the main thread's)."""
    global _stop_signal
    previous = {sig: signal.signal(sig, _record_stop) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_signal = 0


def stop_requested() -> int:
    """The stop signal recorded inside :func:`stop_on_signals` (0: none yet)."""
    return _stop_signal


def check_stop() -> None:
    """Raise KeyboardInterrupt when a stop signal was recorded."""
    if _stop_signal:
        raise KeyboardInterrupt


def wait_for_stop(timeout_s: float) -> bool:
    """Sleep up to ``timeout_s`` seconds; True as soon as a stop signal is recorded
    (within :data:`STOP_POLL_S`), False when the time ran out first."""
    deadline = time.monotonic() + timeout_s
    while not _stop_signal:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(left, STOP_POLL_S))
    return True


def pause(seconds: float) -> None:
    """``time.sleep(seconds)`` that raises KeyboardInterrupt as soon as a stop signal is
    recorded (:func:`stop_on_signals`)."""
    if wait_for_stop(seconds):
        raise KeyboardInterrupt


def spawn(cmd: list[str], **popen_args) -> subprocess.Popen:
    """``subprocess.Popen(cmd, preexec_fn=..., **popen_args)`` for a child that dies
    with us (:func:`child_preexec`). Raises OSError when ``cmd`` cannot be started."""
    return subprocess.Popen(cmd, preexec_fn=child_preexec(), **popen_args)


def kvpool_env() -> dict[str, str]:
    """Our environment with this checkout's ``src`` first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def kvpool_cmd(*args: str) -> list[str]:
    """The command line of ``python -m kvpool ARGS`` with this interpreter."""
    return [sys.executable, "-m", "kvpool", *args]


def signal_name(number: int) -> str:
    """``9`` -> ``"SIGKILL"`` (``"signal N"`` for a number without a name)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def pause_process(pid: int, timeout_s: float = 10.0) -> bool:
    """SIGSTOP ``pid`` and return once every thread of it has stopped (True), or False
    when it has not within ``timeout_s`` seconds (gone, or still running). Why wait: a
    thread running on another core stops only when it next enters the kernel, so on a
    loaded machine a process "stopped" by os.kill still answered a request sent right
    after it (seen in CI: a put to a SIGSTOPped node succeeded in 0.5 ms)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _all_stopped(pid):
            return True
        time.sleep(0.001)
    return False


def _all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in state T (stopped) in /proc; False when the
    process is gone or /proc cannot be read."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        for tid in tasks:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]  # the name may hold spaces
            if state not in (b"T", b"t"):
                return False
    except (OSError, IndexError):
        return False
    return bool(tasks)


def wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """Wait up to ``timeout_s`` seconds for ``proc`` to exit, then SIGKILL it and wait
    as long again to reap it.

    Returns the exit status (negative signal number when killed), or None when the
    killed child was not reaped in time: it is never waited for without a bound, as a
    KeyboardInterrupt raised inside an earlier ``proc.poll()`` can leave Popen's waitpid
    lock taken (see :func:`stop_on_signals`), and an unbounded wait then never returns.
    """
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


def stop_ladder(proc: subprocess.Popen, timeout_s: float = 5.0, *, close_stdin: bool = False,
                kill: bool = False) -> int | None:
    """Stop ``proc``: close its stdin and wait (``close_stdin``: a child that exits at
    the end of its input), then SIGTERM (SIGKILL when ``kill``) and wait, then SIGKILL;
    each wait at most ``timeout_s`` seconds. Returns the exit status (None: killed,
    not reaped; see :func:`wait_or_kill`)."""
    if proc.poll() is not None:
        return proc.returncode
    if close_stdin and proc.stdin is not None:
        try:
            proc.stdin.close()
            return proc.wait(timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
    proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    return wait_or_kill(proc, timeout_s)


# ------------------------------------------------------------------------------ messages


class _Message(msgspec.Struct, tag_field="msg", tag=str.lower):
    """One line of the channel; ``msg`` holds the lower-case class name."""


class Progress(_Message):
    """Child -> parent: a line of progress for the user (``text``, one line)."""

    text: str


class Ready(_Message):
    """Child -> parent, once: it can take requests; ``info`` is what it wants known."""

    info: dict


class Request(_Message):
    """Parent -> child: do ``op`` with ``args``; answered by a Reply or an Error of ``id``."""

    id: int
    op: str
    args: dict = {}


class Reply(_Message):
    """Child -> parent: the result of request ``id``."""

    id: int
    result: dict


class Error(_Message):
    """Child -> parent: request ``id`` failed (``id`` None: a line that was no request)."""

    id: Union[int, None]
    reason: str


Message = Union[Progress, Ready, Request, Reply, Error]
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Message)


def encode(msg: Message) -> bytes:
    """One message as one JSON line (bytes, ending in a newline)."""
    return _ENCODER.encode(msg) + b"\n"


class WorkerChannel:
    """The child's end of the channel: messages on the process's real stdout.

    File descriptor 1 is pointed at stderr after the channel takes a copy of it, so a
    stray print from a library (or glog of a native one) never corrupts the protocol.
    """

    def __init__(self):
        self._out = os.fdopen(os.dup(1), "wb", buffering=0)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        self._lock = threading.Lock()  # progress lines come from other threads too

    def send(self, msg: Message) -> None:
        with self._lock:
            self._out.write(encode(msg))

    def progress(self, text: str) -> None:
        self.send(Progress(text))

    def requests(self) -> Iterator[Request]:
        """Requests read from stdin until it ends; a line that is none gets an Error."""
        for line in sys.stdin.buffer:
            if not line.strip():
                continue
            try:
                msg = _DECODER.decode(line)
            except msgspec.DecodeError:
                msg = None
            if isinstance(msg, Request):
                yield msg
            else:
                self.send(Error(None, f"not a request: {line[:80]!r}"))

    def serve(self, handle: Callable[[Request], dict], catch: tuple[type[BaseException], ...],
              describe: Callable[[BaseException], str] = lambda exc: f"{type(exc).__name__}: {exc}",
              ) -> None:
        """Answer every request with ``handle(request)``'s dict until stdin ends; an
        exception of the types ``catch`` becomes an Error with ``describe(exc)``."""
        for request in self.requests():
            try:
                self.send(Reply(request.id, handle(request)))
            except catch as exc:
                self.send(Error(request.id, describe(exc)))


# ------------------------------------------------------------------------------ processes


class ChildError(KVPoolError):
    """A child process exited, timed out, or answered a request with an error."""


class ChildProcess:
    """One started child process, its log file, and how it ends.

    Args:
        label: names the child in errors ("master", "engine A").
        cmd: the command line.
        log_path: file receiving the child's output (its stderr only with ``channel``);
            None: discarded.
        channel: stdin/stdout are the message channel (see module docstring) read by a
            thread; otherwise stdin is /dev/null and stdout goes to the log too.
        group: start the child in its own process group, so a Ctrl-C at the terminal
            reaches the parent only, which stops its children in order.
        env: the environment (default :func:`kvpool_env`).
        on_progress: callable(text) for the child's Progress messages and, every
            :attr:`heartbeat_s` seconds of a longer wait, a "still ..." line.

    The child gets SIGTERM when its parent dies (:func:`child_preexec`). Every message of
    the child is read once, so each wait remembers what it saw: the Ready message
    (:meth:`wait_ready` returns its info again at once) and the end of the stream (every
    later wait fails at once with the exit status and the log tail).
    Raises OSError when the command cannot be started.
    """

    error = ChildError
    heartbeat_s: float | None = None

    def __init__(self, label: str, cmd: list[str], log_path: Path | str | None, *,
                 channel: bool = False, group: bool = False, env: dict | None = None,
                 on_progress: Callable[[str], None] | None = None):
        self.label = label
        self.log_path = Path(log_path) if log_path else None
        self.on_progress = on_progress or (lambda text: None)
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        pipes = (dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log) if channel else
                 dict(stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
        try:
            self.proc = spawn(cmd, **pipes, env=env or kvpool_env(),
                              process_group=0 if group else None)
        finally:
            if self.log_path:
                log.close()
        self.info: dict = {}  # the Ready info, once seen
        self.stopped = False  # stopped by the parent (its exit status is no failure)
        self._next_id = 0
        self._ended = False  # the child's stdout reached its end (it exited)
        if channel:
            self._inbox: queue.Queue = queue.Queue()
            threading.Thread(target=self._read_stdout, name=f"{label}-reader",
                             daemon=True).start()

    # ------------------------------------------------------------------ log and status

    def log_tail(self, n: int = 20) -> str:
        """The last ``n`` lines of the log ("" when there is none)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except (OSError, AttributeError):
            return ""

    def exit_message(self) -> str:
        """Which child exited and how, and where its log is (for launchers to print):
        e.g. ``"node (pid 4242) exited with status 1; log: /tmp/.../node1.log"``."""
        code = self.proc.poll()
        how = ("is still running" if code is None else
               f"was killed by {signal_name(-code)}" if code < 0 else
               f"exited with status {code}")
        return f"{self.label} (pid {self.proc.pid}) {how}; log: {self.log_path}"

    @property
    def failed(self) -> bool:
        """True when the child exited on its own (not stopped by us) with a non-zero status."""
        return not self.stopped and self.proc.poll() not in (None, 0)

    def stop(self, timeout_s: float = 5.0, *, kill: bool = False,
             close_stdin: bool = False) -> int | None:
        """:func:`stop_ladder` of the child (marked as stopped by us when it was still
        running). Returns the exit status."""
        if self.proc.poll() is None:
            self.stopped = True
        return stop_ladder(self.proc, timeout_s, close_stdin=close_stdin, kill=kill)

    # ------------------------------------------------------------------ channel

    def _read_stdout(self) -> None:
        """Decode each stdout line into the inbox; None marks the end of the stream."""
        try:
            for line in self.proc.stdout:
                try:
                    self._inbox.put(_DECODER.decode(line))
                except msgspec.DecodeError:  # a stray line: shown, not lost
                    self._inbox.put(Progress(line.decode(errors="replace").rstrip("\n")))
        except (OSError, ValueError):  # the parent closed the stream
            pass
        self._inbox.put(None)

    def _fail(self, text: str) -> ChildError:
        return self.error(f"{self.label}{text}\n{self.log_tail(15)}")

    def _exited(self) -> ChildError:
        self._ended = True
        return self._fail(f" exited with status {self.proc.wait()}")

    def _next_message(self, what: str, deadline: float, started: float) -> Message:
        """The next message; raises at once if the child has exited, at ``deadline``, or
        (KeyboardInterrupt) when a stop signal is recorded (:func:`stop_on_signals`)."""
        beat = self.heartbeat_s
        next_beat = time.monotonic() + beat if beat else float("inf")
        while not self._ended:
            check_stop()
            now = time.monotonic()
            if now >= deadline:
                raise self._fail(f": no reply within {deadline - started:.0f} s ({what})")
            if now >= next_beat:
                self.on_progress(f"still {what} ({now - started:.0f} s)")
                next_beat = now + beat
            try:
                msg = self._inbox.get(timeout=min(deadline, next_beat, now + STOP_POLL_S) - now)
            except queue.Empty:
                continue
            # a terminal's Ctrl-C reaches children in our process group too: the stop,
            # not their exit that it caused, is what the caller must hear
            check_stop()
            if msg is None:
                break
            return msg
        raise self._exited()

    def _until(self, accept: Callable[[Message], bool], what: str, timeout_s: float) -> Message:
        """Read messages, passing Progress on, until ``accept(msg)`` is true."""
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            msg = self._next_message(what, deadline, started)
            if isinstance(msg, Ready):
                self.info = msg.info  # whoever reads it: the child sends it only once
            if isinstance(msg, Progress):
                self.on_progress(msg.text)
            elif accept(msg):
                return msg

    def wait_ready(self, timeout_s: float = 300.0) -> dict:
        """Wait for the child's Ready message; returns its info.

        Idempotent: once Ready was seen, returns the same info at once. Raises
        :attr:`error` at once when the child has exited, or after ``timeout_s`` seconds.
        """
        if self.info:
            return self.info
        self._until(lambda m: isinstance(m, Ready), "loading", timeout_s)
        return self.info

    def send(self, op: str, args: dict | None = None) -> int:
        """Send one Request; returns its id. Raises :attr:`error` when the child is gone."""
        self._next_id += 1
        try:
            self.proc.stdin.write(encode(Request(self._next_id, op, args or {})))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise self._fail(" is gone") from None
        return self._next_id

    def answer(self, request_id: int, timeout_s: float = 300.0, op: str = "") -> Reply | Error:
        """The Reply or Error to request ``request_id`` (``op``: its operation, named in
        the progress lines). Raises :attr:`error` when the child exits or ``timeout_s``
        seconds pass first."""
        # the id counts every request the child has had, so it is not named: a demo's
        # "request 1" of its cold replay is the child's fourth
        return self._until(lambda m: isinstance(m, (Reply, Error)) and m.id == request_id,
                           f"working on {op}" if op else "working", timeout_s)

    def request(self, op: str, args: dict | None = None, timeout_s: float = 300.0) -> dict:
        """Send a Request and return its result; an Error reply raises :attr:`error`."""
        msg = self.answer(self.send(op, args), timeout_s, op)
        if isinstance(msg, Error):
            raise self.error(f"{self.label}: {msg.reason}")
        return msg.result
