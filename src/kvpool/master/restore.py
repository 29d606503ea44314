"""Segment indexes: what the master tells nodes about commits, and how a new master
incarnation rebuilds objects from what the nodes report.

A node that mounts with ``index`` keeps an index of the COMPLETE objects in its segment.
The master keeps it exact: every change of what is visible on an indexed segment (a
commit, a removal, an eviction, a version replaced) is queued in :class:`IndexLog` and
sent to the node (:class:`~kvpool.protocol.IndexUpdate`) before the reply that makes the
change known, so every commit a client was told of is in some node's index (or its
socket: the server holds the reply until the update has left its memory). A node that
mounts again with the same master is made exact again (:meth:`Restore.resync`).

When a master starts again (a crash, a restart, a failover) its state is empty; each
node re-mounts with its index (``MountSegment.objects``) and :class:`Restore` rebuilds
the objects: an entry is kept if it lies in the segment, is the newest of the entries
whose ranges overlap it, and is the key's newest version reported (commit versions are
wall-clock nanoseconds, strictly increasing within an incarnation); replicas of one version on several segments
come together again. PROCESSING puts were never in an index: they are gone, their
ranges free. The segment's allocator is built from the kept entries, so used bytes are
exact (K07). Entries not kept are returned to the node, which forgets them.

A node that mounts late must not undo what clients did meanwhile: the new master serves
as soon as it runs, so a key may be removed, upserted or evicted here before the node
holding its old version reports it (a node paused across the restart; or a standby
whose clock runs behind, whose new versions compare older). So the keys this
incarnation settled (committed, removed, evicted: :meth:`Restore._settle`) are never
restored from a later mount, whatever its versions say. They are kept in a Bloom filter
(:class:`SettledKeys`, 256 KiB): a false positive only drops an entry that could have
been restored (a miss), and a set of the keys cost the master some 40 bytes per put
while the window is open. That record is bounded in time: the restore window closes
:data:`RESTORE_WINDOW_TTLS` client TTLs after the first tick of the master's lead (or
once :data:`SETTLED_MAX` keys were settled); a node that mounts later, silent for
longer than the master itself would have timed it out, has its reported objects
dropped (misses, never a stale hit).
"""

from __future__ import annotations

import logging
import time

from kvpool.master.allocator import OffsetAllocator
from kvpool.master.objects import Replica, Segment
from kvpool.master.table import ObjectMeta
from kvpool.protocol import MAX_KEY_BYTES, IndexEntry, IndexUpdate

log = logging.getLogger("kvpool.master")

RESTORE_WINDOW_TTLS = 2  # client TTLs after the lead's first tick that late mounts are restored
SETTLED_MAX = 200_000  # keys settled before the window closes early (the filter's false hits stay ~1.5%)
_BITS = 21  # SettledKeys holds 2^21 bits (256 KiB)
_MASK = (1 << _BITS) - 1


class SettledKeys:
    """A Bloom filter of keys (2^21 bits, 3 probes taken from the key's 64-bit
    ``hash()``, which Python caches on the str): no false negatives; false positives
    about 1.5% at :data:`SETTLED_MAX` keys. Valid within one process (str hashes are
    salted per process). ``added``: calls of :meth:`add` (repeats counted)."""

    def __init__(self):
        self._bits = bytearray(1 << (_BITS - 3))
        self.added = 0

    def add(self, key: str) -> None:
        h, bits, mask = hash(key), self._bits, _MASK  # written out: ~4x faster than a loop
        a, b, c = h & mask, (h >> _BITS) & mask, (h >> 2 * _BITS) & mask
        bits[a >> 3] |= 1 << (a & 7)
        bits[b >> 3] |= 1 << (b & 7)
        bits[c >> 3] |= 1 << (c & 7)
        self.added += 1

    def __contains__(self, key: str) -> bool:
        h, bits, mask = hash(key), self._bits, _MASK
        a, b, c = h & mask, (h >> _BITS) & mask, (h >> 2 * _BITS) & mask
        return bool(bits[a >> 3] >> (a & 7) & bits[b >> 3] >> (b & 7) & bits[c >> 3] >> (c & 7) & 1)


