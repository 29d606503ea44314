"""The transfer engine: batches of transfer requests, routed to transports, run
asynchronously, with a completion status per request and a deadline.

``submit(requests) -> BatchHandle``; ``handle.wait(timeout) -> list[TransferStatus]``.
Each request is checked first (length > 0, both ranges in bounds: INVALID otherwise, no
byte moves), then routed to the preferred transport that reaches its segment (local
memcpy in this process, shared memory on this host, TCP anywhere; a transport added
with :meth:`TransferEngine.add_transport` — RDMA, NIXL — needs no change elsewhere).
Requests to one segment form one task, so a batch of small objects is one exchange per
peer. For a transport with several lanes, a large batch is cut into slices
(:func:`plan_slices`, ≥ :data:`SLICE_BYTES` each) spread over up to ``lanes`` parallel
connections. A request is COMPLETED only if every slice of it was.

Timeouts: every transport honours the batch deadline; ``wait(timeout)`` that runs out
first cancels the batch (shuts its sockets down) and joins its tasks, so when ``wait``
returns no thread of the batch is still touching the caller's buffers.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Callable

from kvpool.protocol import SegmentInfo
from kvpool.transfer.request import Cancel, Op, TransferRequest, TransferResult, TransferStatus, Transport

log = logging.getLogger("kvpool.transfer")

SLICE_BYTES = Transport.slice_bytes  # default smallest slice given a lane of its own
JOIN_S = 2.0  # after a cancel, how long wait() joins the batch's tasks
ROUTES_KEPT = 4096  # segment mounts whose route is remembered (then the memory starts afresh)


def plan_slices(length: int, lanes: int, min_slice: int = SLICE_BYTES) -> list[tuple[int, int]]:
    """Cut ``length`` bytes into n = min(lanes, length // min_slice) (at least 1) slices
    of near-equal size; returns [(offset, length)], contiguous, covering every byte.
    Pure integer arithmetic: exact for any length up to 2**64."""
    n = max(1, min(lanes, length // min_slice))
    base, extra = divmod(length, n)
    out, offset = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append((offset, size))
        offset += size
    return out


def spread(requests: list[tuple[int, TransferRequest]], lanes: int,
           min_slice: int = SLICE_BYTES) -> list[list[tuple[int, TransferRequest]]]:
    """Slice large requests and spread (parent index, slice) pairs over up to ``lanes``
    lanes, each to the least-loaded lane; one lane when the total is under two slices."""
    total = sum(r.length for _, r in requests)
    if lanes <= 1 or total < 2 * min_slice:
        return [requests]
    pieces = [(i, r.slice(off, n) if n != r.length else r)
              for i, r in requests for off, n in plan_slices(r.length, lanes, min_slice)]
    bins: list[list[tuple[int, TransferRequest]]] = [[] for _ in range(lanes)]
    load = [0] * lanes
    for i, piece in sorted(pieces, key=lambda p: -p[1].length):
        k = load.index(min(load))
        bins[k].append((i, piece))
        load[k] += piece.length
    return [b for b in bins if b]


def _sliced(transport: Transport, segment: SegmentInfo, length: int) -> bool:
    """Whether a request of ``length`` bytes to ``segment`` alone would be cut over
    several of ``transport``'s lanes (:func:`spread`)."""
    return length >= 2 * transport.slice_bytes and transport.lanes_to(segment) > 1


class BatchHandle:
    """Completion of one submitted batch (see the module docstring)."""

    def __init__(self, statuses: list[TransferStatus | None], deadline: float):
        self._statuses = statuses
        self._deadline = deadline
        self._cancel = Cancel()
        self._tasks: list[tuple[Future, list[int]]] = []
        self._failed: set[int] = set()
        self._lock = threading.Lock()

    def _record(self, parents: list[int], oks: list[bool]) -> None:
        with self._lock:
            for i, ok in zip(parents, oks):
                if not ok:
                    self._failed.add(i)

    def done(self) -> bool:
        """True once every task of the batch has ended (wait() then returns at once)."""
        return all(f.done() for f, _ in self._tasks)

    def wait(self, timeout: float | None = None) -> TransferResult:
        """Statuses, one per request in submission order, once every task has ended
        (a :class:`TransferResult`: a list that also carries the failures' reasons).

        ``timeout`` (seconds; None = until the batch deadline) that expires first
        cancels the rest: unfinished requests are TIMEOUT. Raises what a transport
        raised unexpectedly (a bug, never a failed peer)."""
        limit = self._deadline - time.monotonic() + JOIN_S if timeout is None else timeout
        futures = [f for f, _ in self._tasks]
        _, pending = wait_futures(futures, timeout=max(0.0, limit))
        timed_out = bool(pending)
        if pending:
            self._cancel.fire()
            _, still = wait_futures(pending, timeout=JOIN_S)
            if still:
                log.error("transfer tasks ignored cancellation for %.1f s", JOIN_S)
        for f in futures:
            if f.done() and f.exception() is not None:
                raise f.exception()
        return self._result(timed_out)

    def _result(self, timed_out: bool) -> TransferResult:
        """The statuses once every task has ended (``timed_out``: wait() cancelled)."""
        out = list(self._statuses)
        for k, status in enumerate(out):
            if status is None:
                if k in self._failed:
                    out[k] = TransferStatus.TIMEOUT if timed_out or time.monotonic() > self._deadline \
                        else TransferStatus.FAILED
                else:
                    out[k] = TransferStatus.COMPLETED
        return TransferResult(out, self._cancel.reasons)


class TransferEngine:
    """Routes and runs batches of :class:`TransferRequest`.

    Args: transports (any order; ranked by their ``rank``), timeout_s (default batch
    deadline), workers (threads for lanes and asynchronous batches; started lazily).
    """

    def __init__(self, transports: list[Transport], timeout_s: float = 10.0, workers: int = 8):
        self.transports = sorted(transports, key=lambda t: t.rank)
        self.timeout_s = timeout_s
        self.workers = workers
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._routes: dict[tuple[str, int], Transport | None] = {}  # (segment, epoch) -> route

    def add_transport(self, transport: Transport) -> None:
        """Plug in a transport (e.g. RDMA); it serves the segments it can reach, by rank."""
        self.transports = sorted([*self.transports, transport], key=lambda t: t.rank)
        self._routes = {}

    def route(self, segment: SegmentInfo) -> Transport | None:
        """The preferred transport that reaches ``segment``, or None. Remembered per
        segment mount (name and epoch): a segment mounted again is routed afresh."""
        key = (segment.name, segment.epoch)
        found = self._routes.get(key, False)
        if found is False:
            if len(self._routes) >= ROUTES_KEPT:
                self._routes = {}
            found = self._routes[key] = next((t for t in self.transports if t.can_reach(segment)), None)
        return found

    def _deadline_after(self, timeout_s: float | None) -> float:
        """time.monotonic() seconds by which a transfer given ``timeout_s`` (None: the
        engine's own) must end."""
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="kvpool-xfer")
            return self._executor

    def _plan(self, requests: list[TransferRequest], timeout_s: float | None):
        """A handle with INVALID statuses set, and the tasks: (transport, [(parent, req)])."""
        deadline = self._deadline_after(timeout_s)
        statuses: list[TransferStatus | None] = [None] * len(requests)
        groups: dict[tuple[str, str], tuple[Transport, list]] = {}
        routes: dict[str, Transport | None] = {}
        handle = BatchHandle(statuses, deadline)
        for i, req in enumerate(requests):
            name = req.segment.name
            if name not in routes:
                routes[name] = self.route(req.segment)
            problem = req.problem() or (None if routes[name] else f"no transport reaches segment {name}")
            if problem:
                statuses[i] = TransferStatus.INVALID
                handle._cancel.note(problem)
                continue
            groups.setdefault((routes[name].name, name), (routes[name], []))[1].append((i, req))
        tasks = [(t, lane) for t, group in groups.values()  # a group: one transport, one segment
                 for lane in spread(group, t.lanes_to(group[0][1].segment), t.slice_bytes)]
        return handle, tasks

    def _start(self, handle: BatchHandle, transport: Transport, lane: list, inline: bool) -> None:
        parents = [i for i, _ in lane]

        def task():
            oks = transport.run([r for _, r in lane], handle._deadline, handle._cancel)
            handle._record(parents, oks)

        if inline:
            future: Future = Future()
            try:
                task()
                future.set_result(None)
            except BaseException as exc:  # handed to wait(), which re-raises it
                future.set_exception(exc)
        else:
            future = self._pool().submit(task)
        handle._tasks.append((future, parents))

    def submit(self, requests: list[TransferRequest], timeout_s: float | None = None) -> BatchHandle:
        """Start ``requests`` on the worker threads; returns at once."""
        handle, tasks = self._plan(requests, timeout_s)
        for transport, lane in tasks:
            self._start(handle, transport, lane, inline=False)
        return handle

    def transfer(self, requests: list[TransferRequest], timeout_s: float | None = None,
                 on_sent: Callable[[], None] | None = None) -> TransferResult:
        """Run ``requests`` and wait: the first task in the calling thread (no thread
        hand-off for the common one-peer batch), the others on worker threads.
        ``on_sent``: called once, when a transport first reports a write's payload sent
        (:class:`~kvpool.transfer.request.Cancel`; from a worker thread when that lane
        runs there)."""
        if len(requests) == 1:
            transport = self.route(requests[0].segment)
            if transport is None or not _sliced(transport, requests[0].segment, requests[0].length):
                return self._transfer_one(transport, requests[0], timeout_s, on_sent)
        handle, tasks = self._plan(requests, timeout_s)
        handle._cancel.on_sent = on_sent
        if len(tasks) == 1:  # the common case: no future, no thread
            transport, lane = tasks[0]
            handle._record([i for i, _ in lane], transport.run([r for _, r in lane], handle._deadline, handle._cancel))
            return handle._result(timed_out=False)
        for k, (transport, lane) in enumerate(tasks):
            if k:
                self._start(handle, transport, lane, inline=False)
        if tasks:
            self._start(handle, *tasks[0], inline=True)
        return handle.wait()

    def read_into(self, transport: Transport, segment: SegmentInfo, offset: int, dst: memoryview,
                  timeout_s: float | None = None) -> bool:
        """Copy ``len(dst)`` bytes at ``offset`` of ``segment`` into ``dst`` over
        ``transport`` (a route of :meth:`route`), in this thread; True when copied. The
        path of a single get: no request status, no batch; a read large enough to be
        sliced over several lanes goes through :meth:`transfer`."""
        if _sliced(transport, segment, len(dst)):
            return self._sliced_one(Op.READ, segment, offset, dst, timeout_s, None)
        return transport.read_into(segment, offset, dst, self._deadline_after(timeout_s))

    def write_from(self, transport: Transport, segment: SegmentInfo, offset: int, src: memoryview,
                   timeout_s: float | None = None, cancel: Cancel | None = None) -> bool:
        """Copy the byte view ``src`` to ``offset`` of ``segment`` over ``transport`` (a
        route of :meth:`route`), in this thread; True when written (else why is noted on
        ``cancel`` when given). The path of a single put, as :meth:`read_into` is a
        single get's."""
        if _sliced(transport, segment, len(src)):
            return self._sliced_one(Op.WRITE, segment, offset, src, timeout_s, cancel)
        return transport.write_from(segment, offset, src, self._deadline_after(timeout_s), cancel)

    def _sliced_one(self, op: Op, segment: SegmentInfo, offset: int, local: memoryview,
                    timeout_s: float | None, cancel: Cancel | None) -> bool:
        """:meth:`read_into` / :meth:`write_from` of a value large enough to be cut over
        several lanes: one request through :meth:`transfer` (reasons noted on ``cancel``)."""
        result = self.transfer([TransferRequest(op, local, 0, segment, offset, len(local))], timeout_s,
                               cancel.on_sent if cancel is not None else None)
        if cancel is not None:
            for reason in result.reasons:
                cancel.note(reason)
        return result[0] == TransferStatus.COMPLETED

    def _transfer_one(self, transport: Transport | None, req: TransferRequest,
                      timeout_s: float | None, on_sent: Callable[[], None] | None = None) -> TransferResult:
        """:meth:`transfer` of one request that needs no slicing, over ``transport`` (its
        route; None: unreachable), in this thread, with none of a batch's bookkeeping (a
        single get or put pays it on every call)."""
        problem = req.problem() or (None if transport else f"no transport reaches segment {req.segment.name}")
        if problem:
            return TransferResult([TransferStatus.INVALID], [problem])
        deadline = self._deadline_after(timeout_s)
        cancel = Cancel(on_sent)
        if transport.run([req], deadline, cancel)[0]:
            return TransferResult([TransferStatus.COMPLETED])
        late = time.monotonic() > deadline
        return TransferResult([TransferStatus.TIMEOUT if late else TransferStatus.FAILED], cancel.reasons)

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker threads (after their tasks) and close every transport."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        for transport in self.transports:
            transport.close()
