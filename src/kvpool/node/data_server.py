"""The TCP data server of a hosted segment (a node's, or a client's): remote reads and writes of its shared-memory segment.

Protocol in :mod:`kvpool.transfer.tcp`. Every request's offset and length are checked
against the segment before a byte moves. A frame that does not decode, or a write that
is out of bounds (its payload cannot be skipped safely), closes that connection only; an
out-of-bounds read gets an error reply and the connection stays. A peer of another
protocol version gets one DataResp(INVALID_VERSION) in its own framing, then the
connection closes (counted as a bad frame).

What a connection may cost (K22): a request frame's body is read in chunks of
:data:`BODY_CHUNK` as its bytes arrive, so a header announcing a huge body costs only
what was really sent; a connection that stops sending mid-frame (header, body or write
payload) or stops reading a reply for ``stall_s`` seconds is closed (counted as
"stalled"). Between frames a connection may stay idle for as long as it likes, but at most
``max_connections`` (:data:`MAX_CONNECTIONS`) are served at once: a connection past them
closes the longest idle one, one still owing the ``secret`` challenge's answer first (its
client's next request on it fails and is retried on a new connection, as for any pooled
connection the peer dropped), or is closed itself when every
one is inside a request (counted as "full"). One thread per connection, blocking sockets: payloads go straight between socket and segment, scattered
with ``recvmsg_into`` and gathered (reply header included) with ``sendmsg``
(:mod:`kvpool.transfer.iov`).

Busy polling (:class:`~kvpool.spin.RequestGaps`, the master's policy too): after it
answers a read, a connection whose next requests have followed such answers within
``busy_poll_s`` (on average) polls its socket for up to twice that mean before it
blocks. Why: a thread blocked in recv on a halted vCPU is woken by an inter-processor
interrupt through the hypervisor; on the 2-vCPU VM of docs/bench.md a bare 1 MiB
request and reply over loopback took 339 us with both sides blocking, 246 us with the
client polling and 195 us with both polling. In
``bench store --quick`` (means of four runs each way) single 1 MiB gets over TCP moved
1.76 -> 1.85 GB/s (zero copy) and 1.82 -> 1.93 (bytes), 16 x 1 MiB batch gets 3.00 ->
3.17. Not after a write: the writer's next step is its commit to the master, and
polling then only took a core from the client and the master (a poll after every
answer: 128 x 1 MiB batch puts 3.34 -> 2.99 GB/s).
A connection whose client pauses longer (the mean above ``busy_poll_s``) never polls.

Mount epochs (:mod:`kvpool.transfer.epoch`): a request carries its grant's epoch and is
served only while it is the segment's (else REPLICA_IS_GONE: a read's connection
stays, a write's closes); :meth:`DataServer.fence` ends the old epoch before the node
mounts again: requests in flight are cut (their sockets shut) and waited for.

:class:`DataCounters` counts what the server did (requests, bytes, errors by kind); the
node's admin app exposes them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from collections import Counter

import msgspec

from kvpool import auth
from kvpool import protocol as P
from kvpool.config import raise_open_files
from kvpool.errors import ErrorCode
from kvpool.spin import BUSY_POLL_US, RequestGaps, spin_max_s
from kvpool.throttle import Throttle
from kvpool.transfer.epoch import MOUNT_WAIT_S, NO_EPOCH, EpochWord
from kvpool.transfer.iov import recv_views, send_views
from kvpool.transfer.shm import populate_ranges
from kvpool.transfer.tcp import tune_data_socket

log = logging.getLogger("kvpool.data")
MAX_CONNECTIONS = 1024  # data connections (one thread each, ~100 KiB resident) served at once
FULL_LOG_S = 60.0  # seconds between two log lines about a full data port
FILES_RESERVED = 64  # descriptors a node keeps besides data connections (segment, master channels, logs, HTTP)
ACCEPT_BACKOFF_S = 0.05  # pause after a failed accept (e.g. out of file descriptors)
STALL_S = 30.0  # seconds a peer may pause mid-frame before its connection is closed
BODY_CHUNK = 64 << 10  # bytes of a request body allocated ahead of their arrival
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK)
_DRAIN_PIECE = 1 << 20  # scratch bytes for the payload of a write that is refused


def _has_input(conn: socket.socket) -> bool:
    """True when bytes from the peer wait in ``conn`` (peeked, never consumed or waited for)."""
    try:
        return bool(conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # BlockingIOError: nothing waits; others: a broken connection
        return False


def _within_open_files(max_connections: int) -> int:
    """``max_connections``, or fewer when the open-file limit cannot be raised to hold them
    (a soft limit of 1024 is common): past the limit accept() fails with EMFILE and no
    idle connection is ever closed to make room (said once, at start)."""
    limit = raise_open_files(max_connections + FILES_RESERVED)
    if limit >= max_connections + FILES_RESERVED:
        return max_connections
    fitted = max(1, limit - FILES_RESERVED)
    log.warning("the open-file limit is %d (ulimit -n): serving at most %d data connections, "
                "not %d (--max-connections)", limit, fitted, max_connections)
    return fitted


class DataCounters:
    """Thread-safe counters of one data server (all since start, never decreasing,
    except ``open_connections``).

    requests[op] / bytes[op]: served requests and payload bytes, op "read" or "write";
    errors[kind]: "refused" (a range outside the segment), "stale" (a grant of another
    mount epoch), "no_memory" (a write into pages that could not be allocated: /dev/shm
    full under a segment not prefaulted), "bad_frame" (undecodable or
    unframed bytes), "auth" (a wrong answer to the challenge), "broken" (the peer
    vanished mid-request), "stalled" (the peer
    paused mid-frame for longer than the server's ``stall_s``), "accept" (a connection
    that could not be accepted or served), "full" (a connection closed at once: the
    server held ``max_connections``, each inside a request), "idle_closed" (an idle
    connection closed to make room for a new one); connections: accepted.
    """

    def __init__(self):
        self.requests: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.connections = 0
        self.open_connections = 0
        self.polled = 0  # requests found waiting by the busy poll after a read's answer
        self._lock = threading.Lock()

    def served(self, op: str, nbytes: int) -> None:
        with self._lock:
            self.requests[op] += 1
            self.bytes[op] += nbytes

    def error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] += 1

    def caught_polling(self) -> None:
        with self._lock:
            self.polled += 1

    def opened(self, delta: int) -> None:
        with self._lock:
            self.open_connections += delta
            self.connections += max(0, delta)

    def snapshot(self) -> dict:
        """A consistent copy: {"requests", "bytes", "errors": {name: n},
        "connections", "open_connections", "polled"}."""
        with self._lock:
            return {"requests": dict(self.requests), "bytes": dict(self.bytes), "errors": dict(self.errors),
                    "connections": self.connections, "open_connections": self.open_connections,
                    "polled": self.polled}


class _Closed(Exception):
    """The peer closed the connection cleanly, between two requests."""


class _BadHeader(Exception):
    """A frame header with a bad magic or size: the stream cannot be resynchronised."""


class DataServer:
    """Serves ``segment`` (a writable byte memoryview) on the listening socket ``sock``;
    ``counters`` (:class:`DataCounters`) say what it did; ``word``: the segment's epoch
    word (None: no epochs checked); ``stall_s``: seconds a peer
    may pause mid-frame (see the module docstring); ``secret``: connections must first
    answer a challenge (:mod:`kvpool.auth`), else they are closed (counted as "auth");
    ``populate(offset, length) -> bool``: run before a write is received (a segment not
    prefaulted: :meth:`kvpool.transfer.shm.Populator.populate`); a write it refuses is
    read into a scratch buffer and answered NO_AVAILABLE_HANDLE (counted as "no_memory");
    ``max_connections``: connections served at once (see the module docstring);
    ``busy_poll_s``: the longest poll of a connection for its next request after it
    answered a read (see the module docstring; 0: never poll), seconds; ``clock``: seconds for
    that poll's gaps, time.perf_counter by default."""

    def __init__(self, sock: socket.socket, segment: memoryview, word: EpochWord | None = None,
                 stall_s: float = STALL_S, secret: bytes | None = None, populate=None,
                 max_connections: int = MAX_CONNECTIONS, busy_poll_s: float = BUSY_POLL_US / 1e6,
                 clock=time.perf_counter):
        self.sock = sock
        self.segment = segment
        self.word = word
        self.populate = populate
        self.stall_s = stall_s
        self.secret = secret  # set: every connection answers a challenge first (kvpool.auth)
        self.poll_s = spin_max_s()  # a write's payload is polled for this long between bursts
        self.busy_poll_s = busy_poll_s
        self.clock = clock
        self.counters = DataCounters()
        self.stopped = threading.Event()
        self._gate = threading.Condition()
        self._busy: set[socket.socket] = set()  # connections inside an admitted request
        self.max_connections = _within_open_files(max_connections)
        self._idle_since: dict[socket.socket, float | None] = {}  # open -> idle since (None: in a request)
        self._unproven: set[socket.socket] = set()  # open, not yet past the --secret challenge
        self._conns_lock = threading.Lock()
        self._full_log = Throttle(FULL_LOG_S)  # under a flood of connections: a line a minute

    def _admit(self, conn: socket.socket, epoch: int) -> bool:
        """Let a request of ``epoch`` move bytes (False: stale). A request of a new epoch
        that arrives while the node is still mounting waits for the mount (bounded)."""
        with self._gate:
            if self.word is not None and epoch != NO_EPOCH:
                if self.word.mounting(epoch):
                    self._gate.wait_for(lambda: self.word.read() != NO_EPOCH, MOUNT_WAIT_S)
                if self.word.read() != epoch:
                    return False
            self._busy.add(conn)
            return True

    def _leave(self, conn: socket.socket) -> None:
        with self._gate:
            self._busy.discard(conn)
            self._gate.notify_all()

    def fence(self, timeout_s: float) -> bool:
        """End the current epoch: no request is admitted until :meth:`open_epoch`, and
        those in flight are cut and waited for (at most ``timeout_s``). True when none
        is left."""
        with self._gate:
            self.word.close_epoch()
            for conn in self._busy:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            return self._gate.wait_for(lambda: not self._busy, timeout_s)

    def open_epoch(self, epoch: int) -> None:
        """Serve grants of ``epoch`` (the mount just made)."""
        with self._gate:
            self.word.set(epoch)
            self._gate.notify_all()

    def in_bounds(self, offset: int, length: int) -> bool:
        return 0 <= offset and 0 <= length and offset + length <= len(self.segment)

    def serve_forever(self) -> None:
        """Accept connections until :meth:`stop`; each gets a daemon thread.

        A failed accept (out of file descriptors, a connection reset in the backlog) or
        a thread that cannot start costs that one connection, never the loop: a dead
        accept loop would leave every new client hanging in the backlog until its
        timeout while pooled connections kept working."""
        self.sock.settimeout(0.2)  # wake up to notice stop()
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self.stopped.is_set() or exc.errno == errno.EBADF:
                    break
                self.counters.error("accept")
                log.warning("accept on the data port failed: %s", exc)
                self.stopped.wait(ACCEPT_BACKOFF_S)
                continue
            self._start_conn(conn)

    def _start_conn(self, conn: socket.socket) -> None:
        if not self._make_room(conn):
            self.counters.error("full")
            refused = self._full_log.due()
            if refused:
                log.warning("data port: %d connections open, each inside a request: closing new "
                            "ones (--max-connections); %d closed since the last such line",
                            self.max_connections, refused)
            conn.close()
            return
        try:
            P.set_kernel_timeouts(conn, self.stall_s)  # blocking calls wake to check for a stall
            tune_data_socket(conn)
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()
        except (OSError, RuntimeError) as exc:  # RuntimeError: no thread could be started
            self.counters.error("accept")
            log.warning("cannot serve a data connection: %s", exc)
            self._forget(conn)
            conn.close()

    def _make_room(self, conn: socket.socket) -> bool:
        """Count ``conn`` as open (idle); with ``max_connections`` open already, first
        close one that is idle: the oldest of those still owing the ``secret`` challenge's
        answer, else the one idle longest (so a flood of connections that cannot
        authenticate closes each other, not the pooled connections of clients), and never
        one whose next request waits unread. False when none is idle: ``conn`` is not
        counted."""
        with self._conns_lock:
            if len(self._idle_since) >= self.max_connections:
                idle = sorted((c not in self._unproven, since, id(c), c)
                              for c, since in self._idle_since.items() if since is not None)
                # one whose request has just arrived is not idle (its thread has not read it yet)
                victim = next((row[3] for row in idle if not _has_input(row[3])), None)
                if victim is None:
                    return False
                del self._idle_since[victim]
                self._unproven.discard(victim)
                with contextlib.suppress(OSError):
                    victim.shutdown(socket.SHUT_RDWR)  # its thread's recv returns EOF: it ends
                self.counters.error("idle_closed")
            self._idle_since[conn] = time.monotonic()
            if self.secret is not None:
                self._unproven.add(conn)
            return True

    def _mark(self, conn: socket.socket, idle: bool) -> None:
        """``conn`` waits for a request (``idle``) or is inside one; a connection closed
        to make room stays forgotten."""
        with self._conns_lock:
            if conn in self._idle_since:
                self._idle_since[conn] = time.monotonic() if idle else None
                self._unproven.discard(conn)  # marked only once past the challenge

    def _forget(self, conn: socket.socket) -> None:
        with self._conns_lock:
            self._idle_since.pop(conn, None)
            self._unproven.discard(conn)

    def stop(self) -> None:
        self.stopped.set()

    def _serve_conn(self, conn: socket.socket) -> None:
        self.counters.opened(1)
        try:
            with conn:
                if not self._authenticated(conn):
                    self.counters.error("auth")
                    return
                gaps = RequestGaps(self.busy_poll_s, self.clock)  # answer -> next request, this connection
                while True:
                    self._mark(conn, idle=True)
                    caught = gaps.poll(conn)  # True for a peer's close too: then _handle raises _Closed
                    if not self._handle(conn, gaps):
                        break
                    if caught:
                        self.counters.caught_polling()
        except _Closed:
            pass
        except _BadHeader:
            self.counters.error("bad_frame")
        except TimeoutError:
            self.counters.error("stalled")
        except (P.FrameError, OSError):  # EOF inside a frame or a payload, a reset
            self.counters.error("broken")
        finally:
            self._forget(conn)
            self.counters.opened(-1)

    def _authenticated(self, conn: socket.socket) -> bool:
        if self.secret is None:
            return True
        hello, nonce = auth.challenge()
        send_views(conn, [hello], stall_s=self.stall_s)
        reply = bytearray(auth.ANSWER_BYTES)
        recv_views(conn, [memoryview(reply)], stall_s=self.stall_s)
        return auth.verify(self.secret, nonce, reply)

    def _ranges(self, offsets: list[int], lengths: list[int]) -> list[memoryview] | None:
        """Segment views for the (offset, length) pairs, or None unless all are in bounds."""
        if len(offsets) != len(lengths) or not all(self.in_bounds(o, n) for o, n in zip(offsets, lengths)):
            return None
        return [self.segment[o : o + n] for o, n in zip(offsets, lengths)]

    def _handle(self, conn: socket.socket, gaps: RequestGaps) -> bool:
        """Serve one request (its arrival, and a read's answer, told to ``gaps``); False
        when the connection must close."""
        try:
            req = P.data_request_decoder.decode(self._recv_request(conn, gaps))
        except msgspec.MsgspecError:
            self.counters.error("bad_frame")
            return False
        except P.VersionMismatch as exc:
            self.counters.error("bad_frame")
            log.warning("refused a peer of protocol version %d (this node speaks %d)",
                        exc.version, P.PROTOCOL_VERSION)
            self._recv_body(conn, exc.length)
            send_views(conn, [P.version_refusal(exc.version, "node", P.DataResp)], stall_s=self.stall_s)
            return False
        if isinstance(req, P.DataRead):
            return self._read(conn, req, gaps)
        if isinstance(req, P.DataWrite):
            views = self._ranges([req.offset], [req.length])
        else:
            views = self._ranges(req.offsets, req.lengths)
        if views is None:
            return self._refuse(conn, "refused", ErrorCode.INVALID_PARAMS, keep=False)
        if not self._admit(conn, req.epoch):
            return self._refuse(conn, "stale", ErrorCode.REPLICA_IS_GONE, keep=False)
        if self.populate is not None and not populate_ranges(self.populate, list(zip(_offsets(req), views))):
            self._leave(conn)
            # the kernel's copy into an unallocated page fails mid-payload: take the
            # payload elsewhere, so that the connection stays usable and the writer is told
            self._drain(conn, sum(len(v) for v in views))
            return self._refuse(conn, "no_memory", ErrorCode.NO_AVAILABLE_HANDLE, keep=True)
        try:  # polled while the payload keeps coming (kvpool.transfer.iov._poll_into)
            recv_views(conn, views, stall_s=self.stall_s, poll_s=self.poll_s)
        finally:
            self._leave(conn)
        total = sum(len(v) for v in views)
        self.counters.served("write", total)
        self._reply(conn, [P.encode_frame(P.DataResp(ErrorCode.OK, total))])
        return True

    def _drain(self, conn: socket.socket, length: int) -> None:
        """Receive and drop ``length`` bytes of payload (in pieces of at most 1 MiB)."""
        scratch = memoryview(bytearray(min(length, _DRAIN_PIECE)))
        while length:
            piece = min(length, len(scratch))
            recv_views(conn, [scratch[:piece]], stall_s=self.stall_s)
            length -= piece

    def _refuse(self, conn: socket.socket, kind: str, code: ErrorCode, keep: bool) -> bool:
        """Answer ``code``; a refused write closes (its payload cannot be skipped)."""
        self.counters.error(kind)
        self._reply(conn, [P.encode_frame(P.DataResp(code))])
        return keep

    def _reply(self, conn: socket.socket, views: list) -> None:
        send_views(conn, views, stall_s=self.stall_s)

    def _read(self, conn: socket.socket, req: P.DataRead, gaps: RequestGaps) -> bool:
        views = self._ranges(req.offsets, req.lengths)
        if views is None:
            return self._refuse(conn, "refused", ErrorCode.INVALID_PARAMS, keep=True)
        if not self._admit(conn, req.epoch):
            return self._refuse(conn, "stale", ErrorCode.REPLICA_IS_GONE, keep=True)
        total = sum(req.lengths)
        try:
            self._reply(conn, [P.encode_frame(P.DataResp(ErrorCode.OK, total)), *views])
        finally:
            self._leave(conn)
        gaps.answered()  # polled for next: a reader's next request comes soon, a writer's after its commit
        self.counters.served("read", total)
        return True

    def _recv_request(self, conn: socket.socket, gaps: RequestGaps) -> bytes | bytearray:
        """One request frame's body (its first byte's arrival told to ``gaps``). Waits as
        long as need be for a frame to begin, then at most ``stall_s`` between bytes.
        Raises _Closed when the peer closed before a new frame began, VersionMismatch,
        _BadHeader, TimeoutError (a stall), FrameError, ConnectionError (EOF mid-frame),
        OSError."""
        header = bytearray(P.HEADER.size)
        got = _recv_first(conn, header, self.stopped)
        gaps.request()
        self._mark(conn, idle=False)
        if got < len(header):
            recv_views(conn, [memoryview(header)[got:]], stall_s=self.stall_s)
        try:
            length = P.parse_header(bytes(header))
        except P.VersionMismatch:
            raise
        except P.FrameError:
            raise _BadHeader() from None
        return self._recv_body(conn, length)

    def _recv_body(self, conn: socket.socket, length: int) -> bytes | bytearray:
        """``length`` bytes, allocated :data:`BODY_CHUNK` at a time as they arrive (K22)."""
        parts = []
        while length > 0:
            part = bytearray(min(length, BODY_CHUNK))
            recv_views(conn, [memoryview(part)], stall_s=self.stall_s)
            parts.append(part)
            length -= len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)


def _offsets(req) -> list[int]:
    """The segment offsets a DataWrite or DataWriteMany writes to."""
    return [req.offset] if isinstance(req, P.DataWrite) else req.offsets


def _recv_first(conn: socket.socket, header: bytearray, stopped: threading.Event) -> int:
    """Bytes of a new frame's header received (at least 1): an idle connection is
    allowed, so a kernel timeout before the first byte just waits on. Raises _Closed on
    a clean EOF, OSError."""
    while not stopped.is_set():
        try:
            got = conn.recv_into(header, len(header), socket.MSG_WAITALL)
        except OSError as exc:
            if exc.errno not in _AGAIN:
                raise
            continue
        if got == 0:
            raise _Closed()
        return got
    raise _Closed()
