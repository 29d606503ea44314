"""The mounted segments, their owners' liveness, and replica placement.

Placement strategies (Mooncake's allocation strategies):
``random`` (default) tries segments in random order; ``free_ratio_first`` tries the
emptiest segment first; ``local_first`` tries segments on the writer's host first.
Replicas of one object always land on distinct segments.

Every mount gets a fresh mount epoch (:func:`new_epoch`), stamped on the stored
``SegmentInfo`` and so on every replica descriptor the master hands out: a grant
names the mount it is valid for (see "Safety across master restarts" in docs/store.md).
"""

from __future__ import annotations

import random
import secrets

import msgspec

from kvpool.master.allocator import OffsetAllocator
from kvpool.master.objects import Replica, Segment
from kvpool.protocol import SegmentInfo

STRATEGIES = ("random", "free_ratio_first", "local_first")


def new_epoch() -> int:
    """A random nonzero 63-bit number: two mounts share one with probability 2**-63."""
    return secrets.randbits(63) or 1


class SegmentTable:
    """Segments by name, owners' last heartbeat, and allocation across segments."""

    def __init__(self, strategy: str = "random", alignment: int = 64):
        if strategy not in STRATEGIES:
            raise ValueError(f"allocation strategy must be one of {STRATEGIES}")
        self.strategy = strategy
        self.alignment = alignment
        self.segments: dict[str, Segment] = {}
        self.last_seen: dict[str, float] = {}  # owner_id -> monotonic seconds

    def mount(self, owner_id: str, info: SegmentInfo, now: float) -> Segment | None:
        """Add ``info`` under a new mount epoch; returns the segment (also when already
        mounted by the same owner: the same epoch), None when the name is taken."""
        seg = self.segments.get(info.name)
        if seg is not None:
            same = seg.owner_id == owner_id and msgspec.structs.replace(seg.info, epoch=info.epoch) == info
            return seg if same else None
        stamped = msgspec.structs.replace(info, epoch=new_epoch())
        seg = self.segments[info.name] = Segment(stamped, owner_id, OffsetAllocator(info.size, self.alignment))
        self.last_seen[owner_id] = now
        return seg

    def unmount(self, name: str) -> Segment | None:
        """Drop segment ``name`` (its allocator with it); forget an owner left with none."""
        seg = self.segments.pop(name, None)
        if seg is not None and not self.owned_by(seg.owner_id):
            self.last_seen.pop(seg.owner_id, None)
        return seg

    def owned_by(self, owner_id: str) -> list[str]:
        return [n for n, s in self.segments.items() if s.owner_id == owner_id]

    def expired_owners(self, now: float, ttl_s: float) -> list[str]:
        return [o for o, t in self.last_seen.items() if now - t > ttl_s]

    def order(self, host_id: str, preferred: str) -> list[Segment]:
        """Segments in the order the strategy tries them (``preferred`` name first)."""
        segs = list(self.segments.values())
        random.shuffle(segs)
        if self.strategy == "free_ratio_first":
            segs.sort(key=lambda s: s.allocator.used / max(1, s.allocator.capacity))
        elif self.strategy == "local_first":
            segs.sort(key=lambda s: s.info.host_id != host_id)
        if preferred:
            segs.sort(key=lambda s: s.info.name != preferred)
        return segs

    def allocate(self, size: int, count: int, host_id: str = "", preferred: str = "") -> list[Replica]:
        """Up to ``count`` buffers of ``size`` bytes on distinct segments (best effort)."""
        out: list[Replica] = []
        for seg in self.order(host_id, preferred):
            if len(out) == count:
                break
            offset = seg.allocator.allocate(size)
            if offset is not None:
                out.append(Replica(seg.info.name, offset, size))
        return out

    def free(self, replica: Replica) -> None:
        """Return ``replica``'s buffer; a no-op if its segment is gone (unmounted)."""
        seg = self.segments.get(replica.segment)
        if seg is not None:
            seg.allocator.free(replica.offset, replica.length)

    def rounded(self, size: int) -> int:
        return max(self.alignment, -(-size // self.alignment) * self.alignment)

    @property
    def used_bytes(self) -> int:
        return sum(s.allocator.used for s in self.segments.values())

    @property
    def total_bytes(self) -> int:
        return sum(s.allocator.capacity for s in self.segments.values())
