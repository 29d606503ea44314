"""The master's asyncio server: frames in, MasterService handlers, frames out.

One event loop (uvloop when installed) owns all metadata, so handlers run one at a time
without locks. Requests that look at every object (RemoveAll, RemoveByRegex) run in
slices (:mod:`kvpool.master.scans`) with other requests in between, so no request holds
the loop for long (K23). A request that does not decode gets an :class:`ErrorResp` and the
connection stays open; a frame with a bad header closes that connection only, and a
client of another protocol version is told so (:func:`kvpool.protocol.version_refusal`)
before it is closed. :class:`~kvpool.protocol.ReadDone` and :class:`~kvpool.protocol.Wake`
are notifications (``protocol.NOTICES``): they get no reply. A background task runs
:meth:`MasterService.tick` (liveness, grants, zombies, eviction) and closes connections
that stalled mid-frame.

A node that mounts with ``index`` keeps its connection as its index stream: after every
request (and tick) the queued index changes (:class:`~kvpool.master.restore.IndexLog`)
are written to the streams of their segments *before* the request's reply, so a commit
is in the node's socket buffer before the client hears of it (a reply waits while its
updates are still in this process's write buffer: a kill -9 loses those). A reply
whose changes met a segment with no stream (its node is mounting again) waits for the
new stream, whose resync carries them (:meth:`MasterServer._streams_back`). A stream is
closed when its segment is unmounted or mounted again (the node then re-mounts at
once). A stream that ends otherwise, from a node whose data port no longer takes
connections, means a dead node: its segment takes no new buffers until it mounts again
or times out (:meth:`MasterService.stream_lost`).

What a connection may cost (K22): a body is buffered only as its bytes arrive (a header
announcing :data:`~kvpool.protocol.MAX_FRAME` costs nothing until the bytes come), and a
connection whose frame has not arrived whole ``stall_s`` seconds after its header
(by the service's clock) is closed. Between frames a connection may stay idle.

HA (``gate``, :mod:`kvpool.master.election`): a master that does not lead (a standby,
or a leader past its lease deadline) answers every request with ErrorResp
UNAVAILABLE_IN_CURRENT_STATUS and applies nothing; the gate is asked before each
handler and again before its index changes and reply go out (a handler that ran as the
lease ran out is answered with the refusal and its index changes are not sent: the
nodes keep what the next leader will rebuild). Its upkeep tick does not run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from types import GeneratorType
from typing import Callable

import msgspec

from kvpool import auth, local_socket
from kvpool import protocol as P
from kvpool.config import format_addr, parse_addr
from kvpool.errors import ErrorCode, UserError
from kvpool.master import scans
from kvpool.master.busy_poll import BusyPoll
from kvpool.master.service import MasterService
from kvpool.masters import DEFAULT_MASTER_PORT
from kvpool.spin import BUSY_POLL_US

log = logging.getLogger("kvpool.master")

TICK_S = 0.05
STALL_EXCUSED_S = 1.0  # a tick this late means the master did not run: node silences meanwhile do not count
STALL_S = 30.0  # seconds a frame may take to arrive after its header
INDEX_DRAIN_S = 2.0  # seconds past the client TTL a reply waits for a node to take its index update
STREAM_SNDBUF = 4 << 20  # bytes of index updates the kernel holds for a same-host node (Unix socket)
RESYNC_FRAME = 20_000  # index entries per frame of a resync (~1.6 MB)
PROBE_S = 2.0  # seconds a node's data port has to accept a connection once its stream ended
PROBES, PROBE_EVERY_S = 25, 0.02  # tries of the data port (0.5 s), and the pause between them
STREAM_POLL_S = 0.005  # how often a reply held for a segment's stream (_streams_back) looks again
# A lead's first moments: after a failover or a restart the nodes find the new leader
# within their remount retry (0.1 s), ~0.2 s measured; until then a placement found no
# segment at all and the put raised NoSpace. Such a placement now waits for the first
# mount, for at most this long into the lead.
FIRST_MOUNT_WAIT_S = 1.0
PLACEMENTS = (P.PutStart, P.BatchPutStart, P.AllocLease)  # requests that place new buffers


def _write(writer: asyncio.StreamWriter, frame: bytes) -> bool:
    """Queue ``frame`` on ``writer``; False when its connection is closed or closing
    (the peer is gone: killed, reset). uvloop raises RuntimeError ("the handler is
    closed") for a write to a closed transport, where asyncio's own loop only logs;
    uncaught, it ended the serving of the request that wrote (a client's put on another
    connection, when the closed one was a node's index stream)."""
    if writer.is_closing():
        return False
    try:
        writer.write(frame)
    except (RuntimeError, OSError):
        writer.transport.abort()
        return False
    return True


def _handlers(svc: MasterService) -> dict[type, Callable[[msgspec.Struct], msgspec.Struct | None]]:
    """Request type -> function(request) -> its reply Struct (None: a notification), or
    a scan generator (:mod:`kvpool.master.scans`) that returns it."""
    return {
        P.Ping: lambda r: svc.ping(),
        P.MountSegment: lambda r: svc.mount(r.owner_id, r.segment, r.index, r.objects, r.prev_incarnation),
        P.UnmountSegment: lambda r: svc.unmount(r.owner_id, r.name),
        P.Heartbeat: lambda r: svc.heartbeat(r.owner_id),
        P.PutStart: lambda r: svc.put_start(r.item, r.host_id),
        P.BatchPutStart: lambda r: svc.batch_put_start(r.items, r.host_id),
        P.PutEnd: lambda r: svc.put_end(r.token),
        P.BatchPutEnd: lambda r: svc.batch_put_end(r.tokens),
        P.PutRevoke: lambda r: svc.put_revoke(r.token),
        P.BatchPutRevoke: lambda r: svc.batch_put_revoke(r.tokens),
        P.GetReplicaList: lambda r: svc.get_replica_list(r.key),
        P.BatchGetReplicaList: lambda r: svc.batch_get_replica_list(r.keys),
        P.ReadDone: lambda r: svc.read_done(r.grant_ids),
        P.ExistKey: lambda r: svc.exist_key(r.key),
        P.BatchExistKey: lambda r: svc.batch_exist_key(r.keys),
        P.Remove: lambda r: svc.remove(r.key, r.force),
        P.BatchRemove: lambda r: svc.batch_remove(r.keys, r.force),
        P.RemoveAll: lambda r: scans.remove_matching(svc, None, r.force),
        P.RemoveByRegex: lambda r: scans.remove_matching(svc, r.pattern, r.force),
        P.SetPin: lambda r: svc.set_pin(r.key, r.mode),
        P.GetStats: lambda r: svc.stats(),
        P.AllocLease: lambda r: svc.alloc_lease(r.owner_id, r.size, r.host_id, r.segment),
        P.PutCommit: lambda r: svc.put_commit(r.owner_id, r.lease_id, r.items),
        P.ReturnLease: lambda r: svc.return_lease(r.owner_id, r.lease_ids),
    }


Observer = Callable[[str, msgspec.Struct | None], None]
BAD_REQUEST = "BadRequest"  # the op name observers see for a body that did not decode


class MasterServer:
    """Serves :class:`MasterService` on ``host:port`` (port 0 = any free port); a frame
    must arrive whole within ``stall_s`` seconds of its header; with ``secret`` a
    connection must first answer a challenge (:mod:`kvpool.auth`) within ``stall_s``;
    ``busy_poll_s``: the longest busy poll after an answer (:mod:`kvpool.master.busy_poll`;
    0: never)."""

    def __init__(self, service: MasterService, host: str = "127.0.0.1", port: int = DEFAULT_MASTER_PORT,
                 stall_s: float = STALL_S, secret: bytes | None = None,
                 gate: Callable[[], str | None] = lambda: None, busy_poll_s: float = BUSY_POLL_US / 1e6):
        self.service = service
        self.busy = BusyPoll(busy_poll_s)
        self.gate = gate  # None: serve; a text: refuse every request with it (not the leader)
        self.secret = secret  # set: every connection must answer a challenge first (kvpool.auth)
        self.host, self.port = host, port
        self.stall_s = stall_s
        self._mid_frame: dict[asyncio.StreamWriter, float] = {}  # connection -> when its header came
        self._handlers = _handlers(service)
        self._handlers[P.MountSegment] = self._mount
        self._handlers[P.Wake] = lambda r: self.busy.expect(r.within_us / 1e6)
        self._observers: list[Observer] = []
        self._streams: dict[str, tuple[int, asyncio.StreamWriter]] = {}  # segment -> (epoch, index stream)
        # set by an index mount's handler, taken by its connection right after (no await between)
        self._new_stream: tuple[str, int, P.MountResp] | None = None
        self._server: asyncio.base_events.Server | None = None
        self._local_servers: list[asyncio.base_events.Server] = []  # Unix sockets (same-host clients)
        self._tasks: set[asyncio.Task] = set()  # node checks under way (_check_node)
        self._conns: set[asyncio.Task] = set()  # connections being served (_serve_conn)
        self._closed = False  # close() ran: connections end (_serve_conn)
        self._mounted = asyncio.Event()  # set at each mount: wakes placements held for one (_first_mount)
        self._writes = 0  # index frames written so far
        # stream with bytes left here -> (its last write, its segment), the segment
        # also in SegmentTable.lagging (placement takes it last)
        self._behind: dict[asyncio.StreamWriter, tuple[int, str]] = {}

    def _mount(self, req: P.MountSegment) -> P.MountResp:
        reply = self.service.mount(req.owner_id, req.segment, req.index, req.objects, req.prev_incarnation)
        if req.index and reply.code == ErrorCode.OK:
            self._new_stream = (req.segment.name, reply.epoch, reply)
        return reply

    def _send_index(self) -> list[str] | None:
        """Write the queued index changes to their segments' streams (no waiting: the
        bytes are in the kernel, or queued in the transport, when this returns: see
        :meth:`_index_flushed`). Returns the segments whose changes found no stream
        (their node is mounting again: :meth:`_streams_back`). None when this master no
        longer leads: nothing is written (the nodes keep what they hold), and the
        request's reply must be the refusal, not an answer whose changes no node was
        told."""
        updates = self.service.index_log.take()
        if self.gate() is not None:
            return None
        gaps = []
        for update in updates:
            stream = self._streams.get(update.name)
            if stream is not None and not stream[1].is_closing():
                self._write_index(stream[1], update)
            elif self._stream_due(update.name):
                gaps.append(update.name)
        return gaps

    def _unstreamed(self, name: str) -> bool:
        """Whether segment ``name`` is mounted with an index and has no stream now (or
        one closing, whose handler has not seen it end yet): its node's index may still
        name objects dropped since."""
        seg = self.service.segments.segments.get(name)
        stream = self._streams.get(name)
        return seg is not None and seg.indexed and (stream is None or stream[1].is_closing())

    def _stream_due(self, name: str) -> bool:
        """Whether segment ``name`` has no stream (:meth:`_unstreamed`) and its node was
        not found gone (:meth:`_check_node`): it is mounting again, and that mount's
        resync will carry what its stream missed."""
        return (self._unstreamed(name) and name not in self.service.segments.withheld
                and self._server is not None)

    async def _streams_back(self, names: list[str], since: int) -> bool:
        """Hold a reply whose changes reached no node (segments ``names`` had no stream)
        until each of them has a stream again, whose resync carries those changes, and
        that has left this process (:meth:`_index_flushed`); or until its node is found
        gone, or unmounted. Before, such a reply went out at once: a master killed before
        the node mounted again lost the change, and a restore then served a removed key
        or the old version of an upserted one. Waits at most the client TTL plus
        :data:`INDEX_DRAIN_S` (a node that heartbeats but never mounts again; its
        segment is then withheld from placement, so later puts go elsewhere and no
        later reply waits for it: :meth:`_stream_due`). Returns
        False when this master stopped leading meanwhile (the reply must be the refusal:
        the next leader knows only what the nodes were told)."""
        self.service.counters["replies_held_for_stream"] += 1
        cap = self.service.config.client_ttl_s + INDEX_DRAIN_S
        end = self.service.clock() + cap
        while any(self._stream_due(name) for name in names):
            if self.service.clock() >= end:
                log.warning("segments %s had no index stream for %.1f s: no longer waiting for it",
                            ", ".join(sorted(set(names))), cap)
                for name in filter(self._stream_due, set(names)):  # later replies need not wait too
                    self.service.stream_lost(name, self.service.segments.segments[name].info.epoch,
                                             f"no index stream for {cap:.1f} s")
                break
            await asyncio.sleep(STREAM_POLL_S)
        await self._index_flushed(since)
        return self.gate() is None

    async def _first_mount(self, body: bytes | bytearray) -> None:
        """Hold a placement (:data:`PLACEMENTS`) that comes while no segment is mounted
        during the lead's first :data:`FIRST_MOUNT_WAIT_S` (on the service's clock:
        ``MasterService.lead_began``) until a segment is mounted, that time is over, or
        this master stops leading or serving, and, while the lead's first tick has not
        come, for at most that long in real time; then it is handled as usual. Any other
        request, and any placement later in the lead, goes on at once. Counted as
        ``placements_held_for_mount``."""
        if self.gate() is not None or not self._lead_young():
            return
        try:
            req = P.request_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # the handler says what is wrong with it
        if not isinstance(req, PLACEMENTS):
            return
        self.service.counters["placements_held_for_mount"] += 1
        loop = asyncio.get_running_loop()
        end = loop.time() + FIRST_MOUNT_WAIT_S  # should the first tick never come
        while (not self.service.segments.segments and self._lead_young()
               and (self.service.lead_began is not None or loop.time() < end)
               and self.gate() is None and not self._closed):
            # woken by the mount; each tick otherwise, to see the lead age (a connection
            # per held placement: polling every few ms would let a flood of them spin)
            self._mounted.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._mounted.wait(), TICK_S)

    def _lead_young(self) -> bool:
        """Whether this master leads since less than :data:`FIRST_MOUNT_WAIT_S` (or its
        first tick as leader has not come yet)."""
        began = self.service.lead_began
        return began is None or self.service.clock() < began + FIRST_MOUNT_WAIT_S

    def _write_index(self, writer: asyncio.StreamWriter, update: P.IndexUpdate) -> None:
        """Write ``update`` to an index stream, unless the stream is gone (its node was
        killed: the stream's handler drops it, and a node still alive mounts again and is
        resynchronised); the other streams are written all the same."""
        if not _write(writer, P.encode_frame(update)):
            return
        self._writes += 1
        if writer.transport.get_write_buffer_size():  # the kernel's buffer is full: the rest waits in ours
            self._fell_behind(writer, update.name)

    def _fell_behind(self, writer: asyncio.StreamWriter, name: str) -> None:
        """Note that segment ``name``'s stream ``writer`` holds bytes here, up to the
        latest write (:meth:`_index_flushed` notes when it no longer does)."""
        self._behind[writer] = (self._writes, name)
        self.service.segments.lagging.add(name)

    async def _placements_clear(self, names: set[str], since: int, reply: msgspec.Struct) -> msgspec.Struct:
        """Hold a reply that placed new buffers on segments ``names`` until every index
        update written to their streams before it has left this process, and for a
        segment with no stream, until it has one again (:meth:`_streams_back`: its mount
        tells the node what to forget). A buffer placed there may cover a range whose
        object was just removed, evicted or replaced, and whose drop still waits here
        (its stream is behind) or died with a stream that ended: the writer's bytes in
        that range and a master killed then would have the rebuild serve them under the
        old key, from the node's index. ``since``: the index writes made before the
        request (:meth:`_streams_back`). Returns what goes out: ``reply``, the refusal
        when this master stopped leading meanwhile, or ``reply`` with NO_AVAILABLE_HANDLE
        for each item placed on a segment still without a stream after the wait
        (:meth:`_without_lost`). Counted as ``placements_held`` when a stream was behind."""
        behind = {stream[1] for name in names if (stream := self._streams.get(name)) is not None
                  and stream[1] in self._behind}
        if behind:
            self.service.counters["placements_held"] += 1
            await self._index_flushed(-1, behind)
        gaps = [name for name in names if self._stream_due(name)]
        if gaps:
            await self._streams_back(gaps, since)
        if self.gate() is not None:
            return self._refusal_now()
        lost = set(filter(self._unstreamed, names))
        return self._without_lost(reply, lost) if lost else reply

    def _without_lost(self, reply: msgspec.Struct, lost: set[str]) -> msgspec.Struct:
        """``reply`` (a PutStartResp, BatchPutStartResp or AllocLeaseResp) with each
        item placed on a segment of ``lost`` answered NO_AVAILABLE_HANDLE instead, with
        the reason a put finds no room: those segments' nodes were found gone, or never
        mounted again, so they are withheld. Their index may still name a key removed
        meanwhile at the ranges placed, so nobody may write there before the node's next
        mount; the buffers go back as those of any put that never ends (K04), a lease's
        when it expires. Each refused item counts as ``placements_refused``."""
        def refused(length: int):
            self.service.counters["placements_refused"] += 1
            return self.service.no_space_message(length, self.service.clock())

        def start(r: P.PutStartResp) -> P.PutStartResp:
            if r.code != ErrorCode.OK or not any(d.segment.name in lost for d in r.replicas):
                return r
            return P.PutStartResp(ErrorCode.NO_AVAILABLE_HANDLE, message=refused(r.replicas[0].length))

        if isinstance(reply, P.PutStartResp):
            return start(reply)
        if isinstance(reply, P.BatchPutStartResp):
            return P.BatchPutStartResp([start(r) for r in reply.results])
        if isinstance(reply, P.AllocLeaseResp) and reply.region is not None and reply.region.segment.name in lost:
            return P.AllocLeaseResp(ErrorCode.NO_AVAILABLE_HANDLE, message=refused(reply.region.length))
        return reply

    async def _index_flushed(self, since: int, only: set | None = None) -> None:
        """Wait until the index bytes written after write number ``since`` have left
        this process: a reply may tell a client of a commit only once its update is in
        a node's socket (the kernel keeps it when this master is killed; its memory does
        not). A node that reads too slowly fills the kernel's buffer (on a Unix socket
        :data:`STREAM_SNDBUF`, capped by net.core.wmem_max) and holds back the replies
        of commits on its segments until it reads again, or until its owner times out
        (its segment is dropped, its stream cut). Past that (a node that heartbeats but
        does not read) the stream is cut, the reply goes out, and the node mounts again
        and is resynchronised (:meth:`~kvpool.master.restore.Restore.resync`). Requests
        that wrote (or flushed from the log) nothing to such a stream do not wait,
        unless they queue behind a held reply on the same connection. ``only``: the
        streams to wait for (None: all)."""
        cap = self.service.config.client_ttl_s + INDEX_DRAIN_S
        for writer, (last, name) in list(self._behind.items()):
            if only is not None and writer not in only:
                continue
            if last > since and writer.transport.get_write_buffer_size() and not writer.is_closing():
                try:
                    await asyncio.wait_for(writer.drain(), cap)
                except asyncio.TimeoutError:
                    log.warning("an index stream took no bytes for %.1f s: closing it (its node mounts again)", cap)
                    writer.transport.abort()
                except OSError as exc:  # reset, host unreachable: its node mounts again
                    log.warning("an index stream failed (%s): closing it", exc)
                    writer.transport.abort()
            if (not writer.transport.get_write_buffer_size() or writer.is_closing()) \
                    and self._behind.pop(writer, None) is not None \
                    and all(other != name for _, other in self._behind.values()):  # a new stream of it
                self.service.segments.lagging.discard(name)

    def _close_stale_streams(self) -> None:
        """Close the streams of segments unmounted, or mounted again, since."""
        segments = self.service.segments.segments
        for name, (epoch, writer) in list(self._streams.items()):
            seg = segments.get(name)
            if seg is None or seg.info.epoch != epoch:
                del self._streams[name]
                writer.transport.abort()  # what it still holds is void; replies waiting on it go

    def _take_claim(self, reply) -> tuple[str, int] | None:
        """The (segment, epoch) whose index stream this connection becomes: set by the
        handler of an index mount that ``reply`` answers (taken before any await, so no
        other connection's request can take it); None for any other reply (also a
        mount's reply replaced by a refusal)."""
        claim, self._new_stream = self._new_stream, None
        if claim is None or claim[2] is not reply:
            return None
        return claim[0], claim[1]

    def _adopt_stream(self, writer: asyncio.StreamWriter, name: str, epoch: int) -> None:
        """Make ``writer`` segment ``name``'s index stream (its mount reply already
        written): any older stream is cut, and the resync the mount queued goes first."""
        old = self._streams.get(name)
        if old is not None and old[1] is not writer:
            old[1].transport.abort()  # what it still holds is void: the resync covers it
        self._streams[name] = (epoch, writer)
        self._mounted.set()
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:  # TCP: set, it would stop autotuning
            with contextlib.suppress(OSError):  # the kernel caps it at net.core.wmem_max
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)
        writer.transport.set_write_buffer_limits(high=0)  # drain() waits for an empty buffer
        adds = self.service.index_log.resyncs.pop(name, [])
        for i in range(0, len(adds), RESYNC_FRAME):
            self._write_index(writer, P.IndexUpdate(name, [], adds[i:i + RESYNC_FRAME]))
        if writer.transport.get_write_buffer_size() and not writer.is_closing():
            # the mount's reply (keys to forget) is still here: a placement on this
            # segment waits for it as for an index update (_placements_clear)
            self._writes += 1
            self._fell_behind(writer, name)

    def observe(self, callback: Observer) -> None:
        """Call ``callback(op, reply)`` after each request is handled (e.g. per-op request
        and error counters). ``op`` is the request type's name ("PutStart", "BatchRemove",
        ...; :data:`BAD_REQUEST` for a body that did not decode); ``reply`` is the Struct
        sent back (an ErrorResp when the handler failed; None for a notification,
        ReadDone, which gets no reply). Runs on the event loop: it must
        be quick; an exception it raises is logged and ignored."""
        self._observers.append(callback)

    def dispatch(self, body: bytes | bytearray) -> msgspec.Struct | None:
        """Decode one request body, run its handler (a scan to its end at once), tell the
        observers; never raises. Returns the reply, None for a notification (nothing is
        sent back)."""
        return scans.run_to_end(self._steps(body))

    async def dispatch_sliced(self, body: bytes | bytearray) -> msgspec.Struct | None:
        """:meth:`dispatch`, with a scan run in slices that let other requests in."""
        return await scans.run_in_slices(self._steps(body))

    def _steps(self, body: bytes | bytearray):
        """The work of one request as a generator that yields between scan slices and
        returns the reply."""
        try:
            req = P.request_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            op, reply = BAD_REQUEST, P.ErrorResp(ErrorCode.INVALID_PARAMS, f"bad request: {exc}"[:300])
        else:
            op = type(req).__name__
            try:
                if self.gate() is not None:
                    reply = self._refusal(req)
                else:
                    reply = self._handlers[type(req)](req)
                    if type(reply) is GeneratorType:  # a scan (typing's isinstance costs 2 us)
                        reply = yield from reply
                    if self.gate() is not None:  # the lease ran out meanwhile
                        reply = self._refusal(req)
            except Exception:  # a bug must not take the whole master down; log it loudly
                log.exception("handler for %s failed", op)
                reply = None if isinstance(req, P.NOTICES) else P.ErrorResp(
                    ErrorCode.INTERNAL_ERROR, f"internal error in {op}")
        for callback in self._observers:
            try:
                callback(op, reply)
            except Exception:  # counting must never cost a reply
                log.exception("master observer failed on %s", op)
        return reply

    def _refusal(self, req: msgspec.Struct) -> P.ErrorResp | None:
        """The answer of a master that does not lead (None for a notification)."""
        if isinstance(req, P.NOTICES):
            return None
        return self._refusal_now()

    def _refusal_now(self) -> P.ErrorResp:
        return P.ErrorResp(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS, self.gate() or "not the leader")

    async def _authenticated(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Challenge a new connection; True when it answered right within ``stall_s``."""
        if self.secret is None:
            return True
        hello, nonce = auth.challenge()
        if not _write(writer, hello):
            return False
        try:
            reply = await asyncio.wait_for(reader.readexactly(auth.ANSWER_BYTES), self.stall_s)
        except asyncio.TimeoutError:
            return False
        if not auth.verify(self.secret, nonce, reply):
            log.warning("refused a connection that failed authentication")
            return False
        return True

    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        shutting_down = False
        task = asyncio.current_task()
        self._conns.add(task)
        try:
            if self._closed or not await self._authenticated(reader, writer):
                return  # accepted as close() ran: its cancel may have come before this task did
            loop = asyncio.get_running_loop()
            # closed: end here too (before 3.12 a wait_for can swallow close()'s cancel)
            while not self._closed:
                length = P.parse_header(await reader.readexactly(P.HEADER.size))
                self.busy.request()
                self._mid_frame[writer] = self.service.clock()
                body = await reader.readexactly(length)
                self._mid_frame.pop(writer, None)  # close_stalled may have dropped it
                if not self.service.segments.segments:  # no node yet: a lead's first moments?
                    await self._first_mount(body)
                since, repeats = self._writes, self.service.counters["commits_repeated"]
                # only this handler's placements count (the tick's went to no writer)
                self.service.segments.placed.clear()
                reply = await self.dispatch_sliced(body)
                placed = self.service.segments.take_placed()  # no await since the handler
                claim = self._take_claim(reply)
                # before the reply: the commit is with the node first; the lead lost since
                # the handler's own check: the answer is the refusal (a new leader knows
                # only what the nodes were told)
                gaps = self._send_index()
                if gaps is None and reply is not None:
                    reply, claim = self._refusal_now(), None
                if self._behind and claim is None:  # a mount's reply tells of no commit
                    if self.service.counters["commits_repeated"] != repeats:
                        since = -1  # a resend answered OK wrote nothing: its first send's
                        # update may still be in this process, so every stream drains first
                    await self._index_flushed(since)
                if gaps and claim is None and reply is not None and not await self._streams_back(gaps, since):
                    reply = self._refusal_now()
                if placed and reply is not None and (self._behind or any(map(self._unstreamed, placed))):
                    reply = await self._placements_clear(placed, since, reply)
                written = reply is None or _write(writer, P.encode_frame(reply))
                if claim is not None:  # adopted even when its node is gone: the finally checks it
                    self._adopt_stream(writer, *claim)
                if not written:
                    return  # the client is gone
                self.busy.answered(loop)
                if reply is not None:
                    await writer.drain()
        except P.VersionMismatch as exc:  # say why before closing: "protocol version X, ..."
            log.warning("refused a client of protocol version %d (this master speaks %d)",
                        exc.version, P.PROTOCOL_VERSION)
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                await reader.readexactly(exc.length)
                if _write(writer, P.version_refusal(exc.version, "master")):
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, P.FrameError):
            pass  # peer left or sent garbage framing: drop this connection only
        except asyncio.CancelledError:
            shutting_down = True  # end quietly instead of logging a cancel
        finally:
            self._conns.discard(task)
            self._mid_frame.pop(writer, None)
            for name, (epoch, stream) in list(self._streams.items()):
                if stream is writer:  # still this mount's stream: no new mount replaced it
                    del self._streams[name]
                    if not shutting_down:
                        self._spawn(self._check_node(name, epoch))
            writer.close()

    def _spawn(self, coro) -> None:
        """Run ``coro`` as a task the server holds until it ends (asyncio keeps only a
        weak reference to a task) or :meth:`close` cancels it; once closed, none."""
        if self._server is None:
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check_node(self, name: str, epoch: int) -> None:
        """The index stream of ``name``'s mount ``epoch`` ended with no new mount in its
        place. A node that broke its stream to mount again still listens on its data
        port and soon has a new stream; a dead one refuses connections (a dying process
        may close its stream before its listener, hence :data:`PROBES` tries), and a host
        gone from the network does not answer within :data:`PROBE_S`: then the segment
        is withheld from placement (:meth:`MasterService.stream_lost`). Ends at once
        once the server is closed: before Python 3.12, ``wait_for`` can swallow the
        cancel :meth:`close` sends when the probe finishes in the same step."""
        for _ in range(PROBES):
            seg = self.service.segments.segments.get(name)
            if self._server is None or seg is None or seg.info.epoch != epoch or name in self._streams:
                return  # closed, unmounted, or mounted again
            answered = await _answers(seg.info.data_addr)
            if self._server is None:
                return  # closed meanwhile
            if not answered:
                if self.gate() is None and self._streams.get(name) is None:
                    self.service.stream_lost(name, epoch)
                return
            await asyncio.sleep(PROBE_EVERY_S)

    def close_stalled(self) -> int:
        """Close every connection whose frame began over ``stall_s`` ago (its read then
        ends); returns how many. Run by :meth:`tick_forever`."""
        now = self.service.clock()
        stalled = [w for w, since in self._mid_frame.items() if now - since > self.stall_s]
        for writer in stalled:
            del self._mid_frame[writer]
            writer.transport.abort()
        if stalled:
            log.warning("closed %d connection(s) stalled mid-frame for over %.1f s", len(stalled), self.stall_s)
        return len(stalled)

    async def start(self) -> str:
        """Bind and start serving, on TCP and, for clients on this host, on the Unix
        socket of each bound address (:mod:`kvpool.local_socket`); returns the bound
        "host:port" (``[v6]:port``). Raises OSError when the port cannot be bound,
        UserError when another process holds the Unix socket's name."""
        self._server = await asyncio.start_server(self._serve_conn, self.host, self.port)
        port = self._server.sockets[0].getsockname()[1]
        if local_socket.enabled():
            for sock in self._server.sockets:
                name = local_socket.listen_name(sock.getsockname()[0], port)
                try:
                    self._local_servers.append(await asyncio.start_unix_server(self._serve_conn, path=name))
                except OSError as exc:
                    await self.close()
                    raise UserError(f"the local socket {name[1:]!r} of this master is taken by another "
                                    f"process ({exc.strerror}); set KVPOOL_LOCAL_SOCKET=0 to serve on "
                                    "TCP only") from None
        return format_addr(self.host, port)

    async def close(self) -> None:
        """Stop accepting connections, close those open (a request waiting in the
        master, e.g. a placement held for a stream, goes unanswered, as when the process
        ends) and stop checking on nodes; returns once all of them have ended (a loop
        stopped right after would otherwise destroy them pending; ``Server.close``
        leaves open connections served)."""
        self._closed = True
        for server in [self._server, *self._local_servers]:
            if server is not None:
                server.close()
        self._server, self._local_servers = None, []
        tasks = list(self._tasks) + list(self._conns)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def tick_forever(self) -> None:
        last = self.service.clock()
        while True:
            await asyncio.sleep(TICK_S)
            now = self.service.clock()
            late, last = now - last - TICK_S, now
            if self.gate() is not None:
                continue  # a standby keeps no state; a fenced leader must change nothing
            try:
                if late > STALL_EXCUSED_S:
                    self.service.excuse_stall(late)
                self.service.tick()
                self._send_index()
                self._close_stale_streams()
                self.close_stalled()
            except Exception:  # upkeep must keep running; the bug is logged
                log.exception("master tick failed")


async def _answers(addr: str) -> bool:
    """Whether a TCP connection to ``addr`` ("host:port") opens within :data:`PROBE_S`
    (it is closed at once); an address that does not parse counts as answering, since
    nothing can be told from it."""
    try:
        host, port = parse_addr(addr)
    except UserError:
        return True
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), PROBE_S)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


def run_event_loop(coro):
    """Run ``coro`` on uvloop when installed (lower latency), else stdlib asyncio;
    returns what it returns."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
