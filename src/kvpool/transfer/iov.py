"""Vectored socket I/O on blocking sockets with a deadline: payloads move between the
kernel and the caller's memoryviews with ``sendmsg`` (gather) and ``recvmsg_into`` /
``recv_into`` with ``MSG_WAITALL`` (scatter), one Python iteration per system call of
at most :data:`CALL_BYTES`, never per byte or per small chunk, and no intermediate buffer.

Sockets used here are in blocking mode with a short kernel timeout
(``SO_RCVTIMEO`` / ``SO_SNDTIMEO`` = :data:`POLL_S`, set by
:func:`kvpool.protocol.set_kernel_timeouts`): a call that waits longer returns
what it moved so far (or EAGAIN), and the loop checks the caller's deadline, so a silent
peer costs at most the deadline plus :data:`POLL_S`. A peer that dies gives EOF or a reset
at once. Linux caps one call at about 2 GiB; the loops resume, so lengths above 2**32
work. Raises :class:`TimeoutError` past the deadline and :class:`ConnectionError` on EOF.
"""

from __future__ import annotations

import errno
import os
import socket
import time

IOV_MAX = 1024  # buffers per sendmsg/recvmsg_into call (Linux UIO_MAXIOV)
# Bytes one call moves at most. One sendmsg of 128 MiB gathered from 128 views moved
# 3.2-3.3 GB/s over loopback here, the same bytes in calls of 1 MiB 5.4-5.8 (the
# kernel holds the socket for a whole call, so the peer's ACKs wait and the window
# stalls); 64 KiB calls cost more in calls than they gain (1.7), 4 MiB ones 4.2.
CALL_BYTES = 1 << 20
YIELD_AFTER_S = 20e-6  # a poll idle this long yields the core between its calls
# a receive polls at most this long in all, then blocks: a peer that trickles its bytes
# (each one restarting the idle clock) cannot keep a data server's thread spinning
POLL_TOTAL_S = 0.005
POLL_S = 0.2  # seconds a single blocking call may wait before the deadline is checked
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)


def _check(deadline: float | None, what: str) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(f"{what} did not finish before its deadline")


def _first(views: list[memoryview]) -> list[memoryview]:
    """The leading views one call moves: at most IOV_MAX of them and CALL_BYTES in
    all (the first view cut to CALL_BYTES when longer)."""
    if len(views[0]) >= CALL_BYTES:
        return [views[0][:CALL_BYTES]]
    out, total = [], 0
    for view in views[:IOV_MAX]:
        if total + len(view) > CALL_BYTES:
            break
        out.append(view)
        total += len(view)
    return out


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first ``n`` bytes of the view list."""
    i = 0
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    rest = views[i:]
    if n:
        rest[0] = rest[0][n:]
    return rest


def _stalled(deadline: float | None, stall_s: float | None, moved: int) -> float | None:
    """The deadline once a call moved ``moved`` bytes (-1: before the first call). With
    ``stall_s`` it replaces the caller's: ``stall_s`` from the last byte moved."""
    if stall_s is not None and moved:
        return time.monotonic() + stall_s
    return deadline


def _pump(pending: list[memoryview], move, deadline: float | None, stall_s: float | None,
          what: str) -> None:
    """Call ``move(pending)`` (one system call; returns the bytes it moved) until every
    view is done; EAGAIN/EINTR move nothing, then the deadline is checked (with
    ``stall_s``: ``stall_s`` from the last byte moved, see :func:`_stalled`)."""
    deadline = _stalled(deadline, stall_s, -1)
    while pending:
        try:
            n = move(pending)
        except OSError as exc:  # ConnectionError too: its errno is never one of _AGAIN
            if exc.errno not in _AGAIN:
                raise
            n = 0
        pending = _advance(pending, n)
        deadline = _stalled(deadline, stall_s, n)
        if pending and not n:
            _check(deadline, what)


