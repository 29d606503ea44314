"""Blocking request/reply channel to the master (one frame out, one frame back).

Used by the client (one channel per thread) and by nodes (mount, heartbeat). A broken
connection is reopened once per call; calls are not retried after the request was sent
except for idempotent requests (the caller says which), so a PutStart is never doubled.
"""

from __future__ import annotations

import socket

import msgspec

from kvpool import protocol as P
from kvpool.config import parse_addr
from kvpool.errors import ErrorCode, RpcFailed


class RpcChannel:
    """A blocking connection to ``addr`` ("host:port"); not thread-safe (one per thread)."""

    def __init__(self, addr: str, timeout_s: float = 10.0):
        self.addr = addr
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None

    def connect(self) -> None:
        """Open the connection. Raises RpcFailed when the master is unreachable."""
        try:
            self._sock = socket.create_connection(parse_addr(self.addr), timeout=self.timeout_s)
        except OSError as exc:
            raise RpcFailed(f"cannot reach master at {self.addr}: {exc.strerror or exc}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def call(self, request: msgspec.Struct, idempotent: bool = True):
        """Send ``request``, return the decoded reply Struct.

        Raises RpcFailed when the master is unreachable, the stream breaks (after one
        reconnect for idempotent requests), or the master answers with ErrorResp.
        """
        frame = P.encode_frame(request)
        for attempt in (0, 1):
            if self._sock is None:
                self.connect()
            try:
                self._sock.sendall(frame)
                reply = P.reply_decoder.decode(P.recv_frame(self._sock))
                break
            except (OSError, P.FrameError, msgspec.MsgspecError) as exc:
                self.close()
                if attempt or not idempotent:
                    raise RpcFailed(f"master {self.addr}: {exc}") from None
        if isinstance(reply, P.ErrorResp):
            raise RpcFailed(f"master refused {type(request).__name__}: {reply.message}",
                            _known(reply.code))
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _known(code: int) -> ErrorCode:
    try:
        return ErrorCode(code)
    except ValueError:
        return ErrorCode.RPC_FAIL
