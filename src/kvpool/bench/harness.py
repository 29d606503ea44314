"""The measuring harness of ``kvpool bench store``, the same for every compared system.

A :class:`Target` adapts one system (kvpool, Mooncake, Redis, the machine's limits: the
modules of :mod:`kvpool.bench.systems`) to a few operations on numpy byte buffers (bytes
put/get, zero-copy put/get, batches); :class:`Bench` times them inside the system's
worker process (:func:`timed_loop`) and returns a :class:`CellResult` per cell. How the
controller drives the workers is :mod:`kvpool.bench.worker`.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

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


