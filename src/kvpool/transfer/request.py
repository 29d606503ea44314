"""Transfer requests and their completion statuses, and the interface every transport
implements (local memcpy, shared memory, TCP; a verbs or NIXL transport later).

A request moves ``length`` bytes between ``local[local_offset:]`` (a byte memoryview of
the caller's memory) and ``segment`` at ``remote_offset``: READ copies segment → local,
WRITE copies local → segment. Statuses follow Mooncake's transfer engine
(``TransferStatusEnum``: COMPLETED, FAILED, TIMEOUT, INVALID).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Callable

from kvpool.protocol import SegmentInfo


class Op(enum.IntEnum):
    READ = 0  # segment -> local buffer
    WRITE = 1  # local buffer -> segment


class TransferStatus(enum.IntEnum):
    COMPLETED = 0
    FAILED = 1  # the transport failed (peer gone, stream broken, mapping lost)
    TIMEOUT = 2  # not finished before the batch's deadline
    INVALID = 3  # refused before any byte moved (0 length, out of bounds, no transport)


@dataclass(slots=True)
class TransferRequest:
    """One contiguous copy; sizes and offsets in bytes, any size up to 2**64 - 1."""

    op: Op
    local: memoryview
    local_offset: int
    segment: SegmentInfo
    remote_offset: int
    length: int

    def problem(self) -> str | None:
        """Why this request cannot run (checked before a byte moves), or None."""
        if self.length <= 0:
            return "length must be > 0"
        if self.local_offset < 0 or self.local_offset + self.length > len(self.local):
            return (f"local range [{self.local_offset}, +{self.length}) exceeds the "
                    f"{len(self.local)}-byte buffer")
        if self.remote_offset < 0 or self.remote_offset + self.length > self.segment.size:
            return f"remote range exceeds segment {self.segment.name} ({self.segment.size} bytes)"
        if self.op == Op.READ and self.local.readonly:
            return "READ into a read-only buffer"
        return None

    def local_view(self) -> memoryview:
        return self.local[self.local_offset : self.local_offset + self.length]

    def slice(self, offset: int, length: int) -> "TransferRequest":
        """The part ``[offset, offset + length)`` of this request (same direction)."""
        return TransferRequest(self.op, self.local, self.local_offset + offset, self.segment,
                               self.remote_offset + offset, length)


class TransferResult(list):
    """The statuses of a finished batch (a list of :class:`TransferStatus`, one per
    request in submission order) and ``reasons``: why failed requests failed, as the
    transports reported it (e.g. ``"tcp 127.0.0.1:5000: ConnectionRefusedError [errno
    111]"``, ``"... node replied INVALID_PARAMS"``); empty when every request completed."""

    def __init__(self, statuses, reasons: list[str] | None = None):
        super().__init__(statuses)
        self.reasons = list(reasons or [])

    def describe(self, index: int) -> str:
        """One line for request ``index``: its status name and the batch's reasons."""
        why = "; ".join(self.reasons)
        return f"{TransferStatus(self[index]).name}" + (f": {why}" if why else "")


class Cancel:
    """Cancels the socket work of one batch: a flag plus shutdown() of every socket the
    batch's tasks registered, which wakes a thread blocked in recv or send. Cheap to
    create (one per batch, on the hot path).

    It also collects why requests of the batch failed (:meth:`note`): a transport that
    returns False for a request says why here (peer address, errno, the node's reply
    code), so the caller's error names the cause instead of only "failed".

    ``on_sent``: called once, by the first :meth:`payload_sent`, when a transport has
    handed a write's payload to the kernel and only the peer's answer is left to wait
    for (a put tells the master its commit is coming then: :class:`kvpool.protocol.Wake`).
    """

    def __init__(self, on_sent: Callable[[], None] | None = None):
        self.fired = False
        self.reasons: list[str] = []
        self.on_sent = on_sent
        self._socks: set = set()
        self._lock = threading.Lock()

    def payload_sent(self) -> None:
        """A write's payload has left this process (see the class docstring); lanes may
        say so from several threads at once."""
        with self._lock:
            on_sent, self.on_sent = self.on_sent, None
        if on_sent is not None:
            on_sent()

    def note(self, reason: str) -> None:
        """Record why a request of this batch failed (kept in order, duplicates dropped)."""
        with self._lock:
            if reason not in self.reasons and len(self.reasons) < 8:
                self.reasons.append(reason)

    def track(self, sock) -> None:
        with self._lock:
            self._socks.add(sock)
        if self.fired:
            _shutdown(sock)

    def untrack(self, sock) -> None:
        with self._lock:
            self._socks.discard(sock)

    def fire(self) -> None:
        self.fired = True
        with self._lock:
            socks = list(self._socks)
        for sock in socks:
            _shutdown(sock)


