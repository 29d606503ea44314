"""Remote transport: value bytes over TCP to the data server that hosts the segment.

Data-plane exchange (frames from :mod:`kvpool.protocol`)::

    write: DataWriteMany(offsets, lengths) + payloads  ->  DataResp(code, total)
           (DataWrite(offset, length) + payload: the single form, still served)
    read:  DataRead(offsets, lengths)                   ->  DataResp(code, total) + payloads

Payloads leave with one ``sendmsg`` gathering the header and every source memoryview,
and arrive with ``recvmsg_into`` / ``recv_into`` scattering straight into the
destinations (:mod:`kvpool.transfer.iov`): no byte is touched by Python code and there is
no intermediate buffer. Connections are pooled per peer: a batch borrows one, several
threads or the engine's lanes borrow several, so concurrent transfers never interleave
on one socket. A connection that fails or times out is closed, never reused.
Every request carries its grant's mount epoch (``SegmentInfo.epoch``); the data server
refuses a stale one (REPLICA_IS_GONE, see :mod:`kvpool.transfer.epoch`).
A peer that let a request run to its deadline unanswered is not asked again for a while
(:class:`SilentPeers`): a hung node otherwise cost every engine step that wanted its
blocks the client's whole timeout (a trial: 7 s per request, each time).
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time

import msgspec

from kvpool import auth, tcp_connect
from kvpool import protocol as P
from kvpool.config import parse_addr
from kvpool.errors import ErrorCode, RpcFailed, code_name
from kvpool.protocol import SegmentInfo
from kvpool.spin import ReplyWait
from kvpool.transfer.iov import POLL_S, recv_bytes, recv_views, send_views
from kvpool.transfer.request import Cancel, Op, Transport, TransferRequest

SOCKET_BUFFER = 4 << 20  # bytes; larger kernel buffers keep loopback/LAN transfers streaming

LANES = 4  # connections per peer the engine may use in parallel for one large batch


def _local_lanes() -> int:
    """:data:`LANES` to a peer whose address is this network namespace's own (its
    traffic stays on the loopback device): one per two cores this process may run on
    (sender and receiver share them), 1 to 4.

    Measured on the 2-core development VM (`bench store --quick`, 1 MiB values): over
    loopback, batches of 16 and 128 moved 3.5-4.4 GB/s on one lane against 3.0-3.8 on
    four (the threads of several lanes only took turns on the two cores); between two
    network namespaces (a veth pair, as to another host) four lanes moved 2.2-2.7
    against 1.6-2.3 on one, so peers elsewhere keep :data:`LANES`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 2
    return max(1, min(LANES, cores // 2))


LOCAL_LANES = _local_lanes()
_FAILURES = (OSError, P.FrameError, msgspec.MsgspecError)  # OSError covers timeouts and EOF


def _is_local_address(addr: str) -> bool:
    """Whether the host of ``addr`` ("host:port") is an address of this network
    namespace, so that traffic to it never leaves the loopback device: a UDP socket can
    bind to it (nothing is sent). An address another namespace or host holds, or a name
    that does not resolve, is not."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(parse_addr(addr)[0], 0, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((sockaddr[0], 0))
    except (OSError, UnicodeError, ValueError):
        return False
    return True


class NodeRefused(ConnectionAbortedError):
    """The data server answered a request with a non-OK code (``code``); after a write
    refused before its payload (a range out of bounds, a stale epoch) it closes the
    connection; one it could not store (NO_AVAILABLE_HANDLE) it read and dropped."""

    def __init__(self, code: int, what: str):
        self.code = code
        why = (" (no memory for the segment's pages: /dev/shm is full and the node was started "
               "with --prefault no)") if code == ErrorCode.NO_AVAILABLE_HANDLE else ""
        super().__init__(f"the node replied {code_name(code)} to a {what}{why}")


def describe_failure(exc: BaseException) -> str:
    """A short line naming the exception, its errno (symbolic) and message."""
    num = getattr(exc, "errno", None)
    tag = f" [{errno.errorcode.get(num, num)}]" if isinstance(num, int) else ""
    return f"{type(exc).__name__}{tag}: {exc}"


def tune_data_socket(sock: socket.socket) -> None:
    """No Nagle delay for the small reply frames; big send/receive buffers for payloads."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def read_reply(sock: socket.socket, deadline: float | None) -> P.DataResp:
    """One DataResp frame. Raises FrameError, TimeoutError, ConnectionError."""
    header = bytearray(P.HEADER.size)
    recv_views(sock, [memoryview(header)], deadline)
    body = bytearray(P.parse_header(bytes(header)))
    recv_views(sock, [memoryview(body)], deadline)
    return P.data_reply_decoder.decode(body)


def _await_reply(sock: socket.socket, deadline: float, replies: ReplyWait, kind: str) -> P.DataResp:
    """:func:`read_reply` of a request of ``kind`` just sent, polled for first while
    such replies come quickly (:class:`~kvpool.spin.ReplyWait`)."""
    sent_at = time.perf_counter()
    replies.wait(sock, kind, sent_at)
    reply = read_reply(sock, deadline)
    replies.record(kind, sent_at)
    return reply


SILENT_FIRST_S = 1.0  # a peer that timed out is skipped this long, then asked again
SILENT_MAX_S = 30.0  # doubling while it keeps timing out, up to this
SILENT_AFTER_S = 0.5  # only a request given this long counts: a hint's 0.1 s copy may just be unlucky


class SilentPeers:
    """Peers that let a request given at least :data:`SILENT_AFTER_S` seconds reach its
    deadline (:class:`TcpTransport` decides which count): each is skipped (:meth:`check`
    raises TimeoutError at once) for :data:`SILENT_FIRST_S` seconds, doubling up to
    :data:`SILENT_MAX_S` while the requests sent after each skip time out too; one
    answer clears it. So a hung node costs one timeout, then one per skip; a request
    it would have answered late is a miss (the engine computes those tokens), never a
    wrong hit. A peer is an address and the mount epoch of its segment: a node started
    again on the same address (or mounted again after a master restart) mounts under a
    new epoch and is asked at once, not after the old one's skip (up to 30 s of misses).
    ``clock``: seconds, time.monotonic by default. Thread-safe."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._skips: dict[tuple[str, int], tuple[float, float]] = {}  # peer -> (skipped until, that skip's length)
        self._lock = threading.Lock()

    def check(self, addr: str, epoch: int = 0) -> None:
        """Raise TimeoutError while ``addr`` under mount ``epoch`` is skipped."""
        skip = self._skips.get((addr, epoch))
        if skip is not None and self.clock() < skip[0]:
            raise TimeoutError(f"node {addr} let a request time out: not asked for {skip[1]:g} s")

    def timed_out(self, addr: str, epoch: int = 0) -> None:
        """A request to ``addr`` under mount ``epoch`` reached its deadline unanswered:
        skip that peer (longer if it was skipped before)."""
        with self._lock:
            now = self.clock()
            last = self._skips.get((addr, epoch), (0.0, SILENT_FIRST_S / 2))[1]
            length = min(SILENT_MAX_S, 2 * last)
            # forget the peers that cannot come back (an older mount on this address) and
            # those not skipped for a while: the table stays as small as the silent peers
            for peer, (until, _) in list(self._skips.items()):
                if (peer[0] == addr and peer[1] != epoch) or until < now - SILENT_MAX_S:
                    del self._skips[peer]
            self._skips[(addr, epoch)] = (now + length, length)

    def answered(self, addr: str, epoch: int = 0) -> None:
        if (addr, epoch) in self._skips:  # the common case: no lock
            with self._lock:
                self._skips.pop((addr, epoch), None)


class _Pool:
    """Idle connections per peer address; thread-safe."""

    def __init__(self):
        self.idle: dict[str, list[socket.socket]] = {}
        self.lock = threading.Lock()
        self.closed = False

    def take(self, addr: str) -> socket.socket | None:
        with self.lock:
            free = self.idle.get(addr)
            return free.pop() if free else None

    def give(self, addr: str, sock: socket.socket) -> None:
        with self.lock:
            if not self.closed:
                self.idle.setdefault(addr, []).append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            socks = [s for free in self.idle.values() for s in free]
            self.idle.clear()
        for sock in socks:
            sock.close()


class TcpTransport(Transport):
    """Pooled blocking TCP connections to segments' data servers (any host).

    Args: timeout_s bounds connecting (each request's own deadline bounds the rest);
    secret answers the data servers' challenge (:mod:`kvpool.auth`; None:
    ``KVPOOL_SECRET``, b"": none).
    """

    name, rank, lanes = "tcp", 2, LANES

    def __init__(self, timeout_s: float = 10.0, secret: bytes | None = None):
        self.timeout_s = timeout_s
        self.secret = auth.secret_or_env(secret)
        self._pool = _Pool()
        self.local_lanes = LOCAL_LANES
        self._local: dict[str, bool] = {}  # data address -> whether this namespace holds it
        self._replies = ReplyWait()  # polls briefly for a node's quick replies (kvpool.spin)
        self.silent = SilentPeers()

    def can_reach(self, segment: SegmentInfo) -> bool:
        return bool(segment.data_addr)

    def lanes_to(self, segment: SegmentInfo) -> int:
        """``local_lanes`` (:data:`LOCAL_LANES`) to a node at an address of this
        network namespace, else ``lanes`` (:data:`LANES`); decided once per address."""
        local = self._local.get(segment.data_addr)
        if local is None:
            local = self._local[segment.data_addr] = _is_local_address(segment.data_addr)
        return self.local_lanes if local else self.lanes

    def _connect(self, addr: str, deadline: float) -> socket.socket:
        limit = max(0.001, min(self.timeout_s, deadline - time.monotonic()))
        sock = tcp_connect.connect(parse_addr(addr), limit)
        tune_data_socket(sock)
        P.set_kernel_timeouts(sock, POLL_S)
        if self.secret is not None:
            try:
                auth.client_handshake(sock, self.secret, limit, f"node {addr}")
            except RpcFailed:
                sock.close()
                raise ConnectionRefusedError(f"node {addr} refused authentication") from None
        return sock

    def _with_conn(self, segment: SegmentInfo, deadline: float, cancel: Cancel, work):
        """Run ``work(sock)`` on a pooled (else new) connection to ``segment``'s node; a failure on a
        reused connection (the peer may have dropped it while idle) is retried once on a
        fresh one, which is safe because reads and writes of fixed ranges are idempotent
        (not a refusal: the node answered, NodeRefused is raised at once).
        Returns work's result; raises the _FAILURES of the last attempt, or TimeoutError
        at once when ``deadline`` has passed already (a batch's later chunks after a
        node stopped answering: each would otherwise wait a kernel poll, 0.2 s)."""
        addr, epoch = segment.data_addr, segment.epoch
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the deadline passed before a request to {addr} was sent")
        self.silent.check(addr, epoch)
        counts = deadline - time.monotonic() >= SILENT_AFTER_S  # whether its timeout says the peer is silent
        sock = self._pool.take(addr)
        reused = sock is not None
        while True:
            if sock is None:
                try:
                    sock = self._connect(addr, deadline)
                except TimeoutError:  # no answer to the SYN: a host gone or hung
                    if counts:
                        self.silent.timed_out(addr, epoch)
                    raise
            cancel.track(sock)
            try:
                result = work(sock)
            except NodeRefused as exc:  # the node answered: no use asking on another connection
                cancel.untrack(sock)
                if exc.code == ErrorCode.NO_AVAILABLE_HANDLE and not cancel.fired:
                    self._pool.give(addr, sock)  # the node read the payload: still in step
                else:
                    sock.close()
                raise
            except _FAILURES as exc:
                cancel.untrack(sock)
                sock.close()
                if counts and isinstance(exc, TimeoutError) and not cancel.fired and time.monotonic() >= deadline:
                    self.silent.timed_out(addr, epoch)
                if not reused or cancel.fired or time.monotonic() > deadline:
                    raise
                sock, reused = None, False
                continue
            cancel.untrack(sock)
            self.silent.answered(addr, epoch)
            if cancel.fired:
                sock.close()  # it may have been shut down under us
            else:
                self._pool.give(addr, sock)
            return result

    def run(self, requests: list[TransferRequest], deadline: float, cancel: Cancel) -> list[bool]:
        """Writes (one DataWriteMany), then reads (one DataRead), on one connection."""
        writes = [r for r in requests if r.op == Op.WRITE]
        reads = [r for r in requests if r.op == Op.READ]
        segment = requests[0].segment
        addr = segment.data_addr
        try:
            ok_w = self._with_conn(segment, deadline, cancel,
                                   lambda s: _write(s, writes, deadline, self._replies, cancel)) if writes else True
            ok_r = self._with_conn(segment, deadline, cancel, lambda s: _read(s, reads, deadline, cancel, self._replies)) if reads else True
        except _FAILURES as exc:
            cancel.note(f"tcp {addr}: {describe_failure(exc)}")
            return [False] * len(requests)
        return [ok_w if r.op == Op.WRITE else ok_r for r in requests]

    def _read_value(self, segment: SegmentInfo, offset: int, length: int, deadline: float,
                    cancel: Cancel, receive):
        """One DataRead of ``length`` bytes at ``offset``; ``receive(sock)`` takes its
        payload and returns the result. None when refused or failed (noted on ``cancel``)."""
        def work(sock):
            return receive(sock) if _ask_read(sock, segment, [offset], [length], deadline, cancel,
                                              self._replies) else None

        try:
            return self._with_conn(segment, deadline, cancel, work)
        except _FAILURES as exc:
            cancel.note(f"tcp {segment.data_addr}: {describe_failure(exc)}")
            return None

    def read_bytes(self, segment: SegmentInfo, offset: int, length: int, deadline: float,
                   cancel: Cancel | None = None) -> bytes | None:
        """One read into a new bytes object that the kernel fills directly (one copy)."""
        return self._read_value(segment, offset, length, deadline, cancel or Cancel(),
                                lambda sock: recv_bytes(sock, length, deadline))

    def read_into(self, segment: SegmentInfo, offset: int, dst: memoryview, deadline: float,
                  cancel: Cancel | None = None) -> bool:
        """One read received straight into ``dst`` (one copy, no request batch)."""
        def receive(sock) -> bool:
            recv_views(sock, [dst], deadline, poll_s=self._replies.max_s)
            return True

        return self._read_value(segment, offset, len(dst), deadline, cancel or Cancel(), receive) is True

    def close(self) -> None:
        self._pool.close()


def _write(sock: socket.socket, reqs: list[TransferRequest], deadline: float, replies: ReplyWait,
           cancel: Cancel) -> bool:
    head = P.encode_frame(P.DataWriteMany([r.remote_offset for r in reqs], [r.length for r in reqs],
                                          reqs[0].segment.epoch))
    send_views(sock, [head, *(r.local_view() for r in reqs)], deadline)
    cancel.payload_sent()  # the node is still taking it in: what waits on the reply may start
    code = _await_reply(sock, deadline, replies, "write").code
    if code != ErrorCode.OK:
        raise NodeRefused(code, "write")
    return True


def _ask_read(sock: socket.socket, segment: SegmentInfo, offsets: list[int], lengths: list[int],
              deadline: float, cancel: Cancel, replies: ReplyWait) -> bool:
    """Send one DataRead and read the node's answer; True when its payload (the ranges'
    bytes, in order) follows. A refusal comes before any payload, so the connection
    stays in step; it is noted on ``cancel``."""
    send_views(sock, [P.encode_frame(P.DataRead(offsets, lengths, segment.epoch))], deadline)
    code = _await_reply(sock, deadline, replies, "read").code
    if code != ErrorCode.OK:
        cancel.note(f"tcp {segment.data_addr}: {NodeRefused(code, 'read')}")
        return False
    return True


def _read(sock: socket.socket, reqs: list[TransferRequest], deadline: float, cancel: Cancel,
          replies: ReplyWait) -> bool:
    if not _ask_read(sock, reqs[0].segment, [r.remote_offset for r in reqs], [r.length for r in reqs],
                     deadline, cancel, replies):
        return False
    recv_views(sock, [r.local_view() for r in reqs], deadline, poll_s=replies.max_s)
    return True
