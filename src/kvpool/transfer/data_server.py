"""The TCP data server of a hosted segment (a node's, or a client's): remote reads and writes of its shared-memory segment.

Protocol in :mod:`kvpool.transfer.tcp`. Every request's offset and length are checked
against the segment before a byte moves. A frame that does not decode, or a write that
is out of bounds (its payload cannot be skipped safely), closes that connection only; an
out-of-bounds read gets an error reply and the connection stays. One thread per
connection, blocking sockets: payloads go straight between socket and segment, scattered
with ``recvmsg_into`` and gathered (reply header included) with ``sendmsg``
(:mod:`kvpool.transfer.iov`).
"""

from __future__ import annotations

import socket
import threading

import msgspec

from kvpool import protocol as P
from kvpool.errors import ErrorCode
from kvpool.transfer.iov import recv_views, send_views
from kvpool.transfer.tcp import tune_data_socket


class DataServer:
    """Serves ``segment`` (a writable byte memoryview) on the listening socket ``sock``."""

    def __init__(self, sock: socket.socket, segment: memoryview):
        self.sock = sock
        self.segment = segment
        self.stopped = threading.Event()

    def in_bounds(self, offset: int, length: int) -> bool:
        return 0 <= offset and 0 <= length and offset + length <= len(self.segment)

    def serve_forever(self) -> None:
        """Accept connections until :meth:`stop`; each gets a daemon thread."""
        self.sock.settimeout(0.2)  # wake up to notice stop()
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.stopped.is_set():
                    break
                raise
            conn.settimeout(None)
            tune_data_socket(conn)
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()

    def stop(self) -> None:
        self.stopped.set()

    def _serve_conn(self, conn: socket.socket) -> None:
        with conn:
            try:
                while self._handle(conn):
                    pass
            except (OSError, P.FrameError):
                pass  # the peer left or broke framing (OSError covers EOF): this connection only

    def _ranges(self, offsets: list[int], lengths: list[int]) -> list[memoryview] | None:
        """Segment views for the (offset, length) pairs, or None unless all are in bounds."""
        if len(offsets) != len(lengths) or not all(self.in_bounds(o, n) for o, n in zip(offsets, lengths)):
            return None
        return [self.segment[o : o + n] for o, n in zip(offsets, lengths)]

    def _handle(self, conn: socket.socket) -> bool:
        """Serve one request; False when the connection must close."""
        try:
            req = P.data_request_decoder.decode(P.recv_frame(conn))
        except msgspec.MsgspecError:
            return False
        if isinstance(req, P.DataRead):
            views = self._ranges(req.offsets, req.lengths)
            if views is None:
                conn.sendall(P.encode_frame(P.DataResp(ErrorCode.INVALID_PARAMS)))
                return True
            total = sum(req.lengths)
            send_views(conn, [P.encode_frame(P.DataResp(ErrorCode.OK, total)), *views])
            return True
        if isinstance(req, P.DataWrite):
            views = self._ranges([req.offset], [req.length])
        else:
            views = self._ranges(req.offsets, req.lengths)
        if views is None:
            conn.sendall(P.encode_frame(P.DataResp(ErrorCode.INVALID_PARAMS)))
            return False
        recv_views(conn, views)
        conn.sendall(P.encode_frame(P.DataResp(ErrorCode.OK, sum(len(v) for v in views))))
        return True
