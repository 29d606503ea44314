"""MasterService: the metadata state machine behind every master RPC.

Pure, synchronous logic with no I/O: the asyncio server (``master/server.py``) calls one
handler per decoded request on its single event-loop thread, so no locks are needed.
Times are :func:`time.monotonic` seconds. Semantics follow Mooncake Store's
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
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import Counter, OrderedDict

from kvpool.errors import ErrorCode
from kvpool.master.config import MasterConfig
from kvpool.master.eviction import EvictionQueue
from kvpool.master.objects import Grants, ObjectMeta, PendingPut, Replica, Zombie
from kvpool.master.segments import SegmentTable
from kvpool.protocol import (
    MAX_KEY_BYTES, SOFT_PIN_DISABLE, SOFT_PIN_ENABLE, SOFT_PIN_PRESERVE, CodesResp, CountResp, GetResp,
    MountResp, PutItem, PutStartResp, PutToken, ReplicaDesc, Resp, SegmentInfo, SegmentStats,
    StatsResp,
)

MIN_SEGMENT_SIZE = 1 << 10  # bytes; Mooncake's MIN_SEGMENT_SIZE: smaller mounts are refused
log = logging.getLogger("kvpool.master")
OK = ErrorCode.OK


def _key_ok(key: str) -> bool:
    return 0 < len(key.encode("utf-8")) <= MAX_KEY_BYTES  # msgspec decoded it: valid UTF-8


def _adds_room(obj: ObjectMeta, room: dict[str, int], need: int, rounded) -> bool:
    """Count ``obj``'s buffers into ``room``; True if one of its segments now reaches ``need``."""
    for r in obj.replicas:
        room[r.segment] = room.get(r.segment, 0) + rounded(r.length)
    return any(room.get(r.segment, 0) >= need for r in obj.replicas)


