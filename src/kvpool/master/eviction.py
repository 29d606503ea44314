"""Eviction order: objects by lease deadline (oldest first), in sorted linked runs.

Mooncake evicts in lease-deadline order, an approximate LRU: every read extends the
deadline, and a put counts as a use. The order is kept as a few doubly-linked runs over
the object table's slots (:class:`~kvpool.master.table.ObjectTable`: two int32 links and
a run byte per object, no object of its own), each sorted by deadline. Deadlines come in
two rising streams: a put's (``now``) and a read's (``now`` + the one lease TTL), so a
changed object is unlinked and appended, in O(1), to the run whose last deadline is the
largest not above its own: puts and reads each keep a run. A read moves nothing at once:
it only raises the deadline, and the eviction walk moves an object it finds leased
(:meth:`EvictionQueue.touch`), so each run stays sorted by the deadline its objects were
linked by (``order``). An object restored after a
restart (deadline 0) starts a third; a deadline below every run's last one (rare: an
object unpinned long after its last use) is inserted into the fourth run by a walk from
its end. Eviction walks the runs' heads in merged order: O(1) per object it looks at,
whatever the number of objects, and nothing is ever re-sorted or rebuilt.

:class:`Eviction` holds the master's eviction handlers: making room for a put that does
not fit (K10: only objects whose space could make it fit, nothing if none could) and the
passes above the high watermark.
"""

from __future__ import annotations

import math
from typing import Iterator

from kvpool.master.objects import Replica
from kvpool.master.table import HARD_PIN, NO_SEG, RUNS, ObjectMeta, ObjectTable
from kvpool.protocol import PutItem

SORTED_RUN = RUNS - 1  # the run that takes deadlines no other run can append


class EvictionQueue:
    """Visible, not hard-pinned objects in lease-deadline order (see module docstring)."""

    def __init__(self, table: ObjectTable):
        self._t = table
        self._last_run = 0  # the append run the last push went to

    def __len__(self) -> int:
        return self._t.linked

    def push(self, obj: ObjectMeta) -> None:
        """Record ``obj`` at its current ``lease_deadline`` (call after every change but
        a read's, see :meth:`touch`). O(1) unless its deadline is below every append
        run's last one."""
        self._push(obj.slot)

    def push_slot(self, slot: int) -> None:
        """:meth:`push` of the record in ``slot`` (one made whole without a view)."""
        self._push(slot)

    def touch(self, slot: int) -> None:
        """The record in ``slot`` was read and its deadline moved later: O(1), no move in the runs. It
        stays linked by its older deadline (``order``) until the eviction walk reaches it
        and, finding it leased, links it where its deadline now is: reads of a hot object
        cost that move once per eviction walk, not once per read, and touch no neighbour's
        links (random accesses that grew with the objects held)."""
        if self._t.run[slot] < 0:
            self._push(slot)  # not linked (never expected while visible): link it now

    def _push(self, s: int) -> None:
        t = self._t
        if t.flags[s] & HARD_PIN or (t.seg[s] == NO_SEG and s not in t.more):
            t.unlink(s)  # hard-pinned or invisible: never evicted; pushed again if unpinned
            return
        order = t.order
        d = t.lease[s]
        if t.run[s] >= 0:
            p, n = t.prev[s], t.next[s]
            if (p < 0 or order[p] <= d) and (n < 0 or d <= order[n]):
                order[s] = d
                return  # still in order where it is
            t.unlink(s)
        order[s] = d
        tail = t.tails[self._last_run]
        if tail >= 0 and order[tail] == d:  # no run's last deadline is nearer: a batch's puts, one deadline
            t.link_after(self._last_run, s, tail)
            return
        best, best_last = -1, -math.inf  # the append run whose last deadline is the largest <= d
        for run, tail in enumerate(t.tails[:SORTED_RUN]):
            if tail < 0:
                if best < 0:
                    best = run  # an empty run, unless another one fits
            elif best_last < order[tail] <= d:
                best, best_last = run, order[tail]
        if best >= 0:
            self._last_run = best
            t.link_after(best, s, t.tails[best])
            return
        p = t.tails[SORTED_RUN]
        while p >= 0 and order[p] > d:
            p = t.prev[p]
        t.link_after(SORTED_RUN, s, p)

    def pop_due(self, now: float) -> Iterator[ObjectMeta]:
        """Yield objects whose lease ended by ``now``, oldest first, each once.

        Walks the runs by the deadline each object is linked by; one read since then is
        moved to where its deadline now is (and met there again if that is still due).
        Stops where the linked deadlines pass ``now``. Objects stay in the order until the caller evicts
        them; the caller may evict each yielded object but must change no other while
        iterating.
        """
        t = self._t
        cursors = list(t.heads)
        lease, order, nxt = t.lease, t.order, t.next
        while True:
            best, first = -1, math.inf
            for run, c in enumerate(cursors):
                if c >= 0 and order[c] < first:
                    best, first = run, order[c]
            if best < 0 or first > now:
                return
            s = cursors[best]
            cursors[best] = nxt[s]
            if lease[s] > order[s]:  # read since it was linked: link it by its deadline
                t.unlink(s)
                self._push(s)
                run = t.run[s]  # met again in this walk if due: before its run's cursor?
                if run >= 0 and (cursors[run] < 0 or order[cursors[run]] > order[s]):
                    cursors[run] = s
                continue
            yield ObjectMeta(t, s, t.keys[s])