class IndexLog:
    """Index changes per segment name not yet sent: drops and adds (a later drop of a key
    cancels its queued add, so the node ends where the master is; :meth:`take` orders
    them), and the resync of a segment mounted again, for its next stream."""

    def __init__(self):
        self._pending: dict[str, tuple[list[str], dict[str, IndexEntry]]] = {}
        self.resyncs: dict[str, list[IndexEntry]] = {}  # segment -> adds for its next stream (resync)

    def drop(self, segment: str, key: str) -> None:
        drops, adds = self._pending.setdefault(segment, ([], {}))
        adds.pop(key, None)
        drops.append(key)

    def add(self, segment: str, entry: IndexEntry) -> None:
        self._pending.setdefault(segment, ([], {}))[1][entry.key] = entry

    def add_many(self, segment: str, entries: list[IndexEntry]) -> None:
        """:meth:`add` of each of ``entries`` (their keys distinct) on ``segment``."""
        self._pending.setdefault(segment, ([], {}))[1].update([(e.key, e) for e in entries])

    def take(self) -> list[IndexUpdate]:
        """The queued changes; the log is empty afterwards. Every segment's adds come
        first, then the drops not replaced by an add of the same key (an add replaces
        a key's entry): a master killed between two of these writes leaves a key's new
        version with some node even when the drop of its old one on another node was
        not sent yet (the rebuild keeps the newest), rather than neither of them."""
        pending, self._pending = self._pending, {}
        adds = [IndexUpdate(name, [], list(a.values())) for name, (_, a) in pending.items() if a]
        drops = [IndexUpdate(name, [k for k in d if k not in a], []) for name, (d, a) in pending.items()]
        return adds + [u for u in drops if u.drops]


def _newest_where_overlapping(entries: list[IndexEntry], rounded, dropped: list[str]) -> list[IndexEntry]:
    """``entries`` sorted by offset, where of entries whose ranges (``rounded(size)``
    bytes from ``offset``) overlap only the newest versions that do not overlap each
    other are kept; the keys of the others are appended to ``dropped``.

    Two live objects never share bytes, so of overlapping entries at most one is still
    true, and it is the newest: an older one's range was freed before it was reused. A
    node's index can hold such a pair only when updates were lost (its stream ended
    before they reached it); keeping the first by offset could then serve the bytes of
    the newer key under the older one. Overlaps are rare, so only a run of mutually
    overlapping entries (a cluster) is sorted by version."""
    out: list[IndexEntry] = []
    cluster: list[IndexEntry] = []
    end = -1
    for e in sorted(entries, key=lambda e: e.offset):
        if cluster and e.offset >= end:
            out.extend(_settle(cluster, rounded, dropped))
            cluster = []
        e_end = e.offset + rounded(e.size)
        end = max(end, e_end) if cluster else e_end
        cluster.append(e)
    out.extend(_settle(cluster, rounded, dropped))
    return out


def _settle(cluster: list[IndexEntry], rounded, dropped: list[str]) -> list[IndexEntry]:
    """Of a cluster of overlapping entries, the newest that overlap none kept before,
    by offset; the rest go to ``dropped``."""
    if len(cluster) <= 1:
        return cluster
    kept: list[IndexEntry] = []
    for e in sorted(cluster, key=lambda e: e.version, reverse=True):
        lo, hi = e.offset, e.offset + rounded(e.size)
        if all(hi <= k.offset or k.offset + rounded(k.size) <= lo for k in kept):
            kept.append(e)
        else:
            dropped.append(e.key)
    return sorted(kept, key=lambda e: e.offset)


