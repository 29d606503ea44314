"""The TCP data server of a hosted segment (a node's, or a client's): remote reads and writes of its shared-memory segment.

Protocol in :mod:`kvpool.transfer.tcp`. Every request's offset and length are checked
against the segment before a byte moves. A frame that does not decode, or a write that
is out of bounds (its payload cannot be skipped safely), closes that connection only; an
out-of-bounds read gets an error reply and the connection stays. A peer of another
protocol version gets one DataResp(INVALID_VERSION) in its own framing, then the
connection closes (counted as a bad frame). One thread per
connection, blocking sockets: payloads go straight between socket and segment, scattered
with ``recvmsg_into`` and gathered (reply header included) with ``sendmsg``
(:mod:`kvpool.transfer.iov`).

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
from collections import Counter

import msgspec

from kvpool import protocol as P
from kvpool.errors import ErrorCode
from kvpool.transfer.epoch import MOUNT_WAIT_S, NO_EPOCH, EpochWord
from kvpool.transfer.iov import recv_views, send_views
from kvpool.transfer.tcp import tune_data_socket

log = logging.getLogger("kvpool.data")
ACCEPT_BACKOFF_S = 0.05  # pause after a failed accept (e.g. out of file descriptors)


class DataCounters:
    """Thread-safe counters of one data server (all since start, never decreasing,
    except ``open_connections``).

    requests[op] / bytes[op]: served requests and payload bytes, op "read" or "write";
    errors[kind]: "refused" (a range outside the segment), "stale" (a grant of another
    mount epoch), "bad_frame" (undecodable or
    unframed bytes), "broken" (the peer vanished mid-request), "accept" (a connection
    that could not be accepted or served); connections: accepted.
    """

    def __init__(self):
        self.requests: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.connections = 0
        self.open_connections = 0
        self._lock = threading.Lock()

    def served(self, op: str, nbytes: int) -> None:
        with self._lock:
            self.requests[op] += 1
            self.bytes[op] += nbytes

    def error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] += 1

    def opened(self, delta: int) -> None:
        with self._lock:
            self.open_connections += delta
            self.connections += max(0, delta)

    def snapshot(self) -> dict:
        """A consistent copy: {"requests", "bytes", "errors": {name: n},
        "connections", "open_connections"}."""
        with self._lock:
            return {"requests": dict(self.requests), "bytes": dict(self.bytes), "errors": dict(self.errors),
                    "connections": self.connections, "open_connections": self.open_connections}


class _Closed(Exception):
    """The peer closed the connection cleanly, between two requests."""


class _BadHeader(Exception):
    """A frame header with a bad magic or size: the stream cannot be resynchronised."""


class DataServer:
    """Serves ``segment`` (a writable byte memoryview) on the listening socket ``sock``;
    ``counters`` (:class:`DataCounters`) say what it did; ``word``: the segment's epoch
    word (None: no epochs checked)."""

    def __init__(self, sock: socket.socket, segment: memoryview, word: EpochWord | None = None):
        self.sock = sock
        self.segment = segment
        self.word = word
        self.counters = DataCounters()
        self.stopped = threading.Event()
        self._gate = threading.Condition()
        self._busy: set[socket.socket] = set()  # connections inside an admitted request

    def _admit(self, conn: socket.socket, epoch: int) -> bool:
        """Let a request of ``epoch`` move bytes (False: stale). A request of a new epoch
        that arrives while the node is still mounting waits for the mount (bounded)."""
        with self._gate:
            if self.word is not None and epoch != NO_EPOCH:
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
            self.word.set(NO_EPOCH)
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
        try:
            conn.settimeout(None)
            tune_data_socket(conn)
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()
        except (OSError, RuntimeError) as exc:  # RuntimeError: no thread could be started
            self.counters.error("accept")
            log.warning("cannot serve a data connection: %s", exc)
            conn.close()

    def stop(self) -> None:
        self.stopped.set()

    def _serve_conn(self, conn: socket.socket) -> None:
        self.counters.opened(1)
        try:
            with conn:
                while self._handle(conn):
                    pass
        except _Closed:
            pass
        except _BadHeader:
            self.counters.error("bad_frame")
        except (P.FrameError, OSError):  # EOF inside a frame or a payload, a reset
            self.counters.error("broken")
        finally:
            self.counters.opened(-1)

    def _ranges(self, offsets: list[int], lengths: list[int]) -> list[memoryview] | None:
        """Segment views for the (offset, length) pairs, or None unless all are in bounds."""
        if len(offsets) != len(lengths) or not all(self.in_bounds(o, n) for o, n in zip(offsets, lengths)):
            return None
        return [self.segment[o : o + n] for o, n in zip(offsets, lengths)]

    def _handle(self, conn: socket.socket) -> bool:
        """Serve one request; False when the connection must close."""
        try:
            req = P.data_request_decoder.decode(_recv_request(conn))
        except msgspec.MsgspecError:
            self.counters.error("bad_frame")
            return False
        except P.VersionMismatch as exc:
            self.counters.error("bad_frame")
            log.warning("refused a peer of protocol version %d (this node speaks %d)",
                        exc.version, P.PROTOCOL_VERSION)
            P.recv_exact_into(conn, memoryview(bytearray(exc.length)))
            conn.sendall(P.version_refusal(exc.version, "node", P.DataResp))
            return False
        if isinstance(req, P.DataRead):
            views = self._ranges(req.offsets, req.lengths)
        elif isinstance(req, P.DataWrite):
            views = self._ranges([req.offset], [req.length])
        else:
            views = self._ranges(req.offsets, req.lengths)
        reading = isinstance(req, P.DataRead)
        if views is None:
            return self._refuse(conn, "refused", ErrorCode.INVALID_PARAMS, keep=reading)
        if not self._admit(conn, req.epoch):
            return self._refuse(conn, "stale", ErrorCode.REPLICA_IS_GONE, keep=reading)
        try:
            total = sum(len(v) for v in views)
            if reading:
                send_views(conn, [P.encode_frame(P.DataResp(ErrorCode.OK, total)), *views])
            else:
                recv_views(conn, views)
        finally:
            self._leave(conn)
        self.counters.served("read" if reading else "write", total)
        if not reading:
            conn.sendall(P.encode_frame(P.DataResp(ErrorCode.OK, total)))
        return True

    def _refuse(self, conn: socket.socket, kind: str, code: ErrorCode, keep: bool) -> bool:
        """Answer ``code``; a refused write closes (its payload cannot be skipped)."""
        self.counters.error(kind)
        conn.sendall(P.encode_frame(P.DataResp(code)))
        return keep


def _recv_request(conn: socket.socket) -> bytearray:
    """One request frame's body. Raises _Closed when the peer closed before a new frame
    began, VersionMismatch, _BadHeader, FrameError (EOF mid-frame), OSError."""
    header = bytearray(P.HEADER.size)
    got = conn.recv_into(header, len(header), socket.MSG_WAITALL)
    if got == 0:
        raise _Closed()
    if got < len(header):
        P.recv_exact_into(conn, memoryview(header)[got:])
    try:
        length = P.parse_header(bytes(header))
    except P.VersionMismatch:
        raise
    except P.FrameError:
        raise _BadHeader() from None
    body = bytearray(length)
    P.recv_exact_into(conn, memoryview(body))
    return body
