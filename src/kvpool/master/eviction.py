"""Eviction order: objects by lease deadline (oldest first), as a heap with lazy deletion.

Mooncake evicts in lease-deadline order, an approximate LRU: every read extends the
deadline, and a put counts as a use. Rather than sorting every object on each eviction
(O(n log n), ~150 ms at 100k objects), each deadline change pushes a heap entry; entries
whose object is gone or whose deadline has changed since are stale and skipped when
popped. The heap is rebuilt when stale entries outnumber live objects, so memory stays
O(objects). A pass costs O(k log n) for k popped entries.

:class:`Eviction` holds the master's eviction handlers: making room for a put that does
not fit (K10: only objects whose space could make it fit, nothing if none could) and the
passes above the high watermark.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Iterator

from kvpool.master.objects import ObjectMeta, Replica
from kvpool.protocol import PutItem


class EvictionQueue:
    """Visible, not hard-pinned objects in lease-deadline order (see module docstring)."""

    def __init__(self, objects: dict[str, ObjectMeta]):
        self._objects = objects
        self._heap: list[tuple[float, int, ObjectMeta]] = []
        self._seq = itertools.count()  # tie-break: equal deadlines keep push order

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, obj: ObjectMeta) -> None:
        """Record ``obj`` at its current ``lease_deadline`` (call after every change)."""
        if obj.hard_pin:
            return  # never evicted; pushed again if unpinned
        heapq.heappush(self._heap, (obj.lease_deadline, next(self._seq), obj))
        if len(self._heap) > 2 * len(self._objects) + 1024:
            self._rebuild()

    def _current(self, deadline: float, obj: ObjectMeta) -> bool:
        return (self._objects.get(obj.key) is obj and obj.visible and not obj.hard_pin
                and obj.lease_deadline == deadline)

    def pop_due(self, now: float) -> Iterator[ObjectMeta]:
        """Pop and yield current objects whose lease ended by ``now``, oldest first.

        Stops at the first leased entry (all later ones are leased too). Objects the
        caller does not evict must be :meth:`push`-ed back.
        """
        seen: set[int] = set()
        while self._heap:
            deadline, _, obj = self._heap[0]
            if deadline > now and self._current(deadline, obj):
                return
            heapq.heappop(self._heap)
            if self._current(deadline, obj) and id(obj) not in seen:
                seen.add(id(obj))
                yield obj

    def _rebuild(self) -> None:
        self._heap = [(o.lease_deadline, next(self._seq), o) for o in self._objects.values()
                      if o.visible and not o.hard_pin]
        heapq.heapify(self._heap)


def _adds_room(obj: ObjectMeta, room: dict[str, int], need: int, rounded) -> bool:
    """Count ``obj``'s buffers into ``room``; True if one of its segments now reaches ``need``."""
    for r in obj.replicas:
        room[r.segment] = room.get(r.segment, 0) + rounded(r.length)
    return any(room.get(r.segment, 0) >= need for r in obj.replicas)


class Eviction:
    """Eviction handlers of :class:`~kvpool.master.service.MasterService` (a mixin: it
    uses the service's ``config``, ``segments``, ``objects``, ``queue``, ``counters``,
    ``clock``, ``grants``, ``_free``, ``_forget`` and ``_index_drop``, and keeps ``wants_eviction`` and
    ``_eviction_debt``, the objects the current pass still has to free)."""

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
        room = {n: s.allocator.capacity - s.allocator.used for n, s in segs.items()}
        candidates, soft, keep = [], [], []
        for obj in self._due_unpinned(self.clock(), keep, soft):
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
        Returns how many were evicted."""
        segs = self.segments.segments
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
        return evicted

    def _evict(self, obj: ObjectMeta) -> None:
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
                            self.grants.held(by_readers=True)),
                           ("abandoned puts, until their release timeout",
                            self.grants.held(by_readers=False))):
            if held:
                until = max(z.free_at for z in held) - now
                text += (f"; {self.grants.nbytes(held)} bytes are held by {len(held)} {kind} "
                         f"(at the latest in {until:.1f} s)")
        return text