def _shutdown(sock) -> None:
    try:
        sock.shutdown(2)  # SHUT_RDWR
    except OSError:
        pass  # already closed


class Transport:
    """Interface of a transport. Subclasses set ``name``, ``rank`` (lower = preferred
    when a replica is reachable several ways), ``lanes`` (parallel connections per
    peer the engine may use for one large batch; 1 = no slicing) and ``slice_bytes``
    (the smallest slice worth a lane of its own).

    ``run`` executes requests that all target one segment, blocking until done or
    ``deadline`` (time.monotonic seconds), and returns one bool (success) per request.
    It must not raise for a failed peer (return False, and say why with
    ``cancel.note(reason)``), must stop touching the requests' buffers before it
    returns, and must honour ``cancel``.
    """

    name = "abstract"
    rank = 100
    lanes = 1
    slice_bytes = 4 << 20
    in_place = False  # a copy in this process's memory (read_many, write_many): batching saves nothing per value

    def can_reach(self, segment: SegmentInfo) -> bool:
        raise NotImplementedError

    def lanes_to(self, segment: SegmentInfo) -> int:
        """Lanes the engine may use for one large batch to ``segment`` (``lanes``
        unless a transport knows better for that peer)."""
        return self.lanes

    def run(self, requests: list[TransferRequest], deadline: float, cancel: Cancel) -> list[bool]:
        raise NotImplementedError

    def read_bytes(self, segment: SegmentInfo, offset: int, length: int, deadline: float,
                   cancel: "Cancel | None" = None) -> bytes | None:
        """``length`` bytes at ``offset`` of ``segment`` as bytes, or None on failure
        (why: noted on ``cancel`` when given). Transports override this with a one-copy
        path; this default copies twice."""
        buf = bytearray(length)
        req = TransferRequest(Op.READ, memoryview(buf), 0, segment, offset, length)
        return bytes(buf) if self.run([req], deadline, cancel or Cancel())[0] else None

    def read_into(self, segment: SegmentInfo, offset: int, dst: memoryview, deadline: float,
                  cancel: "Cancel | None" = None) -> bool:
        """Copy ``len(dst)`` bytes at ``offset`` of ``segment`` into the writable byte
        view ``dst``; False on failure (why: noted on ``cancel`` when given; ``dst`` is
        then undefined). Same-host transports override this with a path that builds no
        request; this default runs one READ."""
        return self._run_one(TransferRequest(Op.READ, dst, 0, segment, offset, len(dst)), deadline, cancel)

    def read_many(self, segment: SegmentInfo, ranges: list[tuple[int, memoryview]], deadline: float,
                  cancel: "Cancel | None" = None) -> bool:
        """Copy each (offset, destination) range of ``segment`` into its writable byte
        view, in this thread; True when every copy may be kept, False when any failed
        (all destinations then undefined; why: noted on ``cancel`` when given). Only
        ``in_place`` transports have it (a batch get's values in this host's memory:
        a loop of memcpys and one epoch check, no request objects)."""
        raise NotImplementedError

    def write_many(self, segment: SegmentInfo, ranges: list[tuple[int, memoryview]], deadline: float,
                   cancel: "Cancel | None" = None) -> bool:
        """Copy each (offset, source view) range into ``segment``, in this thread; True
        when every write landed under the grant's epoch (why not: noted on ``cancel``).
        Only ``in_place`` transports have it (a batch put's values in this host's memory)."""
        raise NotImplementedError

    def write_from(self, segment: SegmentInfo, offset: int, src: memoryview, deadline: float,
                   cancel: "Cancel | None" = None) -> bool:
        """Copy the byte view ``src`` to ``offset`` of ``segment``; False on failure (why:
        noted on ``cancel`` when given; the range is then undefined). Same-host
        transports override this with a path that builds no request (a single put's
        copy); this default runs one WRITE."""
        return self._run_one(TransferRequest(Op.WRITE, src, 0, segment, offset, len(src)), deadline, cancel)

    def _run_one(self, req: TransferRequest, deadline: float, cancel: "Cancel | None") -> bool:
        """:meth:`run` of one request, refused (why noted) when its ranges are wrong."""
        cancel = cancel or Cancel()
        problem = req.problem()
        if problem:
            cancel.note(problem)
            return False
        return self.run([req], deadline, cancel)[0]

    def value_view(self, segment: SegmentInfo, offset: int, length: int, deadline: float | None = None):
        """A view of ``length`` bytes at ``offset`` of a segment mapped in this process,
        and a callable telling whether bytes copied out of it under the grant's epoch
        may still be kept (call it after copying); None when this transport moves bytes
        over a wire instead (every transport but the same-host ones). A grant of a mount
        still being made waits for it until ``deadline`` (time.monotonic; None: at most
        :data:`~kvpool.transfer.epoch.MOUNT_WAIT_S` from now)."""
        return None

    def close(self) -> None:
        pass
