"""The control channel to the master: blocking request/reply (one frame out, one frame
back) over the messages of :mod:`kvpool.protocol`.

Used by the client (one channel per thread), by nodes and client-hosted segments (mount,
heartbeat) and by the node's admin app (a stats scrape), so it sits at the protocol's
level, below all of them. A broken
connection is reopened once per call; calls are not retried after the request was sent
except for idempotent requests (the caller says which), so a PutStart is never doubled.

Several masters (a list, or etcd naming the leader: :mod:`kvpool.masters`): the channel
connects to the first candidate that answers, and a request a standby refused
(UNAVAILABLE_IN_CURRENT_STATUS: it applied nothing) or one that never reached a master
is tried on the next candidate until ``failover_s`` has passed, so callers follow a
change of leader without a restart. A request whose connection broke after it was sent
is retried only when idempotent; otherwise it fails with RpcFailed (retryable: the
master that took it either applied it whole or not at all, and a new leader knows only
what the nodes' indexes say was committed).
:meth:`RpcChannel.notify` sends a notification (ReadDone), which gets no reply.

When the master refuses a request (:class:`~kvpool.protocol.ErrorResp`: a body it could
not decode, a handler failure, another protocol version), the refusal is raised as
RpcFailed with the master's message and also logged (logger ``kvpool.rpc``, WARNING, once
per distinct message per process), so callers that only see an error code, such as the
Mooncake facade's -600, still leave the reason where a user looks.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Sequence

import msgspec

from kvpool import auth
from kvpool import protocol as P
from kvpool.config import parse_addr
from kvpool.errors import ErrorCode, RpcFailed, code_of
from kvpool.masters import MasterAddrs

log = logging.getLogger("kvpool.rpc")
_MAX_LOGGED = 1024  # distinct refusal messages remembered (then every one is logged)
_logged: set[str] = set()
_logged_lock = threading.Lock()
NOT_LEADER = ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS  # a standby's (or fenced leader's) refusal
RETRY_S = 0.05  # pause between rounds over the candidates during a change of leader


def _log_once(message: str) -> None:
    """Log ``message`` at WARNING the first time this process sees it."""
    with _logged_lock:
        if message in _logged:
            return
        if len(_logged) < _MAX_LOGGED:
            _logged.add(message)
    log.warning("%s", message)


class RpcChannel:
    """A blocking connection to the master of ``addr`` (a master spec: "host:port", a
    list "h1:p1,h2:p2" or "etcd://h:2379[/key]", see :mod:`kvpool.masters`); not
    thread-safe (one per thread). ``secret``: answer the master's challenge with it
    (:mod:`kvpool.auth`; None: ``KVPOOL_SECRET``, b"": none). ``failover_s``: how long
    a call keeps looking for a leader among several masters (default ``timeout_s``).
    ``addr`` is the address connected to (the spec until the first connection)."""

    def __init__(self, addr: str, timeout_s: float = 10.0, secret: bytes | None = None,
                 failover_s: float | None = None):
        self.masters = MasterAddrs(addr)
        self.addr = addr
        self.timeout_s = timeout_s
        self.failover_s = timeout_s if failover_s is None else failover_s
        self.secret = auth.secret_or_env(secret)
        self._sock: socket.socket | None = None
        self._reader = None  # buffered reader of :meth:`receive`
        self._answered = False  # the master has answered on this connection

    def connect(self) -> None:
        """Open the connection to the first candidate master that accepts it. Raises
        RpcFailed when none is reachable."""
        errors = []
        for addr in self.masters.candidates():
            try:
                self._open(addr)
                return
            except RpcFailed as exc:
                if exc.code == ErrorCode.INVALID_VERSION or not self.masters.ha:
                    raise
                self.masters.failed(addr)
                errors.append(str(exc))
        raise RpcFailed("; ".join(errors) or f"no master leads {self.masters.spec} now")

    def _open(self, addr: str) -> None:
        try:
            self._sock = socket.create_connection(parse_addr(addr), timeout=self.timeout_s)
        except OSError as exc:
            raise RpcFailed(f"cannot reach master at {addr}: {exc.strerror or exc}") from None
        self.addr = addr
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.secret is not None:
            try:
                auth.client_handshake(self._sock, self.secret, self.timeout_s, f"master {self.addr}")
            except RpcFailed:
                self.close()
                raise
        self._answered = False

    def call(self, request: msgspec.Struct, idempotent: bool = True, notices: Sequence[msgspec.Struct] = ()):
        """Send ``request``, return the decoded reply Struct. ``notices``
        (notifications such as ReadDone, never answered) go first, in the same write.

        Raises RpcFailed when the master is unreachable, the stream breaks (after one
        reconnect for idempotent requests), the master speaks another protocol version
        (code INVALID_VERSION), or the master answers with ErrorResp (also logged once).
        With several masters, unreachable masters and standbys are passed over until
        ``failover_s`` has passed (then RpcFailed, code UNAVAILABLE_IN_CURRENT_STATUS
        when a standby was the last to answer).
        """
        frame = b"".join([*(P.encode_frame(n) for n in notices), P.encode_frame(request)])
        deadline = time.monotonic() + (self.failover_s if self.masters.ha else 0.0)
        broke = False
        while True:
            try:
                reply = self._round_trip(frame, broke, idempotent)
            except _Undelivered as exc:
                if time.monotonic() >= deadline:
                    raise exc.error from None
                time.sleep(RETRY_S)
                continue
            except _Broken as exc:
                broke = True
                if not idempotent or (time.monotonic() >= deadline and exc.second):
                    raise exc.error from None
                continue
            if isinstance(reply, P.ErrorResp):
                if reply.code == NOT_LEADER and self.masters.ha:
                    self.masters.failed(self.addr)
                    self.close()
                    if time.monotonic() < deadline:
                        time.sleep(RETRY_S)
                        continue
                raise self._refused(request, reply)
            self.masters.answered(self.addr)
            return reply

    def _round_trip(self, frame: bytes, broke: bool, idempotent: bool):
        """One send and receive; raises _Undelivered (no master took the request) or
        _Broken (the connection failed after the request may have been sent)."""
        if self._sock is None:
            try:
                self.connect()
            except RpcFailed as exc:
                if exc.code == ErrorCode.INVALID_VERSION:
                    raise
                raise _Undelivered(exc) from None
        try:
            self._sock.sendall(frame)
            reply = P.reply_decoder.decode(P.recv_frame(self._sock))
            self._answered = True
            return reply
        except P.VersionMismatch as exc:
            self.close()
            raise RpcFailed(f"master {self.addr}: protocol version {P.PROTOCOL_VERSION}, "
                            f"master speaks {exc.version}", ErrorCode.INVALID_VERSION) from None
        except (OSError, P.FrameError, msgspec.MsgspecError) as exc:
            first = not self._answered
            self.masters.failed(self.addr)
            self.close()
            hint = (" (the master closed the connection at the first request: it may run "
                    f"another kvpool release than protocol version {P.PROTOCOL_VERSION})"
                    if first and isinstance(exc, P.FrameError) and not self.masters.ha else "")
            if auth.asks_for_secret(exc):
                hint = " (the master asks for a shared secret: set KVPOOL_SECRET)"
            if not idempotent and self.masters.ha:
                hint += " (the master may have applied it whole, or not at all: check, then retry)"
            raise _Broken(RpcFailed(f"master {self.addr}: {exc}{hint}"), broke) from None

    def notify(self, request: msgspec.Struct) -> bool:
        """Send a notification (a request the master never answers, e.g. ReadDone) without
        waiting. Returns False, raising nothing, when it could not be sent (the
        connection is then closed; the next call reconnects)."""
        try:
            if self._sock is None:
                self.connect()
            self._sock.sendall(P.encode_frame(request))
        except (OSError, RpcFailed):
            self.close()
            return False
        return True

    def receive(self) -> msgspec.Struct:
        """The next frame the master sends unasked (an IndexUpdate on a node's index
        stream), waiting as long as it takes; from the first call on, the connection is
        read through a buffer (frames that queued up cost one system call) and serves
        no more calls. Raises RpcFailed when the connection is gone or was
        :meth:`shutdown`."""
        if self._sock is None:
            raise RpcFailed(f"master {self.addr}: not connected")
        try:
            if self._reader is None:
                self._sock.settimeout(None)
                self._reader = self._sock.makefile("rb", buffering=1 << 16)
            header = self._reader.read(P.HEADER.size)
            if len(header) < P.HEADER.size:
                raise P.FrameError("connection closed")
            length = P.parse_header(header)
            body = self._reader.read(length)
            if len(body) < length:
                raise P.FrameError("connection closed mid-frame")
            return P.reply_decoder.decode(body)
        except (OSError, ValueError, P.FrameError, msgspec.MsgspecError) as exc:
            self.close()
            raise RpcFailed(f"master {self.addr}: {exc}") from None

    def shutdown(self) -> None:
        """Wake a thread blocked in :meth:`receive` (it raises RpcFailed); thread-safe."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _refused(self, request: msgspec.Struct, reply: P.ErrorResp) -> RpcFailed:
        code = code_of(reply.code, ErrorCode.RPC_FAIL)
        if code == ErrorCode.INVALID_VERSION:
            message = f"master {self.addr}: {reply.message}"
        else:
            message = f"master {self.addr} refused {type(request).__name__}: {reply.message}"
        _log_once(message)
        return RpcFailed(message, code)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class _Undelivered(Exception):
    """No master took the request (none reachable, or none leads): safe to try again."""

    def __init__(self, error: RpcFailed):
        self.error = error


class _Broken(Exception):
    """The connection failed after the request was sent; ``second``: not the first time."""

    def __init__(self, error: RpcFailed, second: bool):
        self.error, self.second = error, second
