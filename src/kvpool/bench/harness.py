"""The measuring harness shared by kvpool and its anchors (Mooncake, Redis, limits).

Every system under test runs in its own *worker* process, driven by the controller
(:mod:`kvpool.bench.store`) over a pipe with one JSON object per line. The controller
asks the workers in turn for one cell at a time, so kvpool and its anchors are measured
interleaved in the same seconds of the same run (the machine is shared and noisy; ratios
of measurements taken side by side stay fair). A worker that cannot start or that
crashes costs its column, never the run.

A :class:`Target` adapts one system to a few operations on numpy byte buffers (bytes
put/get, zero-copy put/get, batches); :class:`Bench` times them in the worker
(:func:`timed_loop`) and returns a :class:`CellResult` per cell.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import select
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

class Unavailable(Exception):
    """The system cannot run here (package absent, binary missing, refused to start)."""


@dataclass
class CellSpec:
    """One measurement: ``op`` ("put" | "get" | "copy") of ``api`` on values of ``size`` bytes.

    APIs: "bytes" (plain bytes objects), "zero_copy" (put from / get into a preallocated
    buffer), "batch" (zero-copy, ``batch`` keys per call), "copy" (the limits' only API).

    ``batch`` keys per call (1 for single ops). The timed loop stops after
    ``budget_s`` seconds or ``max_ops`` calls (at least ``min_ops``); puts also stop
    once ``put_cap_bytes`` were written, so a segment never fills during a cell. Calls
    cycle over objects and buffers covering ``working_set`` bytes (see :func:`pool_count`).
    """

    api: str
    op: str
    size: int
    batch: int = 1
    rep: int = 0
    budget_s: float = 0.3
    min_ops: int = 3
    max_ops: int = 20000
    put_cap_bytes: int = 256 << 20
    working_set: int = 64 << 20


@dataclass
class CellResult:
    """Figures of one cell repeat.

    gbps: payload bytes per second / 1e9 over the whole timed loop.
    ops_per_s: objects (keys, not calls) per second.
    p50_us, p99_us: per-call latency percentiles in microseconds (None when the
    target times a stream instead of calls).
    """

    gbps: float | None = None
    ops_per_s: float | None = None
    p50_us: float | None = None
    p99_us: float | None = None
    calls: int = 0
    error: str | None = None


class Target:
    """One system, as seen from the worker process. Subclasses override what they support.

    Buffers are C-contiguous ``np.uint8`` arrays; keys are ``str``. Every method raises
    on failure (the harness turns the exception into a failed cell, with its message).
    """

    name = "target"
    apis: tuple[str, ...] = ("bytes", "zero_copy", "batch")

    def open(self, cfg: dict) -> dict:
        """Start or connect; returns facts worth recording (versions, addresses).

        Raises: Unavailable when the system cannot run here.
        """
        return {}

    def register(self, buf: np.ndarray) -> None:
        """Register a buffer for zero-copy transfers (systems that need it)."""

    def unregister(self, buf: np.ndarray) -> None:
        """Undo :meth:`register` before the buffer is freed (its address may be reused)."""

    def put_bytes(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def get_bytes(self, key: str) -> bytes:
        raise NotImplementedError

    def put_from(self, key: str, buf: np.ndarray) -> None:
        raise NotImplementedError

    def get_into(self, key: str, buf: np.ndarray) -> int:
        raise NotImplementedError

    def batch_put_from(self, keys: list[str], bufs: list[np.ndarray]) -> None:
        raise NotImplementedError

    def batch_get_into(self, keys: list[str], bufs: list[np.ndarray]) -> None:
        raise NotImplementedError

    def remove(self, keys: list[str]) -> None:
        """Remove ``keys`` even under a read lease; keys that are absent are ignored."""
        raise NotImplementedError

    def copy(self, spec: CellSpec) -> CellResult:
        """The limits' own timed loop (op "copy"); ordinary stores never get it."""
        raise NotImplementedError

    def stats(self) -> dict:
        """Facts measured after the run (resident memory of the processes, in bytes)."""
        return {}

    def close(self) -> None:
        """Stop everything this target started."""


def percentile_us(lat_ns: np.ndarray, q: float) -> float:
    """Percentile ``q`` (0..100) of latencies given in ns, returned in µs."""
    return float(np.percentile(lat_ns, q)) / 1e3


def result_from(lat_ns: list[int], elapsed_s: float, spec: CellSpec) -> CellResult:
    """Turn per-call latencies and the loop's wall time into a :class:`CellResult`."""
    lat = np.asarray(lat_ns, dtype=np.int64)
    objects = len(lat) * spec.batch
    return CellResult(
        gbps=objects * spec.size / elapsed_s / 1e9,
        ops_per_s=objects / elapsed_s,
        p50_us=percentile_us(lat, 50),
        p99_us=percentile_us(lat, 99),
        calls=len(lat),
    )


def rss_bytes(pid: int, field_name: str = "VmRSS") -> int:
    """Resident memory of process ``pid`` from /proc (``VmRSS`` or peak ``VmHWM``), bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field_name)


def pool_count(size: int, batch: int, working_set: int) -> int:
    """Distinct objects a cell cycles over: enough to cover ``working_set`` bytes.

    A working set larger than the last-level cache (32 MiB here) keeps every system, and
    the memcpy limit, honest: the same 1 MiB copied again and again stays in cache and
    runs 3-4x faster than any KV load can. A multiple of ``batch``; at most
    ``MAX_POOL_KEYS`` objects (small values are bound by round trips, not by cache).
    """
    count = min(MAX_POOL_KEYS, max(1, -(-working_set // size)))
    return max(batch, count - count % batch)


MAX_POOL_KEYS = 4096
_FILL_CHUNK = 64  # objects per batch put while storing the get pool (untimed)


class Bench:
    """The worker's state: one open target, its buffers and the objects kept for gets."""

    def __init__(self, target: Target):
        self.target = target
        self.src: dict[int, list[np.ndarray]] = {}
        self.dst: dict[int, list[np.ndarray]] = {}
        self.get_keys: dict[int, list[str]] = {}

    def buffers(self, size: int, count: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """``count`` random source and zeroed destination buffers of ``size`` bytes, resident."""
        src, dst = self.src.setdefault(size, []), self.dst.setdefault(size, [])
        rng = np.random.default_rng(size + len(src))
        while len(src) < count:
            s = rng.integers(0, 256, size, dtype=np.uint8)
            d = np.empty(size, dtype=np.uint8)
            d.fill(0)  # touch every page now: a first-use page fault is not a transfer cost
            self.target.register(s)
            self.target.register(d)
            src.append(s)
            dst.append(d)
        return src[:count], dst[:count]

    def ensure_get_keys(self, size: int, count: int) -> list[str]:
        """Store ``count`` objects of ``size`` bytes once (untimed) for the get cells."""
        keys = self.get_keys.setdefault(size, [])
        src, _ = self.buffers(size, count)
        while len(keys) < count:
            first = len(keys)
            new = [f"bench-get-{size}-{i}" for i in range(first, min(count, first + _FILL_CHUNK))]
            bufs = src[first:first + len(new)]
            if "batch" in self.target.apis:
                self.target.batch_put_from(new, bufs)
            elif "zero_copy" in self.target.apis:
                for key, buf in zip(new, bufs):
                    self.target.put_from(key, buf)
            else:
                for key, buf in zip(new, bufs):
                    self.target.put_bytes(key, buf.tobytes())
            keys.extend(new)
        return keys[:count]

    def drop(self, size: int) -> None:
        """Remove the get objects of ``size`` and free the buffers (end of a size)."""
        keys = self.get_keys.pop(size, [])
        if keys:
            self.target.remove(keys)
        for buf in self.src.pop(size, []) + self.dst.pop(size, []):
            self.target.unregister(buf)

    def run(self, spec: CellSpec) -> CellResult:
        """Run one cell; a failure of the system becomes ``CellResult(error=...)``."""
        if spec.api not in self.target.apis:
            return CellResult(error=f"{self.target.name} has no {spec.api} API")
        try:
            if spec.op == "copy":
                return self.target.copy(spec)
            if spec.op == "get":
                return self._get(spec)
            return self._put(spec)
        except Exception as exc:  # the cell fails, the worker and the run go on
            return CellResult(error=f"{type(exc).__name__}: {exc}"[:300])

    def _call(self, spec: CellSpec, keys: list[str], src, dst, value: bytes = b""):
        """One call of ``spec`` on these keys/buffers, as a callable built outside the clock."""
        t = self.target
        if spec.api == "bytes":
            if spec.op == "put":
                return functools.partial(t.put_bytes, keys[0], value)
            return functools.partial(t.get_bytes, keys[0])
        if spec.api == "zero_copy":
            if spec.op == "put":
                return functools.partial(t.put_from, keys[0], src[0])
            return functools.partial(t.get_into, keys[0], dst[0])
        if spec.op == "put":
            return functools.partial(t.batch_put_from, keys, src)
        return functools.partial(t.batch_get_into, keys, dst)

    def _get(self, spec: CellSpec) -> CellResult:
        """Gets cycling over a pool of stored objects; the first call is checked, untimed."""
        pool = pool_count(spec.size, spec.batch, spec.working_set)
        keys = self.ensure_get_keys(spec.size, pool)
        src, dst = self.buffers(spec.size, pool)
        b = spec.batch
        distinct = [self._call(spec, keys[i:i + b], src[i:i + b], dst[i:i + b])
                    for i in range(0, pool, b)]
        self._check_get(spec, keys[:b], src[:b], dst[:b], distinct[0])
        calls = [distinct[i % len(distinct)] for i in range(spec.max_ops)]
        lat, elapsed = timed_loop(calls, spec)
        return result_from(lat, elapsed, spec)

    def _check_get(self, spec: CellSpec, keys, src, dst, call) -> None:
        """Warms connections and proves the bytes are right before the clock starts."""
        if spec.api == "bytes":
            ok = bytes(call()) == src[0].tobytes()
        else:
            for d, s in zip(dst, src):
                d[:1] = ~s[:1]
            call()
            ok = all(np.array_equal(s, d) for s, d in zip(src, dst))
        if not ok:
            raise AssertionError(f"{self.target.name} returned wrong bytes for {keys[0]}")

    def _put(self, spec: CellSpec) -> CellResult:
        """Puts to fresh keys (at most ``put_cap_bytes``), all removed afterwards, untimed."""
        b = spec.batch
        pool = pool_count(spec.size, b, spec.working_set)
        src, dst = self.buffers(spec.size, pool)
        values = [s.tobytes() for s in src] if spec.api == "bytes" else []
        per_call = spec.size * b
        n = max(spec.min_ops, min(spec.max_ops, spec.put_cap_bytes // per_call)) + 1
        key_lists = [[f"bench-put-{spec.api}-{spec.size}-{spec.rep}-{i}-{j}" for j in range(b)]
                     for i in range(n)]
        calls = []
        for i, keys in enumerate(key_lists):
            at = (i * b) % pool
            calls.append(self._call(spec, keys, src[at:at + b], dst[at:at + b],
                                    values[at] if values else b""))
        lat: list[int] = []
        try:
            calls[0]()  # warm-up, untimed
            lat, elapsed = timed_loop(calls[1:], spec)
        finally:  # on failure we do not know how far it got: remove all, missing is fine
            done = key_lists[:1 + len(lat)] if lat else key_lists
            self.target.remove([k for keys in done for k in keys])
        return result_from(lat, elapsed, spec)


def timed_loop(calls: list, spec: CellSpec) -> tuple[list[int], float]:
    """Run ``calls`` in order until ``spec.budget_s`` is spent (at least ``min_ops``).

    Returns (per-call latencies in ns, wall seconds of the whole loop).
    """
    clock = time.perf_counter_ns
    lat: list[int] = []
    start = clock()
    deadline = start + int(spec.budget_s * 1e9)
    for call in calls:
        t0 = clock()
        call()
        t1 = clock()
        lat.append(t1 - t0)
        if t1 >= deadline and len(lat) >= spec.min_ops:
            break
    return lat, (clock() - start) / 1e9


# --------------------------------------------------------------------------- worker side


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
               "from kvpool.bench.anchors_base import worker_main; worker_main()"]
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
