"""The control channel to the master: blocking request/reply (one frame out, one frame
back) over the messages of :mod:`kvpool.protocol`.

Used by the client (one channel per thread), by nodes and client-hosted segments (mount,
heartbeat) and by the node's admin app (a stats scrape), so it sits at the protocol's
level, below all of them. A broken
connection is reopened once per call; calls are not retried after the request was sent
except for idempotent requests (the caller says which), so a PutStart is never doubled.
Two cases are not "after it was sent": a connection the master closed between calls (it
restarted, or failed over) is seen before sending and replaced, and a request whose send
failed outright is sent again on a new connection; no master had either whole.

Several masters (a list, or etcd naming the leader: :mod:`kvpool.masters`): the channel
connects to the first candidate that answers, and a request a standby refused
(UNAVAILABLE_IN_CURRENT_STATUS: it applied nothing) or one that never reached a master
is tried on the next candidate until ``failover_s`` has passed, so callers follow a
change of leader without a restart. A request whose connection broke after it was sent
is retried only when idempotent; otherwise it fails with RpcFailed (retryable: the
master that took it either applied it whole or not at all, and a new leader knows only
what the nodes' indexes say was committed). A leader that stops answering without
closing its connections (stopped, swapping, cut off) is noticed within about
:data:`STALL_PROBE_S`: while a reply is late the channel asks the other masters whether
one leads now, and if one does, the request goes to it (idempotent or not: the stalled
one is past its lease, so it refuses whatever it reads when it runs again, sends no
answer or index change of a handler it was in, and what it reserved dies with it; the
new leader knows only what the nodes' indexes say).
:meth:`RpcChannel.notify` sends a notification (ReadDone), which gets no reply;
:meth:`RpcChannel.receive_pending` collects what the master sends unasked (a node's
index stream).

When the master refuses a request (:class:`~kvpool.protocol.ErrorResp`: a body it could
not decode, a handler failure, another protocol version), the refusal is raised as
RpcFailed with the master's message and also logged (logger ``kvpool.rpc``, WARNING, once
per distinct message per process), so callers that only see an error code, such as the
Mooncake facade's -600, still leave the reason where a user looks.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from typing import Callable, Sequence

import msgspec

from kvpool import auth, local_socket, tcp_connect
from kvpool import protocol as P
from kvpool.config import parse_addr
from kvpool.errors import ErrorCode, KVPoolError, RpcFailed, code_of
from kvpool.masters import MasterAddrs
from kvpool.spin import ReplyWait

log = logging.getLogger("kvpool.rpc")
_MAX_LOGGED = 1024  # distinct refusal messages remembered (then every one is logged)
_logged: set[str] = set()
_logged_lock = threading.Lock()
NOT_LEADER = ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS  # a standby's (or fenced leader's) refusal
RETRY_S = 0.05  # pause between rounds over the candidates during a change of leader
STREAM_RCVBUF = 4 << 20  # bytes of unasked frames the kernel holds between two polls (TCP)
# of timeout_s: the least a request past its caller's deadline waits for its reply (a
# commit after a long write decides the put: a short pause of the master must not fail it)
MIN_WAIT = 0.25
# several masters: a reply this late (s) has the channel ask whether another master leads
# (a stalled leader otherwise holds every caller for its whole timeout, 10 s by default,
# though a standby took over in 2-3 s); waits shorter than two of these are not probed
STALL_PROBE_S = 1.0


def _log_once(message: str) -> None:
    """Log ``message`` at WARNING the first time this process sees it."""
    with _logged_lock:
        if message in _logged:
            return
        if len(_logged) < _MAX_LOGGED:
            _logged.add(message)
    log.warning("%s", message)


class MasterUnreachable(RpcFailed):
    """No master accepted a connection (refused, no route, timed out, or no HA leader):
    worth trying again later, unlike a version or authentication failure."""


class RpcChannel:
    """A blocking connection to the master of ``addr`` (a master spec: "host:port", a
    list "h1:p1,h2:p2" or "etcd://h:2379[/key]", see :mod:`kvpool.masters`); not
    thread-safe (one per thread). ``secret``: answer the master's challenge with it
    (:mod:`kvpool.auth`; None: ``KVPOOL_SECRET``, b"": none). ``failover_s``: how long
    a call keeps looking for a leader among several masters (default ``timeout_s``).
    ``local``: reach a master on this host over its Unix socket (:mod:`kvpool.local_socket`;
    False: always TCP, as a client on another host would).
    ``addr`` is the address connected to (the spec until the first connection)."""

    def __init__(self, addr: str, timeout_s: float = 10.0, secret: bytes | None = None,
                 failover_s: float | None = None, local: bool = True):
        self.masters = MasterAddrs(addr)
        self.local = local  # a master on this host is reached over its Unix socket
        self.addr = addr
        self.timeout_s = timeout_s
        self.failover_s = timeout_s if failover_s is None else failover_s
        self.secret = auth.secret_or_env(secret)
        self._sock: socket.socket | None = None
        self._hangup: select.poll | None = None  # polls self._sock for a close between calls
        self._inbox: bytearray | None = None  # bytes of unasked frames not yet whole (:meth:`receive_pending`)
        self._answered = False  # the master has answered on this connection
        self._ever_answered = False  # some master has answered on this channel
        self._replies = ReplyWait()  # polls briefly for quick replies (kvpool.spin)
        # a master found leading (prefer(): maybe by another thread, a node's heartbeat),
        # tried first by the next connect, before a stalled ex-leader the list puts first
        self._leader_found: str | None = None

    def connect(self) -> None:
        """Open the connection to the first candidate master that accepts it. Raises
        MasterUnreachable when none accepts a connection, RpcFailed when one refuses us
        (another protocol version, a failed authentication)."""
        errors = []
        candidates = self.masters.candidates()
        found, self._leader_found = self._leader_found, None
        if found in candidates:  # a leader :meth:`leader_elsewhere` found goes first
            candidates.remove(found)
            candidates.insert(0, found)
        for addr in candidates:
            try:
                self._open(addr)
                return
            except RpcFailed as exc:
                if exc.code == ErrorCode.INVALID_VERSION or not self.masters.ha:
                    raise
                self.masters.failed(addr)
                errors.append(str(exc))
        raise MasterUnreachable("; ".join(errors) or f"no master leads {self.masters.spec} now")

    def _open(self, addr: str) -> None:
        host, port = parse_addr(addr)
        sock = local_socket.connect(host, port, self.timeout_s) if self.local else None
        if sock is None:
            try:
                sock = tcp_connect.connect((host, port), self.timeout_s)
            except OSError as exc:  # an unknown host name is a mistake, not a wait
                kind = RpcFailed if isinstance(exc, socket.gaierror) else MasterUnreachable
                raise kind(f"cannot reach master at {addr}: {exc.strerror or exc}") from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self.addr = sock, addr
        self._hangup = select.poll()
        self._hangup.register(sock, select.POLLIN)
        if self.secret is not None:
            try:
                auth.client_handshake(self._sock, self.secret, self.timeout_s, f"master {self.addr}")
            except RpcFailed:
                self.close()
                raise
        # the timeout in the kernel: no poll() before each send and recv
        P.set_kernel_timeouts(self._sock, self.timeout_s)
        self._answered = False

    def call(self, request: msgspec.Struct, idempotent: bool = True, notices: Sequence[msgspec.Struct] = (),
             during: Callable[[], None] | None = None, deadline: float | None = None):
        """Send ``request``, return the decoded reply Struct. ``notices``
        (notifications such as ReadDone, never answered) go first, in the same write.
        ``during``: run once, after the request went out and before its reply is
        waited for (work that overlaps the master's answer: a copy from a location
        hint, :mod:`kvpool.client.hints`, a pipelined batch's copies,
        :mod:`kvpool.client.pipeline`); it should not raise: if it does, the connection
        is closed, its reply being unread, and the exception propagates as it was (an
        OSError of the work is not taken for a broken master connection). After a
        connection that broke, an idempotent request is asked again without it; one
        that a lone master left unanswered for ``timeout_s`` is not (RpcFailed at once).
        ``deadline`` (time.monotonic; None: ``timeout_s`` per round trip): the caller's
        own end, e.g. a put's, shared by its several requests: the reply is waited for
        until then (at least :data:`MIN_WAIT` of ``timeout_s``, so a put whose write took
        its time still gets its commit through a master that answers), and a request that may have been
        sent is not asked again after it (one that reached no master is, until ``failover_s``).

        Raises RpcFailed when the master is unreachable, the stream breaks (after one
        reconnect for idempotent requests), the master speaks another protocol version
        (code INVALID_VERSION), or the master answers with ErrorResp (also logged once).
        With several masters, unreachable masters and standbys are passed over until
        ``failover_s`` has passed (then RpcFailed, code UNAVAILABLE_IN_CURRENT_STATUS
        when a standby was the last to answer).
        """
        frame = b"".join([*(P.encode_frame(n) for n in notices), P.encode_frame(request)])
        failover = time.monotonic() + (self.failover_s if self.masters.ha else 0.0)
        broke = False
        while True:
            try:
                reply = self._round_trip(frame, type(request), broke, idempotent, during, deadline)
            except _OverlapFailed as exc:
                raise exc.error from None
            except _Undelivered as exc:
                if time.monotonic() >= failover:
                    raise exc.error from None
                time.sleep(RETRY_S)
                continue
            except _Broken as exc:
                broke = True
                spent = deadline is not None and time.monotonic() >= deadline
                if (not idempotent and not exc.unsent) or exc.final or spent or \
                        (time.monotonic() >= failover and exc.second):
                    raise exc.error from None
                during = None  # it may have run (unless unsent): a retry only asks again
                continue
            during = None
            if isinstance(reply, P.ErrorResp):
                if reply.code == NOT_LEADER and self.masters.ha:
                    self.masters.failed(self.addr)
                    self.close()
                    if time.monotonic() < failover:
                        time.sleep(RETRY_S)
                        continue
                raise self._refused(request, reply)
            self.masters.answered(self.addr)
            return reply

    def _round_trip(self, frame: bytes, kind: type, broke: bool, idempotent: bool, during=None,
                    deadline: float | None = None):
        """One send, ``during()`` if given, and the receive (``kind``: the request's
        type, for the reply wait), each system call given up after ``timeout_s`` or at
        ``deadline`` (see :meth:`call`); raises _Undelivered (no master took the
        request) or _Broken (the connection failed after the request may have been sent)."""
        if self._sock is not None and self._hangup.poll(0):
            # readable between calls: the master closed the connection (it restarted or
            # failed over since the last call; it never speaks unasked here). A request
            # sent now would be lost unanswered, and one not idempotent (a PutStart) could
            # not be asked again: a new connection carries it instead (0.6 us a call)
            self.close()
        if self._sock is None:
            try:
                self.connect()
            except RpcFailed as exc:
                if exc.code == ErrorCode.INVALID_VERSION:
                    raise
                raise _Undelivered(exc) from None
        wait_s = self._wait_s(deadline)
        try:
            if wait_s != self.timeout_s:
                P.set_kernel_timeouts(self._sock, wait_s)
            return self._exchange(frame, kind, during, wait_s)
        except _Stalled as exc:
            stalled = self.addr
            self.masters.failed(stalled)
            self.close()
            log.warning("master %s: no answer after %.1f s while %s leads: asking it instead",
                        stalled, exc.waited_s, exc.leader)
            # unsent in effect: another leads only once this one's lease ran out, so it
            # refuses what it reads when it runs again and tells no node of a handler it
            # was in (master/server.py's gate); nothing is doubled
            raise _Broken(RpcFailed(f"master {stalled}: no answer while {exc.leader} leads"),
                          broke, unsent=True) from None
        except BlockingIOError:  # the kernel's timeout (SO_RCVTIMEO / SO_SNDTIMEO)
            hint = ("" if self._ever_answered else
                    " (a process took the connection and never answered: a stopped or overloaded "
                    "master, or not a kvpool master?)")
            self.masters.failed(self.addr)
            self.close()
            raise _Broken(RpcFailed(f"master {self.addr}: no answer within {wait_s:g} s{hint}"),
                          broke, final=not self.masters.ha) from None
        except _Unsent as exc:  # the frame did not go out whole: no master applied it
            raise self._broken(exc.error, broke, idempotent, unsent=True) from None
        except P.VersionMismatch as exc:
            self.close()
            raise RpcFailed(f"master {self.addr}: protocol version {P.PROTOCOL_VERSION}, "
                            f"master speaks {exc.version}", ErrorCode.INVALID_VERSION) from None
        except (OSError, P.FrameError, msgspec.MsgspecError) as exc:
            raise self._broken(exc, broke, idempotent) from None
        except BaseException:  # e.g. KeyboardInterrupt after the send: its reply, still on
            self.close()  # the way, must not be read as the next call's
            raise
        finally:
            if wait_s != self.timeout_s and self._sock is not None:
                try:
                    P.set_kernel_timeouts(self._sock, self.timeout_s)
                except OSError:
                    self.close()  # the next call reconnects

    def _broken(self, exc: Exception, broke: bool, idempotent: bool, unsent: bool = False) -> _Broken:
        """Close the connection that failed with ``exc``; returns the _Broken to raise,
        its message with a hint at the likely cause (``unsent``: the request never went
        out whole, see :class:`_Unsent`)."""
        # a master this channel spoke with before was killed, not replaced by another release
        first = not self._answered and not self._ever_answered
        self.masters.failed(self.addr)
        self.close()
        hint = (" (the master closed the connection at the first request: it may run "
                f"another kvpool release than protocol version {P.PROTOCOL_VERSION})"
                if first and isinstance(exc, P.FrameError) and not self.masters.ha else "")
        if auth.asks_for_secret(exc):
            hint = " (the master asks for a shared secret: set KVPOOL_SECRET)"
        elif "b'HTTP" in str(exc):
            hint = " (an HTTP server answered: the master's admin --http-port, not its --port?)"
        elif first and self.secret is not None and not self.masters.ha:
            # a server closes a connection whose answer to its challenge is wrong
            hint = (" (it closed the connection after this client answered its secret "
                    "challenge: is KVPOOL_SECRET the master's --secret?)")
        if not idempotent and self.masters.ha and not unsent:
            hint += " (the master may have applied it whole, or not at all: check, then retry)"
        what = f"the master closed the connection ({exc})" if isinstance(exc, ConnectionError) else exc
        return _Broken(RpcFailed(f"master {self.addr}: {what}{hint}"), broke, unsent=unsent)

    def _wait_s(self, deadline: float | None) -> float:
        """Seconds each system call of a round trip may wait: ``timeout_s``, or what is
        left before ``deadline`` when that is less (never under :data:`MIN_WAIT` of it)."""
        if deadline is None:
            return self.timeout_s
        left = deadline - time.monotonic()
        if left >= self.timeout_s * (1 - MIN_WAIT):
            return self.timeout_s  # most requests start well inside their deadline: no system calls
        return max(self.timeout_s * MIN_WAIT, left)

    def _exchange(self, frame: bytes, kind: type, during=None, wait_s: float = 0.0):
        """Send ``frame``, run ``during()`` if given, and receive and decode the reply
        (with several masters, waited for as :meth:`_await_reply` says, ``wait_s`` at most)."""
        sent_at = time.perf_counter()
        try:
            self._sock.sendall(frame)
        except BlockingIOError:  # the kernel's timeout: a master that stopped reading
            raise
        except OSError as exc:
            raise _Unsent(exc) from None
        if during is not None:
            kind = (kind, "during")  # a reply time of its own: what is left after the work
            self._overlap(during)
            sent_at = time.perf_counter()  # a wait measured from the send would outlast
            # the poll budget whenever the work does, and the master's reply would then
            # have to wake this thread (25-35 us here, kvpool.spin)
        if not self._replies.wait(self._sock, kind, sent_at) and self.masters.ha and wait_s >= 2 * STALL_PROBE_S:
            self._await_reply(wait_s)
        body = P.recv_frame(self._sock)
        self._replies.record(kind, sent_at)
        reply = P.reply_decoder.decode(body)
        self._answered = self._ever_answered = True
        return reply

    def _await_reply(self, wait_s: float) -> None:
        """Wait until the reply (or the connection's end) can be read, at most ``wait_s``
        seconds, asking every :data:`STALL_PROBE_S` whether another master leads
        (:meth:`leader_elsewhere`). Raises _Stalled when one does, BlockingIOError when
        ``wait_s`` passes (as the kernel's timeout on the receive would)."""
        start = time.monotonic()
        end = start + wait_s
        while not self._hangup.poll(max(0, int(min(STALL_PROBE_S, end - time.monotonic()) * 1000))):
            if time.monotonic() >= end:
                raise BlockingIOError
            leader = self.leader_elsewhere(min(STALL_PROBE_S, max(0.1, end - time.monotonic())))
            if leader is not None and not self._hangup.poll(0):  # a reply that came meanwhile is read
                raise _Stalled(leader, time.monotonic() - start)

    def leader_elsewhere(self, timeout_s: float, of: RpcChannel | None = None) -> str | None:
        """The address of a master other than the one channel ``of`` (default: this
        one) is connected to, by name or by socket (an alias of it is no other master),
        that serves now (:func:`is_leader`: a standby refuses every request); the
        masters asked in turn within about ``timeout_s`` seconds in all (each system call
        of a Ping may take what is left; with etcd, asking it takes up to its own 2 s);
        None when none does. A master that fails otherwise (another release, a socket
        error) counts as not leading. The next connection tries the one found first."""
        of = self if of is None else of
        exclude, peer = of.addr, of.peer()
        end = time.monotonic() + timeout_s
        for addr in self.masters.candidates():
            left = end - time.monotonic()
            if left <= 0:
                break
            if addr != exclude:
                try:
                    if is_leader(addr, left, self.secret or b"", peer, self.local):
                        self.prefer(addr)
                        return addr
                except (KVPoolError, OSError):
                    pass
        return None

    def peer(self):
        """The peer name of the connection (an (ip, port, ...) tuple, or a Unix socket's
        name), or None when there is none. Safe from another thread (a socket closed
        meanwhile gives None)."""
        sock = self._sock
        try:
            return None if sock is None else sock.getpeername()
        except OSError:
            return None

    def prefer(self, addr: str) -> None:
        """Have the next connection try master ``addr`` first (it was found leading).
        Safe to call from another thread than the channel's (one attribute is set)."""
        self._leader_found = addr

    def _overlap(self, during: Callable[[], None]) -> None:
        """Run ``during`` between a request and its reply; if it raises, the reply can
        no longer be matched to a request: the connection closes."""
        try:
            during()
        except BaseException as exc:
            self.close()
            raise _OverlapFailed(exc) from None

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

    def receive_pending(self) -> tuple[list[msgspec.Struct], bool]:
        """The whole frames the master has sent unasked (IndexUpdates on a node's index
        stream) that are already here, without waiting: ([frames], ended). ``ended``: the
        connection is closed (the master went away, or :meth:`shutdown`); the frames
        before the end are still returned, so none is lost. From the first call on the
        connection serves no more calls.

        Polled on a timer rather than read by a blocked thread: a write to a socket
        whose reader sleeps in recv() wakes that reader (on this VM, 25-35 us of the
        writer's time and a context switch per frame); one to a socket nobody waits on
        only queues the bytes (measured 16.5 vs 9.3 us per send). The kernel buffer holds
        the frames meanwhile (:data:`STREAM_RCVBUF` over TCP; over a Unix socket the
        master's send buffer is what counts, and the master holds back a commit's reply
        while its update has not reached the kernel). Raises RpcFailed when not
        connected or on a frame that does not decode."""
        if self._sock is None:
            raise RpcFailed(f"master {self.addr}: not connected")
        if self._inbox is None:
            self._inbox = bytearray()
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STREAM_RCVBUF)
            # non-blocking: with a timeout set, Python waits in poll() before recv even
            # under MSG_DONTWAIT, and a quiet stream would look like a dead one
            self._sock.setblocking(False)
        ended = False
        while True:
            try:
                chunk = self._sock.recv(STREAM_RCVBUF)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # reset, or shut down by shutdown(): the stream is over
                chunk = b""
            if not chunk:
                ended = True
                break
            self._inbox += chunk
        try:
            frames = self._take_frames()
        except (ValueError, P.FrameError, msgspec.MsgspecError) as exc:
            self.close()
            raise RpcFailed(f"master {self.addr}: {exc}") from None
        return frames, ended

    def _take_frames(self) -> list[msgspec.Struct]:
        """Decode and remove the whole frames at the front of the inbox."""
        inbox, frames, at = self._inbox, [], 0
        while len(inbox) - at >= P.HEADER.size:
            length = P.parse_header(bytes(inbox[at : at + P.HEADER.size]))
            end = at + P.HEADER.size + length
            if end > len(inbox):
                break
            frames.append(P.reply_decoder.decode(memoryview(inbox)[at + P.HEADER.size : end]))
            at = end
        del inbox[:at]
        return frames

    def shutdown(self) -> None:
        """End the connection for the thread that reads it: its next
        :meth:`receive_pending` says ``ended``; thread-safe."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _refused(self, request: msgspec.Struct, reply: P.ErrorResp) -> RpcFailed:
        code = code_of(reply.code, ErrorCode.RPC_FAIL)
        if code == NOT_LEADER and isinstance(request, P.Ping):
            # a standby's answer to a leader probe (is_leader), no fault: not logged
            return RpcFailed(f"master {self.addr} refused Ping: {reply.message}", code)
        if code == ErrorCode.INVALID_VERSION:
            message = f"master {self.addr}: {reply.message}"
        else:
            message = f"master {self.addr} refused {type(request).__name__}: {reply.message}"
        _log_once(message)
        return RpcFailed(message, code)

    def close(self) -> None:
        self._inbox = None
        self._hangup = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class _OverlapFailed(Exception):
    """The work run during a request raised ``error`` (the connection is closed)."""

    def __init__(self, error: BaseException):
        self.error = error


class _Undelivered(Exception):
    """No master took the request (none reachable, or none leads): safe to try again."""

    def __init__(self, error: RpcFailed):
        self.error = error


class _Unsent(Exception):
    """Sending the request failed (the connection was closed or reset): the master
    never had the whole frame, so it applied nothing of it. Notices that went first in
    the same write (ReadDone) may have arrived and are sent again: a master ignores a
    grant id it no longer holds."""

    def __init__(self, error: OSError):
        self.error = error


class _Stalled(Exception):
    """The connected master did not answer for ``waited_s`` seconds while ``leader``
    (another master) serves."""

    def __init__(self, leader: str, waited_s: float):
        self.leader, self.waited_s = leader, waited_s


class _Broken(Exception):
    """The connection failed after the request was sent (or, ``unsent``, while it was
    being sent); ``second``: not the first time;
    ``final``: asking again cannot help: a lone master let the request time out;
    ``unsent``: the request never went out whole (asked again, idempotent or not). A
    master that restarted breaks the connection (EOF, a reset) rather than keep it
    silent, so asking a silent one again (stopped, swapping, cut off) only made the
    caller wait a second timeout, and resent the work to a master that may still do it."""

    def __init__(self, error: RpcFailed, second: bool, final: bool = False, unsent: bool = False):
        self.error, self.second, self.final, self.unsent = error, second, final, unsent


def is_leader(addr: str, timeout_s: float = 1.0, secret: bytes = b"", not_peer=None,
              local: bool = True) -> bool:
    """True when the master at ``addr`` serves (answers a Ping within ``timeout_s``
    seconds); False when it refuses (a standby) or cannot be reached, and when the
    connection reaches ``not_peer`` (a socket's peer name: the same master under another
    name, e.g. "localhost:P" for "127.0.0.1:P"). ``local``: as RpcChannel's. Raises
    KVPoolError for another failure (e.g. INVALID_VERSION: another kvpool release)."""
    chan = RpcChannel(addr, timeout_s, secret, local=local)
    try:
        chan.connect()
        if not_peer is not None and chan.peer() == not_peer:
            return False
        chan.call(P.Ping())
        return True
    except KVPoolError as exc:
        if exc.code not in (ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS, ErrorCode.RPC_FAIL):
            raise
        return False
    finally:
        chan.close()
