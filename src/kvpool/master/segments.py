"""The mounted segments, their owners' liveness, and replica placement.

Placement strategies (Mooncake's allocation strategies):
``random`` (default) picks segments at random among those that can take the value;
``free_ratio_first`` tries the emptiest segment first; ``local_first`` tries segments on
the writer's host first. Replicas of one object always land on distinct segments.

Every mount gets a fresh mount epoch (:func:`new_epoch`), stamped on the stored
``SegmentInfo`` and so on every replica descriptor the master hands out: a grant
names the mount it is valid for (see "Safety across master restarts" in docs/store.md).

Per-operation cost does not grow with the number of segments: segments are indexed by
their largest free extent (:class:`FreeIndex`), so the ones that can take ``n`` bytes are
a suffix found by bisection and a random pick among them costs O(log segments); used and
total bytes are kept as allocations change; owners are kept in heartbeat order, so
finding silent ones looks only at those.

A segment whose node was seen to die (its index stream closed, as the kernel does at
once for a killed process, and its data port refuses: see MasterServer._check_node) is
*withheld*: it stays mounted, so its objects stay
until its owner's heartbeat times out, but no new buffer is placed on it. Without that,
for the whole client TTL every put that drew the dead node failed over TCP, or over shm
landed in a segment about to be dropped.
"""

from __future__ import annotations

import bisect
import random
import secrets
from collections import OrderedDict
from itertools import islice

import msgspec

from kvpool.master.allocator import OffsetAllocator
from kvpool.master.objects import Replica, Segment
from kvpool.protocol import SegmentInfo

STRATEGIES = ("random", "free_ratio_first", "local_first")


def new_epoch() -> int:
    """A random nonzero 63-bit number: two mounts share one with probability 2**-63."""
    return secrets.randbits(63) or 1


class FreeIndex:
    """Segment names sorted by a number (their largest free extent, or their used share),
    as a sorted list of (value, name): O(log n) search, a short memmove per change."""

    def __init__(self):
        self.entries: list[tuple[float, str]] = []
        self.at: dict[str, float] = {}

    def set(self, name: str, value: float) -> None:
        old = self.at.get(name)
        if old == value:
            return
        if old is not None:
            del self.entries[bisect.bisect_left(self.entries, (old, name))]
        bisect.insort(self.entries, (value, name))
        self.at[name] = value

    def remove(self, name: str) -> None:
        old = self.at.pop(name, None)
        if old is not None:
            del self.entries[bisect.bisect_left(self.entries, (old, name))]

    def pick(self, least: int, k: int, exclude: set[str]) -> list[str]:
        """Up to ``k`` names, at random, whose value is at least ``least``, none in
        ``exclude``."""
        start = bisect.bisect_left(self.entries, (least, ""))
        n = len(self.entries) - start
        picked = random.sample(range(start, start + n), min(n, k + len(exclude))) if k > 0 else []
        return [name for name in (self.entries[i][1] for i in picked) if name not in exclude][:k]


class _Heartbeats(OrderedDict):
    """owner_id -> last heartbeat (monotonic seconds), oldest first: setting a key moves
    it to the end, so the silent owners are a prefix."""

    def __setitem__(self, owner: str, when: float) -> None:
        super().__setitem__(owner, when)
        self.move_to_end(owner)


