"""Master-side records: segments, replicas, read grants, zombies, in-flight puts.

The objects themselves are slots of :class:`~kvpool.master.table.ObjectTable` (a struct
of arrays); these records are what a slot points to when it needs more than its arrays.

An object's lifecycle follows Mooncake Store's replica state machine:
``PutStart`` creates a :class:`PendingPut` whose replicas are PROCESSING (invisible);
``PutEnd`` makes them the object's COMPLETE ``replicas`` (visible); ``PutRevoke``, a
discard timeout or a release timeout ends a pending put without making it visible.
An object with no COMPLETE replicas does not exist for readers.

Reads of one version (replica list) of an object are counted in its :class:`Grants`.
When the version is replaced (upsert) or removed, its buffers become a :class:`Zombie`
that is freed once no read of it is in flight: every grant reported done (ReadDone) or
expired, whichever comes first.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.master.allocator import OffsetAllocator
from kvpool.protocol import SegmentInfo


@dataclass(slots=True)
class Segment:
    """A mounted segment: its description, its owner and its allocator."""

    info: SegmentInfo
    owner_id: str
    allocator: OffsetAllocator
    indexed: bool = False  # its node keeps an index: commits and drops are sent to it


@dataclass(frozen=True, slots=True)
class Replica:
    """``length`` value bytes at ``offset`` of segment ``segment`` (a segment name)."""

    segment: str
    offset: int
    length: int


@dataclass(slots=True, eq=False)
class Grants:
    """Read grants on one version of an object that are neither done nor expired.

    open: how many; latest: deadline of the last one granted (monotonic seconds), so no
    grant on this version outlives it; zombie: set once the version is retired; slot:
    the object's slot in the ObjectTable while this is its current version's.
    """

    open: int = 0
    latest: float = 0.0
    zombie: "Zombie | None" = None
    slot: int = -1


@dataclass(slots=True, eq=False)
class Zombie:
    """Buffers no new reader can reach that may still be read or written: an old version
    (freed when its ``grants`` close, at the latest at ``free_at``) or a taken-over put's
    buffers (``grants`` None: freed at ``free_at``, its writer may still be writing).
    """

    replicas: list[Replica]
    free_at: float  # monotonic seconds
    grants: Grants | None = None


@dataclass(slots=True)
class PendingPut:
    """A put between PutStart and PutEnd; its replicas are PROCESSING."""

    put_id: int
    size: int
    replicas: list[Replica]
    started: float  # monotonic seconds
    soft_pin: int = 0  # protocol.SOFT_PIN_* action applied at PutEnd
    soft_pin_ttl_ms: int = 0  # for SOFT_PIN_ENABLE, resolved (0 clears the pin)
    hard_pin: bool = False
