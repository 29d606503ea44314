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

:class:`DataCounters` counts what the server did (requests, bytes, errors by kind); the
node's admin app exposes them.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections import Counter

import msgspec

from kvpool import protocol as P
from kvpool.errors import ErrorCode
from kvpool.transfer.iov import recv_views, send_views
from kvpool.transfer.tcp import tune_data_socket

log = logging.getLogger("kvpool.data")
ACCEPT_BACKOFF_S = 0.05  # pause after a failed accept (e.g. out of file descriptors)


class DataCounters:
    """Thread-safe counters of one data server (all since start, never decreasing,
    except ``open_connections``).

    requests[op] / bytes[op]: served requests and payload bytes, op "read" or "write";
    errors[kind]: "refused" (a range outside the segment), "bad_frame" (undecodable or
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
    ``counters`` (:class:`DataCounters`) say what it did."""

    def __init__(self, sock: socket.socket, segment: memoryview):
        self.sock = sock
        self.segment = segment
        self.counters = DataCounters()
        self.stopped = threading.Event()

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
            return self._read(conn, req)
        if isinstance(req, P.DataWrite):
            views = self._ranges([req.offset], [req.length])
        else:
            views = self._ranges(req.offsets, req.lengths)
        if views is None:
            self.counters.error("refused")
            conn.sendall(P.encode_frame(P.DataResp(ErrorCode.INVALID_PARAMS)))
            return False
        recv_views(conn, views)
        total = sum(len(v) for v in views)
        self.counters.served("write", total)
        conn.sendall(P.encode_frame(P.DataResp(ErrorCode.OK, total)))
        return True

    def _read(self, conn: socket.socket, req: P.DataRead) -> bool:
        views = self._ranges(req.offsets, req.lengths)
        if views is None:
            self.counters.error("refused")
            conn.sendall(P.encode_frame(P.DataResp(ErrorCode.INVALID_PARAMS)))
            return True
        total = sum(req.lengths)
        send_views(conn, [P.encode_frame(P.DataResp(ErrorCode.OK, total)), *views])
        self.counters.served("read", total)
        return True


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