def send_views(sock: socket.socket, views: list, deadline: float | None = None,
               stall_s: float | None = None) -> None:
    """Send every byte of ``views`` (bytes or byte memoryviews) in order.

    One ``sendmsg`` per call gathers up to IOV_MAX views. ``stall_s`` (instead of
    ``deadline``): give up when no byte has left for that many seconds. Raises
    TimeoutError, ConnectionError, OSError; the stream is then unusable (part may have
    gone).
    """
    pending = [v if isinstance(v, memoryview) else memoryview(v) for v in views if len(v)]
    _pump(pending, lambda p: sock.sendmsg(_first(p)), deadline, stall_s, "send")


def _receiver(sock: socket.socket, flags: int):
    """One receive call into the leading views of a pending list (at most CALL_BYTES);
    returns the bytes it moved. Raises ConnectionError on EOF, BlockingIOError."""
    def receive(pending: list[memoryview]) -> int:
        views = _first(pending)
        if len(views) == 1:
            n = sock.recv_into(views[0], len(views[0]), flags)
        else:
            n = sock.recvmsg_into(views, 0, flags)[0]
        if n == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        return n
    return receive


def recv_views(sock: socket.socket, views: list[memoryview], deadline: float | None = None,
               stall_s: float | None = None, poll_s: float = 0.0) -> None:
    """Fill every view of ``views`` from ``sock``, in order (scatter, MSG_WAITALL).

    ``stall_s`` (instead of ``deadline``): give up when no byte has arrived for that many
    seconds (a server must not wait forever on a peer that stopped mid-frame, K22).
    ``poll_s``: first receive without sleeping while bytes keep coming
    (:func:`_poll_into`), then block for the rest. Raises ConnectionError on EOF (the
    peer closed or died), TimeoutError past the deadline; the views' content is then
    undefined.
    """
    pending = [v for v in views if len(v)]
    if poll_s and pending:
        pending = _poll_into(sock, pending, poll_s, deadline)
    _pump(pending, _receiver(sock, _WAITALL), deadline, stall_s, "receive")


def _poll_into(sock: socket.socket, pending: list[memoryview], poll_s: float,
               deadline: float | None) -> list[memoryview]:
    """Receive into ``pending`` with non-blocking calls until every view is full or
    ``poll_s`` seconds pass without a byte (or :data:`POLL_TOTAL_S` in all); returns the
    views still to fill (the caller blocks for them). Between bursts it spins; once idle
    for :data:`YIELD_AFTER_S` it yields the core between calls (the sender may be
    waiting for it).

    Why: a receiver blocked in recv is woken for each burst of a payload as it arrives;
    on the 2-vCPU VM of docs/bench.md each wake-up costs some 30 us (an inter-processor
    interrupt through the hypervisor): 1 MiB read from a data server took 452 us
    blocked, 290-330 polled. Raises TimeoutError past ``deadline``, ConnectionError on EOF.
    """
    receive = _receiver(sock, _DONTWAIT)
    last = start = time.monotonic()
    while pending:
        try:
            n = receive(pending)
        except (BlockingIOError, InterruptedError):
            now = time.monotonic()
            idle = now - last
            if idle > poll_s or now - start > POLL_TOTAL_S:
                break
            if idle > YIELD_AFTER_S:
                _check(deadline, "receive")
                os.sched_yield()
            continue
        pending = _advance(pending, n)
        last = time.monotonic()
    return pending


def recv_bytes(sock: socket.socket, length: int, deadline: float | None = None) -> bytes:
    """``length`` bytes from ``sock`` as a new bytes object, filled by the kernel directly
    (one copy) in the usual case; a cut-short receive finishes through a bytearray."""
    try:
        first = sock.recv(length, _WAITALL)
    except OSError as exc:
        if exc.errno not in _AGAIN:
            raise
        first = b""
    if len(first) == length:
        return first
    if not first:
        _check(deadline, "receive")
    out = bytearray(length)
    out[: len(first)] = first
    recv_views(sock, [memoryview(out)[len(first):]], deadline)
    return bytes(out)