class MasterService:
    """Objects, replicas, leases, pins, in-flight puts and eviction over a SegmentTable."""

    def __init__(self, config: MasterConfig | None = None):
        self.config = config or MasterConfig()
        self.segments = SegmentTable(self.config.allocation_strategy)
        self.objects: dict[str, ObjectMeta] = {}
        self.queue = EvictionQueue(self.objects)
        # buffers no longer reachable but maybe still read or written (an ordered set)
        self.zombies: dict[Zombie, None] = {}
        # read grants neither done nor expired: id -> (deadline, the version's Grants);
        # in grant order, which is deadline order (one TTL for all), so expiry pops the front
        self.grants: OrderedDict[int, tuple[float, Grants]] = OrderedDict()
        self._next_grant_id = 1
        self.counters: Counter[str] = Counter()
        self._next_put_id = 1
        self.in_flight: set[str] = set()  # keys with a pending put (tick scans only these)
        self.wants_eviction = False
        self._eviction_debt = 0  # objects the current eviction pass still has to free

    # ------------------------------------------------------------ segments, liveness

    def mount(self, owner_id: str, info: SegmentInfo) -> MountResp:
        if not info.name or info.size < MIN_SEGMENT_SIZE or not owner_id:
            return MountResp(ErrorCode.INVALID_PARAMS)
        if not self.segments.mount(owner_id, info, time.monotonic()):
            return MountResp(ErrorCode.SEGMENT_ALREADY_EXISTS)
        self.counters["segments_mounted"] += 1
        log.info("mounted segment %s (%d bytes, owner %s, data %s)", info.name, info.size, owner_id, info.data_addr)
        interval_ms = max(50, int(self.config.client_ttl_s * 1000 / 4))
        return MountResp(OK, interval_ms)

    def heartbeat(self, owner_id: str) -> Resp:
        if owner_id not in self.segments.last_seen:
            return Resp(ErrorCode.CLIENT_NOT_FOUND)
        self.segments.last_seen[owner_id] = time.monotonic()
        return Resp(OK)

    def unmount(self, owner_id: str, name: str) -> Resp:
        seg = self.segments.segments.get(name)
        if seg is None:
            return Resp(ErrorCode.SEGMENT_NOT_FOUND)
        if seg.owner_id != owner_id:
            return Resp(ErrorCode.ILLEGAL_CLIENT)
        self._drop_segment(name)
        return Resp(OK)

    def _drop_segment(self, name: str) -> None:
        """Unmount ``name``: every replica on it disappears; emptied objects go."""
        self.segments.unmount(name)
        self.counters["segments_unmounted"] += 1
        log.info("unmounted segment %s", name)
        for z in list(self.zombies):
            z.replicas = [r for r in z.replicas if r.segment != name]
            if not z.replicas:
                del self.zombies[z]
        for key in list(self.objects):
            obj = self.objects[key]
            obj.replicas = [r for r in obj.replicas if r.segment != name]
            if obj.pending and any(r.segment == name for r in obj.pending.replicas):
                self._free(obj.pending.replicas)  # the write can no longer be whole
                self._clear_pending(obj)
            if not obj.replicas and obj.pending is None:
                del self.objects[key]

    # ------------------------------------------------------------ put

    def _soft_pin_ttl(self, item: PutItem) -> int | None:
        """The soft-pin TTL (ms) PutEnd applies, or None when the request is invalid:
        a TTL needs ENABLE, and at most ``max_soft_pin_ttl_ms`` (Mooncake's rules)."""
        if item.soft_pin not in (SOFT_PIN_PRESERVE, SOFT_PIN_ENABLE, SOFT_PIN_DISABLE):
            return None
        if item.soft_pin != SOFT_PIN_ENABLE:
            return 0 if item.soft_pin_ttl_ms < 0 else None
        ttl = self.config.soft_pin_ttl_ms if item.soft_pin_ttl_ms < 0 else item.soft_pin_ttl_ms
        return ttl if ttl <= self.config.max_soft_pin_ttl_ms else None

    def put_start(self, item: PutItem, host_id: str = "") -> PutStartResp:
        if not _key_ok(item.key) or item.size <= 0 or not 1 <= item.replica_num <= self.config.max_replicas:
            return PutStartResp(ErrorCode.INVALID_PARAMS)
        soft_pin_ttl = self._soft_pin_ttl(item)
        if soft_pin_ttl is None:
            return PutStartResp(ErrorCode.INVALID_PARAMS)
        now = time.monotonic()
        obj = self.objects.get(item.key)
        if obj is not None:
            if obj.visible and not item.upsert:
                return PutStartResp(ErrorCode.OBJECT_ALREADY_EXISTS)
            if obj.pending is not None:
                if now - obj.pending.started < self.config.put_start_discard_timeout_s:
                    code = ErrorCode.REPLICA_IS_NOT_READY if item.upsert else ErrorCode.OBJECT_ALREADY_EXISTS
                    return PutStartResp(code)
                self._discard_pending(obj)
        replicas = self._allocate(item, host_id)
        obj = self.objects.get(item.key)  # eviction may have taken an upsert's old value
        if not replicas:
            if obj is not None and not obj.visible and obj.pending is None:
                del self.objects[item.key]
            self.counters["put_no_space"] += 1
            return PutStartResp(ErrorCode.NO_AVAILABLE_HANDLE, message=self._no_space_message(item.size, now))
        if obj is None:
            obj = self.objects[item.key] = ObjectMeta(item.key)
        put_id, self._next_put_id = self._next_put_id, self._next_put_id + 1
        obj.pending = PendingPut(put_id, item.size, replicas, now, item.soft_pin, soft_pin_ttl, item.hard_pin)
        self.in_flight.add(item.key)
        self.counters["put_start"] += 1
        return PutStartResp(OK, put_id, [self._desc(r) for r in replicas])

    def put_end(self, token: PutToken) -> Resp:
        obj = self.objects.get(token.key)
        if obj is None:
            return Resp(ErrorCode.OBJECT_NOT_FOUND)
        pending = obj.pending
        if pending is None or pending.put_id != token.put_id:
            return Resp(ErrorCode.INVALID_WRITE, "no such put in flight (discarded or ended)")
        now = time.monotonic()
        self._retire(obj)  # an upsert's old value
        obj.replicas, obj.size = pending.replicas, pending.size
        self._clear_pending(obj)
        obj.lease_deadline = max(obj.lease_deadline, now)  # eviction order: put counts as use
        obj.hard_pin = pending.hard_pin
        obj.soft_pin_deadline = self._soft_pin_deadline(obj, pending, now)
        self.queue.push(obj)
        self.counters["put_end"] += 1
        self._check_watermark()
        return Resp(OK)

    @staticmethod
    def _soft_pin_deadline(obj: ObjectMeta, pending: PendingPut, now: float) -> float:
        """Mooncake's commit of a put's SoftPinAction: PRESERVE keeps an unexpired pin
        (an upsert keeps it; a new object has none), ENABLE sets now + TTL (a TTL of 0
        clears it), DISABLE clears it."""
        if pending.soft_pin == SOFT_PIN_ENABLE:
            return now + pending.soft_pin_ttl_ms / 1000 if pending.soft_pin_ttl_ms else 0.0
        if pending.soft_pin == SOFT_PIN_PRESERVE and obj.soft_pin_deadline > now:
            return obj.soft_pin_deadline
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
            del self.objects[token.key]
        self.counters["put_revoke"] += 1
        return Resp(OK)

    def _clear_pending(self, obj: ObjectMeta) -> None:
        obj.pending = None
        self.in_flight.discard(obj.key)

    def _discard_pending(self, obj: ObjectMeta) -> None:
        """Take over a stale put: its buffers return only after the release timeout,
        because the dead writer might still be writing into them."""
        pending = obj.pending
        self.zombies[Zombie(pending.replicas, pending.started + self.config.put_start_release_timeout_s)] = None
        self._clear_pending(obj)
        self.counters["put_discarded"] += 1

    # ------------------------------------------------------------ allocation, eviction

    def _allocate(self, item: PutItem, host_id: str) -> list[Replica]:
        """Buffers for ``item``; on failure evict, in eviction order, only objects whose
        space could make it fit, and nothing at all if no eviction could (K10)."""
        replicas = self.segments.allocate(item.size, item.replica_num, host_id, item.preferred_segment)
        while not replicas and self._make_room(item.size):
            replicas = self.segments.allocate(item.size, item.replica_num, host_id, item.preferred_segment)
        return replicas

    def _make_room(self, size: int) -> bool:
        """Evict due objects (unpinned first, then soft-pinned) on a segment where their
        space plus the free space reaches ``size``, stopping once an allocation would
        fit. Returns False, having evicted nothing, when no eviction can reach it."""
        need = self.segments.rounded(size)
        segs = self.segments.segments
        if not any(s.allocator.capacity >= need for s in segs.values()):
            return False
        now = time.monotonic()
        room = {n: s.allocator.capacity - s.allocator.used for n, s in segs.items()}
        candidates, soft, keep = [], [], []
        for obj in self.queue.pop_due(now):
            if obj.pending is not None:
                keep.append(obj)
            elif obj.soft_pinned(now):
                soft.append(obj)
            else:
                candidates.append(obj)
                if _adds_room(obj, room, need, self.segments.rounded):
                    break
        else:  # unpinned objects were not enough: soft-pinned ones, in order
            for i, obj in enumerate(soft):
                candidates.append(obj)
                if _adds_room(obj, room, need, self.segments.rounded):
                    keep.extend(soft[i + 1:])
                    break
            else:
                keep.extend(candidates)  # futile: evict nothing
                candidates = []
            soft = []
        keep.extend(soft)
        useful = {n for n, free in room.items() if free >= need}
        evicted = 0
        for i, obj in enumerate(candidates):
            if not any(r.segment in useful for r in obj.replicas):
                keep.append(obj)
                continue
            self._evict(obj)
            evicted += 1
            if any(segs[n].allocator.largest_free >= need for n in useful):
                keep.extend(candidates[i + 1:])
                break
        for obj in keep:
            self.queue.push(obj)
        return evicted > 0

    def _evict(self, obj: ObjectMeta) -> None:
        self._free(obj.replicas)  # its lease ended, and with it every grant on it
        self.counters["evicted_objects"] += 1
        self.counters["evicted_bytes"] += obj.size
        del self.objects[obj.key]

    def _used_ratio(self) -> float:
        total = self.segments.total_bytes
        return self.segments.used_bytes / total if total else 0.0

    def _check_watermark(self) -> None:
        if self._used_ratio() > self.config.eviction_high_watermark_ratio:
            self.wants_eviction = True

    def evict_pass(self, limit: int = 2000) -> int:
        """One eviction pass: free ``eviction_ratio`` of the objects (at least one) whose
        lease ended, oldest deadline first; soft-pinned ones only in a second pass;
        hard-pinned and in-flight ones never. At most ``limit`` objects per call, so the
        event loop is never held long; the rest of the pass runs on the next ticks.
        Returns the number evicted."""
        if self._eviction_debt <= 0:
            self._eviction_debt = max(1, math.ceil(self.config.eviction_ratio * len(self.objects)))
        target = min(self._eviction_debt, limit)
        now = time.monotonic()
        evicted, soft, keep = 0, [], []
        for obj in self.queue.pop_due(now):
            if obj.pending is not None:
                keep.append(obj)
            elif obj.soft_pinned(now):
                soft.append(obj)
            else:
                self._evict(obj)
                evicted += 1
                if evicted == target:
                    break
        for obj in soft:
            if evicted < target:
                self._evict(obj)
                evicted += 1
            else:
                keep.append(obj)
        for obj in keep:  # pushed back only now: pop_due must not see them again
            self.queue.push(obj)
        self._eviction_debt = self._eviction_debt - evicted if evicted == target else 0
        self.wants_eviction = self._eviction_debt > 0
        self.counters["eviction_passes"] += 1
        return evicted

    # ------------------------------------------------------------ periodic upkeep

    def tick(self) -> None:
        """Expire silent owners, grants and zombies, drop dead puts, evict above watermark."""
        now = time.monotonic()
        for owner in self.segments.expired_owners(now, self.config.client_ttl_s):
            for name in self.segments.owned_by(owner):
                self._drop_segment(name)
            self.segments.last_seen.pop(owner, None)
            self.counters["owners_expired"] += 1
            log.warning("owner %s sent no heartbeat for %.1f s: its segments are unmounted",
                        owner, self.config.client_ttl_s)
        self._expire_grants(now)
        for z in [z for z in self.zombies if z.free_at <= now]:
            self._free_zombie(z)
        release = self.config.put_start_release_timeout_s
        stale = [self.objects[k] for k in self.in_flight if now - self.objects[k].pending.started > release]
        for obj in stale:
            self._free(obj.pending.replicas)
            self._clear_pending(obj)
            self.counters["put_released"] += 1
            if not obj.visible:
                del self.objects[obj.key]
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
        if not obj.replicas:
            return
        if grants.open and grants.latest > time.monotonic():
            grants.zombie = Zombie(obj.replicas, grants.latest, grants)
            self.zombies[grants.zombie] = None
        else:
            self._free(obj.replicas)

    def _free_zombie(self, zombie: Zombie) -> None:
        if zombie in self.zombies:  # a zombie goes once: by its grants or its time
            del self.zombies[zombie]
            self._free(zombie.replicas)

    def _close_grant(self, grants: Grants) -> None:
        grants.open -= 1
        if grants.open == 0 and grants.zombie is not None:
            self._free_zombie(grants.zombie)

    def _expire_grants(self, now: float) -> None:
        while self.grants:
            deadline, grants = self.grants[next(iter(self.grants))]
            if deadline > now:
                break
            self.grants.popitem(last=False)
            self.counters["read_grants_expired"] += 1
            self._close_grant(grants)

    def read_done(self, grant_ids: list[int]) -> None:
        """Readers finished the reads of ``grant_ids``: an old version none of whose
        grants is open any more is freed now. The object's lease is left as it is.
        Unknown ids (expired, repeated, never granted) are ignored."""
        for gid in grant_ids:
            entry = self.grants.pop(gid, None)
            if entry is not None:
                self.counters["reads_done"] += 1
                self._close_grant(entry[1])

    def _no_space_message(self, size: int, now: float) -> str:
        """Why ``size`` bytes found no buffer: the value against the largest segment and
        free extent, and the space held by old versions and abandoned puts (K10)."""
        segs = self.segments.segments.values()
        if not segs:
            return f"no space for {size} bytes: no segment is mounted"
        largest = max(s.allocator.capacity for s in segs)
        if self.segments.rounded(size) > largest:
            return f"a value of {size} bytes is larger than the largest segment ({largest} bytes)"
        extent = max(s.allocator.largest_free for s in segs)
        text = (f"no free extent of {size} bytes (largest free extent {extent} bytes; "
                f"{self.segments.used_bytes} of {self.segments.total_bytes} bytes allocated; "
                f"leased and pinned objects are not evicted)")
        for kind, held in (("superseded or removed versions, until the reads in flight on them end",
                            [z for z in self.zombies if z.grants is not None]),
                           ("abandoned puts, until their release timeout",
                            [z for z in self.zombies if z.grants is None])):
            if held:
                nbytes = sum(self.segments.rounded(r.length) for z in held for r in z.replicas)
                until = max(z.free_at for z in held) - now
                text += f"; {nbytes} bytes are held by {len(held)} {kind} (at the latest in {until:.1f} s)"
        return text

    # ------------------------------------------------------------ reads

    def get_replica_list(self, key: str) -> GetResp:
        obj = self.objects.get(key)
        if obj is None or not obj.visible:
            return GetResp(ErrorCode.OBJECT_NOT_FOUND)
        ttl_ms, deadline = self._grant_lease(obj)
        grant_id, self._next_grant_id = self._next_grant_id, self._next_grant_id + 1
        self.grants[grant_id] = (deadline, obj.grants)
        obj.grants.open += 1
        obj.grants.latest = max(obj.grants.latest, deadline)
        return GetResp(OK, obj.size, ttl_ms, [self._desc(r) for r in obj.replicas], grant_id)

    def exist_key(self, key: str) -> int:
        obj = self.objects.get(key)
        if obj is None or not obj.visible:
            return ErrorCode.OBJECT_NOT_FOUND
        self._grant_lease(obj)
        return OK

    def _grant_lease(self, obj: ObjectMeta) -> tuple[int, float]:
        """Extend ``obj``'s read lease; returns (TTL in ms, the new deadline)."""
        ttl_ms = self.config.default_kv_lease_ttl_ms
        deadline = time.monotonic() + ttl_ms / 1000
        if deadline > obj.lease_deadline:
            obj.lease_deadline = deadline
            self.queue.push(obj)
        self.counters["leases_granted"] += 1
        return ttl_ms, deadline

    def _desc(self, r: Replica) -> ReplicaDesc:
        return ReplicaDesc(self.segments.segments[r.segment].info, r.offset, r.length)

    # ------------------------------------------------------------ removal, pins

    def remove(self, key: str, force: bool = False) -> int:
        obj = self.objects.get(key)
        if obj is None or not obj.visible:
            return ErrorCode.OBJECT_NOT_FOUND
        if obj.leased(time.monotonic()) and not force:
            return ErrorCode.OBJECT_HAS_LEASE
        # a forced removal keeps the buffers while a reader may still be copying them
        self._retire(obj)
        obj.replicas = []
        if obj.pending is None:
            del self.objects[key]
        self.counters["removed_objects"] += 1
        return OK

    def remove_matching(self, pattern: str | None, force: bool) -> CountResp:
        """Remove every visible object (whose key ``re.search``-matches ``pattern``);
        leased objects are skipped unless ``force``. Returns how many were removed."""
        try:
            rx = re.compile(pattern) if pattern is not None else None
        except re.error:
            return CountResp(ErrorCode.INVALID_PARAMS)
        keys = [k for k, o in self.objects.items() if o.visible and (rx is None or rx.search(k))]
        count = sum(self.remove(k, force) == OK for k in keys)
        return CountResp(OK, count)

    def set_pin(self, key: str, mode: str) -> Resp:
        obj = self.objects.get(key)
        if obj is None or not obj.visible:
            return Resp(ErrorCode.OBJECT_NOT_FOUND)
        if mode not in ("none", "soft", "hard"):
            return Resp(ErrorCode.INVALID_PARAMS, "pin mode must be none, soft or hard")
        obj.hard_pin = mode == "hard"
        obj.soft_pin_deadline = time.monotonic() + self.config.soft_pin_ttl_ms / 1000 if mode == "soft" else 0.0
        self.queue.push(obj)  # an unpinned object re-enters the eviction order
        return Resp(OK)

    # ------------------------------------------------------------ batches, stats

    def codes(self, fn, keys, *args) -> CodesResp:
        return CodesResp([int(fn(k, *args)) for k in keys])

    def stats(self) -> StatsResp:
        segs = [
            SegmentStats(n, s.owner_id, s.allocator.capacity, s.allocator.used, s.info.data_addr)
            for n, s in self.segments.segments.items()
        ]
        return StatsResp(
            object_count=sum(o.visible for o in self.objects.values()),
            used_bytes=self.segments.used_bytes,
            total_bytes=self.segments.total_bytes,
            segments=segs,
            counters=dict(self.counters),
            owner_count=len(self.segments.last_seen),
            in_flight_puts=len(self.in_flight),
            zombie_buffers=sum(len(z.replicas) for z in self.zombies),
            zombie_bytes=sum(self.segments.rounded(r.length) for z in self.zombies for r in z.replicas),
            open_grants=len(self.grants),
        )
