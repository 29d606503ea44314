"""Segment indexes: what the master tells nodes about commits, and how a new master
incarnation rebuilds objects from what the nodes report.

A node that mounts with ``index`` keeps an index of the COMPLETE objects in its segment.
The master keeps it exact: every change of what is visible on an indexed segment (a
commit, a removal, an eviction, a version replaced) is queued in :class:`IndexLog` and
sent to the node (:class:`~kvpool.protocol.IndexUpdate`) before the reply that makes the
change known, so every commit a client was told of is in some node's index.

When a master starts again (a crash, a restart, a failover) its state is empty; each
node re-mounts with its index (``MountSegment.objects``) and :class:`Restore` rebuilds
the objects: an entry is kept if it lies in the segment, overlaps no entry kept before,
and is the key's newest version reported (commit versions are wall-clock nanoseconds,
strictly increasing within an incarnation); replicas of one version on several segments
come together again. PROCESSING puts were never in an index: they are gone, their
ranges free. The segment's allocator is built from the kept entries, so used bytes are
exact (K07). Entries not kept are returned to the node, which forgets them.
"""

from __future__ import annotations

import time

from kvpool.master.allocator import OffsetAllocator
from kvpool.master.objects import Replica, Segment
from kvpool.master.table import ObjectMeta
from kvpool.protocol import MAX_KEY_BYTES, IndexEntry, IndexUpdate


class IndexLog:
    """Index changes per segment name not yet sent: drops, then adds (a later drop of a
    key cancels its queued add, so the node ends where the master is)."""

    def __init__(self):
        self._pending: dict[str, tuple[list[str], dict[str, IndexEntry]]] = {}

    def drop(self, segment: str, key: str) -> None:
        drops, adds = self._pending.setdefault(segment, ([], {}))
        adds.pop(key, None)
        drops.append(key)

    def add(self, segment: str, entry: IndexEntry) -> None:
        self._pending.setdefault(segment, ([], {}))[1][entry.key] = entry

    def take(self) -> list[IndexUpdate]:
        """The queued changes, one message per segment; the log is empty afterwards."""
        pending, self._pending = self._pending, {}
        return [IndexUpdate(name, drops, list(adds.values())) for name, (drops, adds) in pending.items()]


class Restore:
    """Index upkeep and rebuilding for :class:`~kvpool.master.service.MasterService` (a
    mixin: it uses the service's ``segments``, ``objects``, ``queue``, ``index_log``,
    ``_set_replicas`` and ``_retire``, and keeps ``_last_version``)."""

    def _next_version(self) -> int:
        self._last_version = max(self._last_version + 1, time.time_ns())
        return self._last_version

    def _index_drop(self, obj: ObjectMeta) -> None:
        """``obj``'s current replicas stop being visible: tell their indexed segments."""
        for r in obj.replicas:
            seg = self.segments.segments.get(r.segment)
            if seg is not None and seg.indexed:
                self.index_log.drop(r.segment, obj.key)

    def _index_add(self, obj: ObjectMeta) -> None:
        for r in obj.replicas:
            self._index_replica(obj.key, r, obj.size, obj.version)

    def _index_replica(self, key: str, r: Replica, size: int, version: int) -> None:
        """Version ``version`` of ``key`` (``size`` bytes) is visible in replica ``r``:
        tell its segment if indexed."""
        seg = self.segments.segments.get(r.segment)
        if seg is not None and seg.indexed:
            self.index_log.add(r.segment, IndexEntry(key, r.offset, size, version))

    def restore(self, seg: Segment, entries: list[IndexEntry]) -> list[str]:
        """Rebuild the objects of ``entries`` on the freshly mounted ``seg`` and give it
        an allocator in which exactly the kept ones are allocated. Returns the keys of
        the entries not kept."""
        dropped, kept, end = [], [], 0
        alloc = seg.allocator
        for e in sorted(entries, key=lambda e: e.offset):
            fits = (0 < len(e.key.encode("utf-8")) <= MAX_KEY_BYTES and e.size > 0 and e.offset >= end
                    and e.offset % alloc.alignment == 0 and e.offset + alloc.rounded(e.size) <= alloc.capacity)
            if fits and self._adopt(seg.info.name, e):
                kept.append((e.offset, e.size))
                end = e.offset + alloc.rounded(e.size)
            else:
                dropped.append(e.key)
        self.segments.replace_allocator(seg, OffsetAllocator.with_used(alloc.capacity, alloc.alignment, kept))
        return dropped

    def _adopt(self, name: str, e: IndexEntry) -> bool:
        """Make ``e`` a COMPLETE replica of its key if it is the newest version known
        (another replica of the same version joins it). False: a newer version exists."""
        replica = Replica(name, e.offset, e.size)
        obj = self.objects.get(e.key)
        self._last_version = max(self._last_version, e.version)
        if obj is not None and obj.visible:
            if e.version == obj.version and e.size == obj.size and all(r.segment != name for r in obj.replicas):
                self._set_replicas(obj, obj.replicas + [replica])
                return True
            if e.version <= obj.version:
                return False
            self._index_drop(obj)  # an older version was restored first: the newer wins
            self._retire(obj)
        if obj is None:
            obj = self.objects.create(e.key)
        obj.size, obj.version = e.size, e.version
        self._set_replicas(obj, [replica])
        self.queue.push(obj)
        return True