class Restore:
    """Index upkeep and rebuilding for :class:`~kvpool.master.service.MasterService` (a
    mixin: it uses the service's ``segments``, ``objects``, ``queue``, ``index_log``,
    ``config``, ``_set_replicas`` and ``_retire``, and keeps ``_last_version``,
    ``_settled`` (keys settled while the restore window is open; None once it closed)
    and ``_restore_until`` (when it closes, on the service's clock; None before the
    first tick) and ``lead_began`` (that first tick; None before it))."""

    def _settle(self, key: str) -> None:
        """This incarnation decided ``key``'s fate (a commit, a removal, an eviction): no
        mount restores an entry of it any more (module docstring)."""
        self._settle_many((key,))

    def _settle_many(self, keys) -> None:
        """:meth:`_settle` of each of ``keys`` (an iterable of str)."""
        settled = self._settled
        if settled is not None:
            for key in keys:
                settled.add(key)
            if settled.added > SETTLED_MAX:
                self._close_restore(f"{SETTLED_MAX} keys changed since it began")

    def _restore_tick(self, now: float) -> None:
        """Open the restore window at the lead's first tick; close it when it is over."""
        if self._restore_until is None:
            self.lead_began = now
            self._restore_until = now + RESTORE_WINDOW_TTLS * self.config.client_ttl_s
        elif self._settled is not None and now >= self._restore_until:
            self._close_restore(f"{RESTORE_WINDOW_TTLS} client TTLs passed")

    def _close_restore(self, why: str) -> None:
        self._settled = None
        log.info("restore window closed (%s): a segment mounted from now on has its reported "
                 "objects dropped", why)

    def _next_version(self, count: int = 1) -> int:
        """The first of ``count`` new commit versions, consecutive: above every version
        given before, and at least the wall clock in ns (so a later incarnation's
        versions are above an earlier one's: the rebuild keeps the newest)."""
        first = max(self._last_version + 1, time.time_ns())
        self._last_version = first + count - 1
        return first

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

    def resync(self, name: str, reported: list[IndexEntry]) -> list[str]:
        """A node mounts again a segment this master still holds (its stream broke):
        its index ``reported`` may lack changes sent while it had no stream, and the
        mount ignores it, so a later restart would rebuild from a wrong index. Returns
        the reported keys the node must forget (not visible here on ``name``) and
        queues in ``index_log.resyncs`` the entries it lacks or holds wrongly, for the
        server to send first on the new stream. O(objects on the segment)."""
        truth = {}
        for obj in self.objects.on_segment(name):
            for r in obj.replicas if obj.visible else ():
                if r.segment == name:
                    truth[obj.key] = IndexEntry(obj.key, r.offset, obj.size, obj.version)
        seen = {e.key: e for e in reported}
        self.index_log.resyncs[name] = [e for key, e in truth.items() if seen.get(key) != e]
        return [key for key in seen if key not in truth]

    def restore(self, seg: Segment, entries: list[IndexEntry]) -> list[str]:
        """Rebuild the objects of ``entries`` on the freshly mounted ``seg`` and give it
        an allocator in which exactly the kept ones are allocated. Returns the keys of
        the entries not kept: all of them once the restore window closed."""
        alloc = seg.allocator
        if self._settled is None:
            log.warning("segment %s mounted after the restore window: its %d reported objects are dropped "
                        "(they may be older than what clients did since)", seg.info.name, len(entries))
            return [e.key for e in entries]
        fits, dropped = [], []
        for e in entries:
            inside = (0 < len(e.key.encode("utf-8")) <= MAX_KEY_BYTES and e.size > 0
                      and e.offset % alloc.alignment == 0 and e.offset + alloc.rounded(e.size) <= alloc.capacity)
            (fits if inside else dropped).append(e if inside else e.key)
        kept = []
        for e in _newest_where_overlapping(fits, alloc.rounded, dropped):
            if self._adopt(seg.info.name, e):
                kept.append((e.offset, e.size))
            else:
                dropped.append(e.key)
        self.segments.replace_allocator(seg, OffsetAllocator.with_used(alloc.capacity, alloc.alignment, kept))
        return dropped

    def _adopt(self, name: str, e: IndexEntry) -> bool:
        """Make ``e`` a COMPLETE replica of its key if it is the newest version known
        (another replica of the same version joins it). False: a newer version exists,
        or this incarnation settled the key (module docstring)."""
        if e.key in self._settled:
            return False
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
