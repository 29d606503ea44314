"""MasterService: the metadata state machine behind every master RPC.

Pure, synchronous logic with no I/O: the asyncio server (``master/server.py``) calls one
handler per decoded request on its single event-loop thread, so no locks are needed.
Every handler returns its reply Struct. Times are seconds of the injected ``clock``
(:func:`time.monotonic` by default; tests pass a fake one). Semantics follow Mooncake Store's
MasterService (mooncake-store/src/master_service.cpp): PutStart/PutEnd/PutRevoke, read
leases granted by reads, OBJECT_HAS_LEASE on removal of a leased object, eviction by
lease deadline that skips leased, pinned and in-flight objects.

Old versions and read grants (kvpool's addition; Mooncake keeps them until the lease
ends): every GetReplicaList hands out a read grant with an id. An upserted-over or
force-removed version's buffers stay allocated (a zombie) only while a grant on that
version is in flight, i.e. neither reported done by its reader (ReadDone) nor expired,
so a reader still copying never sees reused bytes, yet a reader that finished does not
pin the space for the rest of the lease. Grants never shorten the object's lease: a
live object stays unremovable (OBJECT_HAS_LEASE) and unevictable until it ends.
Grants and zombies: :mod:`kvpool.master.leases`; eviction: :mod:`kvpool.master.eviction`;
allocation leases (AllocLease, PutCommit, ReturnLease: a put in one round trip; kvpool's
addition) in :mod:`kvpool.master.alloc_leases`, committing through the same
:meth:`MasterService._commit` as PutEnd.

The counts a stats request reports (visible objects, zombie buffers and bytes) are kept
as they change, so ``stats()`` costs O(segments), not O(objects).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from typing import Callable

from kvpool.errors import ErrorCode
from kvpool.master.alloc_leases import AllocLeases, LeaseHandlers
from kvpool.master.config import MasterConfig
from kvpool.master.eviction import Eviction, EvictionQueue
from kvpool.master.leases import ReadGrants
from kvpool.master.objects import Grants, PendingPut, Replica
from kvpool.master.restore import IndexLog, Restore, SettledKeys
from kvpool.master.segments import SegmentTable, new_epoch
from kvpool.master.table import NO_SEG, ObjectMeta, ObjectTable
from kvpool.protocol import (
    MAX_KEY_BYTES, MAX_SEGMENTS, SOFT_PIN_DISABLE, SOFT_PIN_ENABLE, SOFT_PIN_PRESERVE, BatchGetResp,
    BatchPutStartResp, CodesResp, CommitItem, GetItem, GetResp, IndexEntry, MountResp, PutItem, PutStartResp,
    PutToken, ReplicaDesc, Resp, SegmentInfo, SegmentStats, StatsResp,
)

# Commits remembered (a PutEnd's put id, or a PutCommit item's (lease id, offset, size) -> key),
# so that one resent after its reply was lost (a broken connection; the client's channel
# resends an idempotent request) is answered OK, not "no such put" or "bad range": about
# 1-2 MB, and the keys of objects since removed (2 MB measured with 71-byte keys); a
# resend comes within a reconnect, far fewer commits later
ENDED_PUTS_KEPT = 1 << 13
MIN_SEGMENT_SIZE = 1 << 10  # bytes; Mooncake's MIN_SEGMENT_SIZE: smaller mounts are refused
log = logging.getLogger("kvpool.master")
OK = ErrorCode.OK
_OK = int(OK)  # a plain int: the enum member's lookup would cost per key of a batch
# shared by every miss: replies are never changed
_NOT_FOUND, _MISS = GetResp(ErrorCode.OBJECT_NOT_FOUND), GetItem(ErrorCode.OBJECT_NOT_FOUND)


def _key_ok(key: str) -> bool:
    return 0 < len(key.encode("utf-8")) <= MAX_KEY_BYTES  # msgspec decoded it: valid UTF-8


class MasterService(Eviction, Restore, LeaseHandlers):
    """Objects, replicas, leases, pins, in-flight puts, allocation leases and eviction
    over a SegmentTable.

    ``clock()``: the time in seconds (monotonic); every deadline (leases, pins, grants,
    put timeouts, heartbeats) is measured on it.
    """

    def __init__(self, config: MasterConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config or MasterConfig()
        self.clock = clock
        self.segments = SegmentTable(self.config.allocation_strategy)
        self.objects = ObjectTable()  # key -> record (views of a struct of arrays)
        self.object_count = 0  # visible objects, kept as replicas come and go
        self.queue = EvictionQueue(self.objects)
        self.grants = ReadGrants(self._free, self.segments.rounded, first_id=new_epoch(),
                                 idle=self.objects.drop_grants)
        self.counters: Counter[str] = Counter()
        # random per start, so that no id of an earlier incarnation means anything here
        # (a stale PutEnd or ReadDone would otherwise commit or end another's put or grant)
        self.incarnation = new_epoch()
        self._next_put_id = new_epoch()
        self.in_flight: set[str] = set()  # keys with a pending put (tick scans only these)
        self._ended: OrderedDict[object, str] = OrderedDict()  # the last ENDED_PUTS_KEPT commits
        self.wants_eviction = False
        self._eviction_debt = 0
        self.index_log = IndexLog()  # changes for the nodes' indexes (master/restore.py)
        self._last_version = 0
        self._settled: SettledKeys | None = SettledKeys()  # keys no late mount restores (master/restore.py)
        self._restore_until: float | None = None
        self.lead_began: float | None = None  # the lead's first tick (service clock; restore.py)
        self.alloc_leases = AllocLeases(self.segments.alignment, first_id=new_epoch())

    # ------------------------------------------------------------ inspection (admin)

    def lookup(self, key: str) -> ObjectMeta | None:
        """The record of ``key`` (visible or only a pending put), or None; read-only for
        the caller. Grants no lease and leaves the eviction order alone."""
        return self.objects.get(key)

    def _set_replicas(self, obj: ObjectMeta, replicas: list[Replica]) -> None:
        """Give ``obj`` its COMPLETE replicas (empty: invisible), keeping the count."""
        self.object_count += bool(replicas) - obj.visible
        obj.replicas = replicas

    def _forget(self, obj: ObjectMeta) -> None:
        """Drop ``obj``'s record (its buffers are already freed or held)."""
        self.object_count -= obj.visible
        del self.objects[obj.key]

    # ------------------------------------------------------------ segments, liveness

    def mount(self, owner_id: str, info: SegmentInfo, index: bool = False, objects: list[IndexEntry] = (),
              prev_incarnation: int = 0) -> MountResp:
        """Mount ``info`` for ``owner_id`` under a new mount epoch. ``index``: the node
        keeps an index (changes are queued in ``index_log``); ``objects``: that index,
        rebuilt unless this very incarnation mounted the segment before
        (``prev_incarnation``) and so dropped it on purpose (master/restore.py)."""
        if not info.name or info.size < MIN_SEGMENT_SIZE or not owner_id:
            return MountResp(ErrorCode.INVALID_PARAMS)
        fresh = info.name not in self.segments.segments
        if fresh and len(self.segments.segments) >= MAX_SEGMENTS:
            log.warning("refused segment %s of %s: %d segments are mounted", info.name, owner_id, MAX_SEGMENTS)
            return MountResp(ErrorCode.INVALID_PARAMS)  # totals must stay encodable
        seg = self.segments.mount(owner_id, info, self.clock())
        if seg is None:
            return MountResp(ErrorCode.SEGMENT_ALREADY_EXISTS)
        dropped: list[str] = []
        if fresh:
            self.index_log.resyncs.pop(info.name, None)  # one left by an earlier mount of the name
            seg.indexed = index
            if prev_incarnation == self.incarnation:
                dropped = [e.key for e in objects]
            elif objects:
                dropped = self.restore(seg, objects)
                self.counters["objects_restored"] += len(objects) - len(dropped)
        elif index and seg.indexed:
            dropped = self.resync(info.name, objects)
            self.counters["index_resyncs"] += 1
        self.counters["segments_mounted"] += 1
        log.info("mounted segment %s (%d bytes, owner %s, data %s, %d objects %s)", info.name, info.size,
                 owner_id, info.data_addr, len(objects) - len(dropped), "restored" if fresh else "kept")
        interval_ms = max(50, int(self.config.client_ttl_s * 1000 / 4))
        return MountResp(OK, interval_ms, seg.info.epoch, self.incarnation, dropped)

    def heartbeat(self, owner_id: str) -> Resp:
        if owner_id not in self.segments.last_seen:
            return Resp(ErrorCode.CLIENT_NOT_FOUND)
        self.segments.last_seen[owner_id] = self.clock()
        return Resp(OK)

    def unmount(self, owner_id: str, name: str) -> Resp:
        seg = self.segments.segments.get(name)
        if seg is None:
            return Resp(ErrorCode.SEGMENT_NOT_FOUND)
        if seg.owner_id != owner_id:
            return Resp(ErrorCode.ILLEGAL_CLIENT)
        self._drop_segment(name)
        return Resp(OK)

    def stream_lost(self, name: str, epoch: int, why: str = "index stream closed, data port closed") -> None:
        """The index stream of segment ``name``'s mount ``epoch`` closed without a new
        mount taking its place, and its node's data port refuses connections (the node
        died), or it did not mount again in time (``why`` says which, for the log).
        Withhold the segment from placement (segments.py) until it mounts again or its
        owner times out."""
        seg = self.segments.segments.get(name)
        if seg is not None and seg.info.epoch == epoch and self.segments.withhold(name):
            self.counters["segments_withheld"] += 1
            log.warning("node of segment %s is gone (%s): placing no new buffers on it until it mounts again "
                        "(its objects stay until owner %s times out)", name, why, seg.owner_id)

    def _drop_segment(self, name: str) -> None:
        """Unmount ``name``: every replica on it disappears; emptied objects go."""
        self.segments.unmount(name)
        self.index_log.resyncs.pop(name, None)
        self.counters["segments_unmounted"] += 1
        log.info("unmounted segment %s", name)
        self.grants.drop_segment(name)
        self.alloc_leases.drop_segment(name)
        for obj in self.objects.on_segment(name):
            self._set_replicas(obj, [r for r in obj.replicas if r.segment != name])
            if obj.pending and any(r.segment == name for r in obj.pending.replicas):
                self._free(obj.pending.replicas)  # the write can no longer be whole
                self._clear_pending(obj)
            if not obj.replicas and obj.pending is None:
                self._forget(obj)
        self.objects.forget_segment(name)

    # ------------------------------------------------------------ put

    def _soft_pin_ttl(self, item: PutItem | CommitItem) -> int | None:
        """The soft-pin TTL (ms) the commit applies, or None when the request is invalid:
        a TTL needs ENABLE, and at most ``max_soft_pin_ttl_ms`` (Mooncake's rules)."""
        if item.soft_pin not in (SOFT_PIN_PRESERVE, SOFT_PIN_ENABLE, SOFT_PIN_DISABLE):
            return None
        if item.soft_pin != SOFT_PIN_ENABLE:
            return 0 if item.soft_pin_ttl_ms < 0 else None
        ttl = self.config.soft_pin_ttl_ms if item.soft_pin_ttl_ms < 0 else item.soft_pin_ttl_ms
        return ttl if ttl <= self.config.max_soft_pin_ttl_ms else None

    def put_start(self, item: PutItem, host_id: str = "") -> PutStartResp:
        if item.size <= 0:
            return PutStartResp(ErrorCode.INVALID_PARAMS, message="empty value")
        if not 1 <= item.replica_num <= self.config.max_replicas:
            return PutStartResp(ErrorCode.INVALID_PARAMS, message=f"replica_num {item.replica_num} is "
                                f"not in 1..{self.config.max_replicas} (the master's --max-replicas)")
        soft_pin_ttl = self._soft_pin_ttl(item)
        if soft_pin_ttl is None:
            return PutStartResp(ErrorCode.INVALID_PARAMS, message=(
                "a soft-pin TTL needs soft pin ENABLE and at most the master's --max-soft-pin-ttl "
                f"({self.config.max_soft_pin_ttl_ms} ms)"))
        now = self.clock()
        code = self._admit(item.key, item.upsert, now)
        if code != OK:
            return PutStartResp(code)
        replicas = self._allocate(item, host_id)
        obj = self.objects.get(item.key)  # eviction may have taken an upsert's old value
        if not replicas:
            if obj is not None and not obj.visible and obj.pending is None:
                self._forget(obj)
            self.counters["put_no_space"] += 1
            return PutStartResp(ErrorCode.NO_AVAILABLE_HANDLE, message=self.no_space_message(item.size, now))
        if obj is None:
            obj = self.objects.create(item.key)
        put_id, self._next_put_id = self._next_put_id, self._next_put_id + 1
        obj.pending = PendingPut(put_id, item.size, replicas, now, item.soft_pin, soft_pin_ttl, item.hard_pin)
        self.in_flight.add(item.key)
        self.counters["put_start"] += 1
        return PutStartResp(OK, put_id, [self._desc(r) for r in replicas])

    @staticmethod
    def _key_code(key: str) -> ErrorCode:
        """OK for a valid key, else INVALID_PARAMS (:func:`_key_ok`)."""
        return OK if _key_ok(key) else ErrorCode.INVALID_PARAMS

    def _admit(self, key: str, upsert: bool, now: float) -> ErrorCode:
        """Whether a new version of ``key`` may be written (PutStart, PutCommit):
        INVALID_PARAMS (bad key), OBJECT_ALREADY_EXISTS (visible and not ``upsert``, or
        another put in flight), REPLICA_IS_NOT_READY (an upsert while a put is in
        flight), else OK, having taken over a put in flight past the discard timeout."""
        code = self._key_code(key)
        if code != OK:
            return code
        obj = self.objects.get(key)
        if obj is not None:
            if obj.visible and not upsert:
                return ErrorCode.OBJECT_ALREADY_EXISTS
            if obj.pending is not None:
                if now - obj.pending.started < self.config.put_start_discard_timeout_s:
                    return ErrorCode.REPLICA_IS_NOT_READY if upsert else ErrorCode.OBJECT_ALREADY_EXISTS
                self._discard_pending(obj)
        return OK

    def put_end(self, token: PutToken) -> Resp:
        """Commit the put ``token`` names: OK, also for a PutEnd of this incarnation
        committed among the last ENDED_PUTS_KEPT (a resend whose reply was lost: the
        value is stored, whatever came after); else OBJECT_NOT_FOUND or INVALID_WRITE
        (no such put in flight: discarded, revoked, or an earlier incarnation's)."""
        if self._committed_before(token.put_id, token.key):
            return Resp(OK)
        obj = self.objects.get(token.key)
        if obj is None:
            return Resp(ErrorCode.OBJECT_NOT_FOUND)
        pending = obj.pending
        if pending is None or pending.put_id != token.put_id:
            return Resp(ErrorCode.INVALID_WRITE, "no such put in flight (discarded or ended)")
        self._clear_pending(obj)
        self._commit(obj, pending.replicas, pending.size, pending.soft_pin, pending.soft_pin_ttl_ms,
                     pending.hard_pin, self.clock())
        self._remember_commits([(token.put_id, obj.key)])
        self._check_watermark()
        self.counters["put_end"] += 1
        return Resp(OK)

    def _remember_commits(self, done: list[tuple[object, str]]) -> None:
        """Keep each ``(ref, key)`` of ``done`` (ref: a put id, or a PutCommit item's
        (lease id, offset, size)) as committed for ``key`` (the table's own string: no
        second copy while its object lives), the last ENDED_PUTS_KEPT of them."""
        ended = self._ended
        for ref, key in done:
            ended[ref] = key
        while len(ended) > ENDED_PUTS_KEPT:
            ended.popitem(last=False)

    def _committed_before(self, ref: object, key: str) -> bool:
        """Whether ``ref`` is a commit of ``key`` this incarnation applied (among the
        last ENDED_PUTS_KEPT): a resend, to answer OK whatever came after. Counted as
        ``commits_repeated``: the server then lets the reply wait for every index
        update still in its memory, the first send's among them."""
        if self._ended.get(ref) != key:
            return False
        self.counters["commits_repeated"] += 1
        return True

    def _commit(self, obj: ObjectMeta, replicas: list[Replica], size: int, soft_pin: int, soft_pin_ttl_ms: int,
                hard_pin: bool, now: float) -> None:
        """Make ``replicas`` (``size`` value bytes, written) ``obj``'s COMPLETE version
        (PutEnd, PutCommit): the old one retired, a new commit version, the index told,
        the pins applied (``soft_pin_ttl_ms`` resolved), the eviction order updated.
        The caller checks the eviction watermark (once per request)."""
        if obj.visible:  # an upsert's old value: out of readers' reach
            self._index_drop(obj)
            self._retire(obj)
        self._settle(obj.key)
        self._set_replicas(obj, replicas)
        obj.size = size
        obj.version = self._next_version()
        self._index_add(obj)
        obj.lease_deadline = max(obj.lease_deadline, now)  # eviction order: put counts as use
        obj.hard_pin = hard_pin
        obj.soft_pin_deadline = self._soft_pin_deadline(obj.soft_pin_deadline, soft_pin, soft_pin_ttl_ms, now)
        self.queue.push(obj)

    def _commit_new(self, key: str, replica: Replica, soft_pin: int, soft_pin_ttl_ms: int, hard_pin: bool,
                    now: float) -> None:
        """:meth:`_commit` of a key that has no record (the common put), its record made
        whole in one step: measured 8.5 -> 5.5 us of master time per item of a batch."""
        version = self._next_version()
        self._settle(key)
        pin = self._soft_pin_deadline(0.0, soft_pin, soft_pin_ttl_ms, now)
        slot = self.objects.create_complete(key, replica, version, now, pin, hard_pin)
        self.object_count += 1
        self._index_replica(key, replica, replica.length, version)
        self.queue.push_slot(slot)

    def _commit_new_run(self, segment: str, items: list[CommitItem], now: float) -> None:
        """:meth:`_commit_new` of every item of ``items``: keys with no record, none
        twice, no pin, each value at ``item.offset`` of ``segment`` (written there).
        Consecutive versions, one index-log update, records appended in one step."""
        keys = [item.key for item in items]
        offsets = [item.offset for item in items]
        sizes = [item.size for item in items]
        version = self._next_version(len(items))
        self._settle_many(keys)
        slots = self.objects.create_complete_run(keys, segment, offsets, sizes, now, version)
        self.object_count += len(slots)
        seg = self.segments.segments.get(segment)
        if seg is not None and seg.indexed:
            self.index_log.add_many(segment, [IndexEntry(key, offset, size, version + i) for i, (key, offset, size)
                                              in enumerate(zip(keys, offsets, sizes))])
        push = self.queue.push_slot
        for slot in slots:
            push(slot)

    @staticmethod
    def _soft_pin_deadline(current: float, soft_pin: int, soft_pin_ttl_ms: int, now: float) -> float:
        """Mooncake's commit of a put's SoftPinAction, given the ``current`` pin deadline
        (0: none): PRESERVE keeps an unexpired pin (an upsert keeps it; a new object has
        none), ENABLE sets now + TTL (a TTL of 0 clears it), DISABLE clears it."""
        if soft_pin == SOFT_PIN_ENABLE:
            return now + soft_pin_ttl_ms / 1000 if soft_pin_ttl_ms else 0.0
        if soft_pin == SOFT_PIN_PRESERVE and current > now:
            return current
        return 0.0

    def put_revoke(self, token: PutToken) -> Resp:
        obj = self.objects.get(token.key)
        if obj is None:
            return Resp(ErrorCode.OBJECT_NOT_FOUND)
        if obj.pending is None or obj.pending.put_id != token.put_id:
            return Resp(ErrorCode.INVALID_WRITE, "no such put in flight (discarded or ended)")
        self._free(obj.pending.replicas)
        self._clear_pending(obj)
        if not obj.visible:
            self._forget(obj)
        self.counters["put_revoke"] += 1
        return Resp(OK)

    def batch_put_start(self, items: list[PutItem], host_id: str = "") -> BatchPutStartResp:
        return BatchPutStartResp([self.put_start(i, host_id) for i in items])

    def batch_put_end(self, tokens: list[PutToken]) -> CodesResp:
        return CodesResp([self.put_end(t).code for t in tokens])

    def batch_put_revoke(self, tokens: list[PutToken]) -> CodesResp:
        return CodesResp([self.put_revoke(t).code for t in tokens])

    def _clear_pending(self, obj: ObjectMeta) -> None:
        obj.pending = None
        self.in_flight.discard(obj.key)

    def _discard_pending(self, obj: ObjectMeta) -> None:
        """Take over a stale put: its buffers return only after the release timeout,
        because the dead writer might still be writing into them."""
        pending = obj.pending
        self.grants.hold_until(pending.replicas, pending.started + self.config.put_start_release_timeout_s)
        self._clear_pending(obj)
        self.counters["put_discarded"] += 1

    # ------------------------------------------------------------ periodic upkeep

    def excuse_stall(self, seconds: float) -> None:
        """The master's own loop did not run for ``seconds`` (stopped, frozen, a long
        pause): the heartbeats sent meanwhile wait unread in its sockets, so that time
        does not count against any owner. Without this, a master paused past the client
        TTL unmounted every live node and dropped all their objects (a node re-mounting
        after a TTL drop is not restored from its index, on purpose: docs/store.md)."""
        self.segments.excuse(seconds)
        self.counters["stalls_excused"] += 1
        log.warning("the master did not run for %.1f s (stopped or paused?): node heartbeats "
                    "went unread meanwhile, so no node is timed out for that time", seconds)

    def tick(self) -> None:
        """Expire silent owners, grants and zombies, drop dead puts, evict above watermark."""
        now = self.clock()
        self._restore_tick(now)
        for owner in self.segments.expired_owners(now, self.config.client_ttl_s):
            for name in self.segments.owned_by(owner):
                self._drop_segment(name)
            self.segments.last_seen.pop(owner, None)
            self.counters["owners_expired"] += 1
            log.warning("owner %s sent no heartbeat for %.1f s: its segments are unmounted",
                        owner, self.config.client_ttl_s)
        self.counters["read_grants_expired"] += self.grants.expire(now)
        self._expire_leases(now)
        self.grants.free_due(now)
        release = self.config.put_start_release_timeout_s
        stale = [self.objects[k] for k in self.in_flight if now - self.objects[k].pending.started > release]
        for obj in stale:
            self._free(obj.pending.replicas)
            self._clear_pending(obj)
            self.counters["put_released"] += 1
            if not obj.visible:
                self._forget(obj)
        low = self.config.eviction_high_watermark_ratio - self.config.eviction_ratio
        if self.wants_eviction and self._used_ratio() < low:
            # the rest of a pass spread over ticks is moot once removals emptied the
            # segments below the level a whole pass aims at (Mooncake's target)
            self.wants_eviction, self._eviction_debt = False, 0
        self._check_watermark()
        if self.wants_eviction:
            self.evict_pass()

    def _free(self, replicas: list[Replica]) -> None:
        for r in replicas:
            self.segments.free(r)

    def _retire(self, obj: ObjectMeta) -> None:
        """Take ``obj``'s current version out of readers' reach (upsert, removal): its
        buffers are freed now, or, while reads granted on it are in flight, kept as a
        zombie until the last of them is done or expired. New reads get a new Grants."""
        grants, obj.grants = obj.grants, Grants()
        self.grants.retire(obj.replicas, grants, self.clock())

    def read_done(self, grant_ids: list[int]) -> None:
        """Readers finished the reads of ``grant_ids``: an old version none of whose
        grants is open any more is freed now. The object's lease is left as it is.
        Unknown ids (expired, repeated, never granted) are ignored. A notification: no
        reply."""
        self.counters["reads_done"] += self.grants.done(grant_ids)

    # ------------------------------------------------------------ reads

    def get_replica_list(self, key: str) -> GetResp:
        reply = self._gets([key])
        item = reply.results[0]
        if item.code != OK:
            return _NOT_FOUND
        return GetResp(OK, item.size, reply.lease_ttl_ms, reply.replicas(item), item.grant_id, item.version)

    def batch_get_replica_list(self, keys: list[str]) -> BatchGetResp:
        return self._gets(keys)

    def _gets(self, keys: list[str]) -> BatchGetResp:
        """A read grant on each key: its replicas, under a lease extended to one deadline
        (one clock read for the batch; never shortened). One loop over the table's
        arrays with every lookup bound once and no record view: the Python calls per key
        are the grant's and the eviction queue's touch. Each segment is named once in
        the reply, the keys pointing at it by index. This is the master's share of every
        get (docs/bench.md, "A batch read is one loop in the master")."""
        ttl_ms, deadline = self._lease_terms()
        t = self.objects
        find, seg, more, lease, size, offset = t.slots.get, t.seg, t.more, t.lease, t.size, t.offset
        version, names, touch = t.version, t.seg_names, self.queue.touch
        grant, open_grants, grants_of = self.grants.grant, t.grants.get, t.grants_of
        segments: list[SegmentInfo] = []
        index: dict[str, int] = {}  # segment name -> its place in ``segments``
        out: list[GetItem] = []
        missed = 0
        for key in keys:
            slot = find(key, -1)
            if slot < 0:
                out.append(_MISS)
                missed += 1
                continue
            sid = seg[slot]
            if sid != NO_SEG:  # one replica, the common case
                at = index.get(names[sid])
                if at is None:
                    at = self._segment_index(names[sid], index, segments)
                places = [(at, offset[slot])]
            elif slot in more:
                places = [(self._segment_index(r.segment, index, segments), r.offset) for r in more[slot]]
            else:  # only a put in flight: invisible
                out.append(_MISS)
                missed += 1
                continue
            if deadline > lease[slot]:
                lease[slot] = deadline
                touch(slot)
            grants = open_grants(slot) or grants_of(slot)
            out.append(GetItem(_OK, size[slot], places, grant(grants, deadline), version[slot]))
        self.counters["leases_granted"] += len(out) - missed
        return BatchGetResp(segments, ttl_ms, out)

    def _segment_index(self, name: str, index: dict[str, int], segments: list[SegmentInfo]) -> int:
        """The place of segment ``name`` in a batch reply's ``segments`` (added if new)."""
        at = index.get(name)
        if at is None:
            at = index[name] = len(segments)
            segments.append(self.segments.segments[name].info)
        return at

    def exist_key(self, key: str) -> Resp:
        return Resp(self._exists([key])[0])

    def batch_exist_key(self, keys: list[str]) -> CodesResp:
        return CodesResp(self._exists(keys))

    def _exists(self, keys: list[str]) -> list[int]:
        """OK (its lease extended to one deadline) or OBJECT_NOT_FOUND per key, in one
        loop with its lookups bound once (as :meth:`_gets`)."""
        deadline = self._lease_terms()[1]
        t = self.objects
        find, seg, more, lease, touch = t.slots.get, t.seg, t.more, t.lease, self.queue.touch
        codes: list[int] = []
        for key in keys:
            slot = find(key, -1)
            if slot < 0 or (seg[slot] == NO_SEG and slot not in more):
                codes.append(ErrorCode.OBJECT_NOT_FOUND)
                continue
            if deadline > lease[slot]:
                lease[slot] = deadline
                touch(slot)
            codes.append(OK)
        self.counters["leases_granted"] += codes.count(OK)
        return codes

    def _lease_terms(self) -> tuple[int, float]:
        """The read lease a get or exist grants now: (TTL in ms, deadline in monotonic s)."""
        ttl_ms = self.config.default_kv_lease_ttl_ms
        return ttl_ms, self.clock() + ttl_ms / 1000

    def _desc(self, r: Replica) -> ReplicaDesc:
        """What a client is told of replica ``r``."""
        return ReplicaDesc(self.segments.segments[r.segment].info, r.offset, r.length)

    # ------------------------------------------------------------ removal, pins

    def remove(self, key: str, force: bool = False) -> Resp:
        obj = self.objects.get(key)
        if obj is None or not obj.visible:
            return Resp(ErrorCode.OBJECT_NOT_FOUND)
        if obj.leased(self.clock()) and not force:
            return Resp(ErrorCode.OBJECT_HAS_LEASE)
        # a forced removal keeps the buffers while a reader may still be copying them
        self._settle(key)
        self._index_drop(obj)
        self._retire(obj)
        self._set_replicas(obj, [])
        if obj.pending is None:
            self._forget(obj)
        self.counters["removed_objects"] += 1
        return Resp(OK)

    def batch_remove(self, keys: list[str], force: bool = False) -> CodesResp:
        return CodesResp([self.remove(k, force).code for k in keys])

    def set_pin(self, key: str, mode: str) -> Resp:
        obj = self.objects.get(key)
        if obj is None or not obj.visible:
            return Resp(ErrorCode.OBJECT_NOT_FOUND)
        if mode not in ("none", "soft", "hard"):
            return Resp(ErrorCode.INVALID_PARAMS, "pin mode must be none, soft or hard")
        obj.hard_pin = mode == "hard"
        obj.soft_pin_deadline = self.clock() + self.config.soft_pin_ttl_ms / 1000 if mode == "soft" else 0.0
        self.queue.push(obj)  # an unpinned object re-enters the eviction order
        return Resp(OK)

    # ------------------------------------------------------------ stats

    def ping(self) -> Resp:
        """A round trip that touches no metadata."""
        return Resp(OK)

    def stats(self) -> StatsResp:
        """Counts and segments: O(segments), no scan of the objects."""
        segs = [
            SegmentStats(n, s.owner_id, s.allocator.capacity, s.allocator.used, s.info.data_addr,
                         n in self.segments.withheld, n in self.segments.lagging)
            for n, s in self.segments.segments.items()
        ]
        return StatsResp(
            object_count=self.object_count,
            used_bytes=self.segments.used_bytes,
            total_bytes=self.segments.total_bytes,
            segments=segs,
            counters=dict(self.counters),
            owner_count=len(self.segments.last_seen),
            in_flight_puts=len(self.in_flight),
            zombie_buffers=self.grants.zombie_buffers,
            zombie_bytes=self.grants.zombie_bytes,
            open_grants=len(self.grants.open),
            open_leases=len(self.alloc_leases.open),
            leased_bytes=self.alloc_leases.leased_bytes,
        )