class SegmentTable:
    """Segments by name, owners' last heartbeat, and allocation across segments."""

    def __init__(self, strategy: str = "random", alignment: int = 64):
        if strategy not in STRATEGIES:
            raise ValueError(f"allocation strategy must be one of {STRATEGIES}")
        self.strategy = strategy
        self.alignment = alignment
        self.segments: dict[str, Segment] = {}
        self.last_seen: dict[str, float] = _Heartbeats()  # owner_id -> monotonic seconds
        self.used_bytes = 0  # allocated (aligned) bytes over all segments
        self.total_bytes = 0
        self.largest_capacity = 0
        self._by_free = FreeIndex()  # largest free extent
        self._by_ratio = FreeIndex()  # used share (free_ratio_first)
        self._by_host: dict[str, FreeIndex] = {}  # host_id -> largest free extent (local_first)
        self.withheld: set[str] = set()  # mounted, but no new buffer goes there (node seen dead)
        # segments buffers were placed on since take_placed: the server holds such a reply
        # until their index streams took the drops of what the buffers held before
        self.placed: set[str] = set()
        # segments whose index stream is behind (set by the server): a buffer placed
        # there waits for it, so placement takes them last
        self.lagging: set[str] = set()

    def mount(self, owner_id: str, info: SegmentInfo, now: float) -> Segment | None:
        """Add ``info`` under a new mount epoch; returns the segment (also when already
        mounted by the same owner: the same epoch), None when the name is taken."""
        seg = self.segments.get(info.name)
        if seg is not None:
            same = seg.owner_id == owner_id and msgspec.structs.replace(seg.info, epoch=info.epoch) == info
            if not same:
                return None
            self.withheld.discard(info.name)  # its node is back: place on it again
            self._listed(seg)
            return seg
        stamped = msgspec.structs.replace(info, epoch=new_epoch())
        seg = self.segments[info.name] = Segment(stamped, owner_id, OffsetAllocator(info.size, self.alignment))
        self.total_bytes += seg.allocator.capacity
        self.largest_capacity = max(self.largest_capacity, seg.allocator.capacity)
        self._listed(seg)
        self.last_seen[owner_id] = now
        return seg

    def unmount(self, name: str) -> Segment | None:
        """Drop segment ``name`` (its allocator with it); forget an owner left with none."""
        seg = self.segments.pop(name, None)
        self.lagging.discard(name)
        if seg is None:
            return None
        self.used_bytes -= seg.allocator.used
        self.total_bytes -= seg.allocator.capacity
        self.largest_capacity = max((s.allocator.capacity for s in self.segments.values()), default=0)
        self._unlisted(seg)
        self.withheld.discard(name)
        if not self.owned_by(seg.owner_id):
            self.last_seen.pop(seg.owner_id, None)
        return seg

    def replace_allocator(self, seg: Segment, allocator: OffsetAllocator) -> None:
        """Give ``seg`` a new allocator (a restored one), keeping the totals exact."""
        self.used_bytes += allocator.used - seg.allocator.used
        seg.allocator = allocator
        self._listed(seg)

    def withhold(self, name: str) -> bool:
        """Place no new buffer on mounted segment ``name`` until it is mounted again
        (by the same owner) or unmounted; buffers already on it are untouched. False:
        not mounted, or already withheld."""
        seg = self.segments.get(name)
        if seg is None or name in self.withheld:
            return False
        self.withheld.add(name)
        self._unlisted(seg)
        return True

    def owned_by(self, owner_id: str) -> list[str]:
        return [n for n, s in self.segments.items() if s.owner_id == owner_id]

    def excuse(self, seconds: float) -> None:
        """Count every owner's silence from ``seconds`` later (the master itself did not
        run meanwhile, so their heartbeats went unread); the heartbeat order stays."""
        for owner, seen in list(self.last_seen.items()):
            OrderedDict.__setitem__(self.last_seen, owner, seen + seconds)  # in place: no move

    def expired_owners(self, now: float, ttl_s: float) -> list[str]:
        """Owners silent for over ``ttl_s``: a prefix of the heartbeat order."""
        out = []
        for owner, seen in self.last_seen.items():
            if now - seen <= ttl_s:
                break
            out.append(owner)
        return out

    def allocate(self, size: int, count: int, host_id: str = "", preferred: str = "") -> list[Replica]:
        """Up to ``count`` buffers of ``size`` bytes on distinct segments (best effort):
        segment ``preferred`` first, then the strategy's, :attr:`lagging` segments only
        where no other can take the value: O(log segments) per replica for ``random``
        and ``local_first``."""
        need = self.rounded(size)
        out: list[Replica] = []
        first = self.segments.get(preferred) if preferred and preferred not in self.withheld else None
        if first is not None:
            self._take(first, size, out)
        taken = {r.segment for r in out}
        names = self._candidates(need, count - len(out), host_id, taken | self.lagging)
        if self.lagging and len(names) < count - len(out):
            names += self._candidates(need, count - len(out) - len(names), host_id, taken | set(names))
        for name in names:
            self._take(self.segments[name], size, out)
        return out

    def _candidates(self, need: int, k: int, host_id: str, exclude: set[str]) -> list[str]:
        """Names of up to ``k`` segments, not in ``exclude``, with a free extent of
        ``need`` bytes, in the strategy's order."""
        if k <= 0:
            return []
        if self.strategy == "free_ratio_first":  # walks from the emptiest: O(segments) at worst
            fits = self._by_free.at
            return list(islice((n for _, n in self._by_ratio.entries if n not in exclude and fits[n] >= need), k))
        picked: list[str] = []
        local = self._by_host.get(host_id) if self.strategy == "local_first" else None
        if local is not None:
            picked = local.pick(need, k, exclude)
        return picked + self._by_free.pick(need, k - len(picked), exclude | set(picked))

    def _take(self, seg: Segment, size: int, out: list[Replica]) -> None:
        before = seg.allocator.used
        offset = seg.allocator.allocate(size)
        if offset is not None:
            out.append(Replica(seg.info.name, offset, size))
            self.used_bytes += seg.allocator.used - before
            self._listed(seg)
            self.placed.add(seg.info.name)

    def take_placed(self) -> set[str]:
        """Names of the segments buffers were placed on since the last call."""
        placed, self.placed = self.placed, set()
        return placed

    def free(self, replica: Replica) -> None:
        """Return ``replica``'s buffer; a no-op if its segment is gone (unmounted)."""
        seg = self.segments.get(replica.segment)
        if seg is not None:
            before = seg.allocator.used
            seg.allocator.free(replica.offset, replica.length)
            self.used_bytes += seg.allocator.used - before
            self._listed(seg)

    def _listed(self, seg: Segment) -> None:
        """Re-index ``seg`` after its allocator changed (a withheld one stays out)."""
        a, name = seg.allocator, seg.info.name
        if name in self.withheld:
            return
        self._by_free.set(name, a.largest_free)
        if self.strategy == "free_ratio_first":
            self._by_ratio.set(name, a.used / max(1, a.capacity))
        elif self.strategy == "local_first":
            self._by_host.setdefault(seg.info.host_id, FreeIndex()).set(name, a.largest_free)

    def _unlisted(self, seg: Segment) -> None:
        """Take ``seg`` out of every placement index."""
        for index in (self._by_free, self._by_ratio, self._by_host.get(seg.info.host_id)):
            if index is not None:
                index.remove(seg.info.name)

    def rounded(self, size: int) -> int:
        return max(self.alignment, -(-size // self.alignment) * self.alignment)