def _adds_room(obj: ObjectMeta, room: dict[str, int], need: int, segments) -> bool:
    """Count ``obj``'s buffers into ``room`` (free bytes per segment, filled in as
    segments are first touched); True if one of its segments now reaches ``need``.
    A withheld segment takes no new buffer, so room there is no room: it is skipped."""
    for r in obj.replicas:
        if r.segment in segments.withheld:
            continue
        if r.segment not in room:
            a = segments.segments[r.segment].allocator
            room[r.segment] = a.capacity - a.used
        room[r.segment] += segments.rounded(r.length)
    return any(room.get(r.segment, 0) >= need for r in obj.replicas)


class Eviction:
    """Eviction handlers of :class:`~kvpool.master.service.MasterService` (a mixin: it
    uses the service's ``config``, ``segments``, ``objects``, ``queue``, ``counters``,
    ``clock``, ``grants``, ``alloc_leases``, ``_free``, ``_forget``, ``_settle`` and ``_index_drop``,
    and keeps ``wants_eviction`` and ``_eviction_debt``, the objects the current pass
    still has to free)."""

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
        if self.segments.largest_capacity < need:
            return False
        room: dict[str, int] = {}  # only segments holding a candidate can gain room
        candidates, soft, keep = [], [], []
        for obj in self._due_unpinned(self.clock(), keep, soft):
            candidates.append(obj)
            if _adds_room(obj, room, need, self.segments):
                break
        else:  # unpinned objects were not enough: soft-pinned ones, in order
            for i, obj in enumerate(soft):
                candidates.append(obj)
                if _adds_room(obj, room, need, self.segments):
                    keep.extend(soft[i + 1:])
                    break
            else:
                keep.extend(candidates)  # futile: evict nothing
                candidates = []
            soft = []
        keep.extend(soft)
        evicted = self._evict_useful(candidates, {n for n, free in room.items() if free >= need},
                                     need, keep)
        for obj in keep:
            self.queue.push(obj)
        return evicted > 0

    def _due_unpinned(self, now: float, keep: list[ObjectMeta],
                      soft: list[ObjectMeta]) -> Iterator[ObjectMeta]:
        """Due objects, in eviction order, that may go now; in-flight ones are put in
        ``keep`` and soft-pinned ones in ``soft`` (the caller evicts or pushes back)."""
        for obj in self.queue.pop_due(now):
            if obj.pending is not None:
                keep.append(obj)
            elif obj.soft_pinned(now):
                soft.append(obj)
            else:
                yield obj

    def _evict_useful(self, candidates: list[ObjectMeta], useful: set[str], need: int,
                      keep: list[ObjectMeta]) -> int:
        """Evict, in order, the candidates with a replica on a ``useful`` segment until
        one of those has a free extent of ``need`` bytes; the others go to ``keep``.
        Returns how many were evicted. Only the evicted object's segments can have
        gained a free extent, so only they are looked at."""
        segs = self.segments.segments
        evicted = 0
        for i, obj in enumerate(candidates):
            mine = [r.segment for r in obj.replicas if r.segment in useful]
            if not mine:
                keep.append(obj)
                continue
            self._evict(obj)
            evicted += 1
            if any(segs[n].allocator.largest_free >= need for n in mine):
                keep.extend(candidates[i + 1:])
                break
        return evicted

    def _evict(self, obj: ObjectMeta) -> None:
        self._settle(obj.key)
        self._index_drop(obj)
        self._free(obj.replicas)  # its lease ended, and with it every grant on it
        self.counters["evicted_objects"] += 1
        self.counters["evicted_bytes"] += obj.size
        self._forget(obj)

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
        evicted, soft, keep = 0, [], []
        for obj in self._due_unpinned(self.clock(), keep, soft):
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

    def no_space_message(self, size: int, now: float) -> str:
        """Why ``size`` bytes found no buffer: the value against the largest segment and
        free extent, and the space held by old versions, abandoned puts, allocation leases
        and withheld segments (K10)."""
        segs = self.segments.segments.values()
        if not segs:
            starting = self._settled is not None  # the restore window is open: a new master
            return (f"no space for {size} bytes: no segment is mounted" +
                    (" yet (this master started moments ago: its nodes mount within seconds)"
                     if starting else ""))
        largest = max(s.allocator.capacity for s in segs)
        if self.segments.rounded(size) > largest:
            return f"a value of {size} bytes is larger than the largest segment ({largest} bytes)"
        withheld = self.segments.withheld
        if all(s.info.name in withheld for s in segs):
            return (f"no space for {size} bytes: every segment's node was seen dead ({len(withheld)} "
                    "segments take no new buffers until they mount again or their owners time out)")
        extent = max((s.allocator.largest_free for s in segs if s.info.name not in self.segments.withheld), default=0)
        text = (f"no free extent of {size} bytes (largest free extent {extent} bytes; "
                f"{self.segments.used_bytes} of {self.segments.total_bytes} bytes allocated; "
                f"leased and pinned objects are not evicted)")
        for kind, held in (("superseded or removed versions, until the reads in flight on them end",
                            self.grants.held(by_readers=True)),
                           ("abandoned puts, until their release timeout",
                            self.grants.held(by_readers=False))):
            if held:
                until = max(z.free_at for z in held) - now
                text += (f"; {self.grants.nbytes(held)} bytes are held by {len(held)} {kind} "
                         f"(at the latest in {until:.1f} s)")
        if self.segments.withheld:
            text += (f"; {len(self.segments.withheld)} segments take no new buffers, their nodes seen dead "
                     f"(until they mount again or their owners time out)")
        leases = self.alloc_leases
        if leases.leased_bytes:
            text += (f"; {leases.leased_bytes} bytes are held unused by {len(leases.open)} allocation "
                     f"leases, until returned or expired")
        return text
