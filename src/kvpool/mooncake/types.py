"""Value types of Mooncake's Python store API, as kvpool's facade returns and accepts them.

Names, fields and enum values follow ``mooncake.store`` (Mooncake's pybind module,
mooncake-integration/store/store_py.cpp; ``ReplicateConfig`` in mooncake-store/include/
replica.h), so code that builds a config or reads a replica descriptor runs unchanged.
"""

from __future__ import annotations

import ctypes
import enum


class SoftPinAction(enum.IntEnum):
    """What a put does to the soft pin: keep it (the default), set it, or clear it."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicaStatus(enum.IntEnum):
    """Replica lifecycle states (Mooncake's ReplicaStatus); kvpool hands out COMPLETE only."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class ReplicateConfig:
    """Placement and pinning of one put (Mooncake's ReplicateConfig).

    Attributes (settable; an unknown attribute raises AttributeError, as in Mooncake):
        replica_num: replicas on distinct segments, best effort (>= 1).
        soft_pin_action: SoftPinAction: ENABLE soft-pins the object (evicted last),
            DISABLE clears a soft pin, PRESERVE (default) keeps an existing one on upsert.
        soft_pin_ttl_ms: the soft pin's TTL in ms (None = the master's --soft-pin-ttl);
            only with ENABLE, at most the master's --max-soft-pin-ttl (else -600);
            0 with ENABLE clears the pin, as in Mooncake.
        with_soft_pin: older spelling of ``soft_pin_action == ENABLE``.
        with_hard_pin: never evicted.
        preferred_segment / preferred_segments: where to place the first replica: a
            segment name, or the "host:port" that ``get_hostname()`` of its owner returns.
        prefer_alloc_in_same_node: refused by put forms with -600, as in Mooncake.
    """

    __slots__ = ("replica_num", "soft_pin_action", "soft_pin_ttl_ms", "with_hard_pin",
                 "preferred_segment", "preferred_segments", "prefer_alloc_in_same_node")

    def __init__(self):
        self.replica_num = 1
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: int | None = None
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.prefer_alloc_in_same_node = False

    @property
    def with_soft_pin(self) -> bool:
        return self.soft_pin_action == SoftPinAction.ENABLE

    @with_soft_pin.setter
    def with_soft_pin(self, value: bool) -> None:
        self.soft_pin_action = SoftPinAction.ENABLE if value else SoftPinAction.PRESERVE

    def __str__(self) -> str:
        return (f"ReplicateConfig: {{ replica_num: {self.replica_num}, soft_pin_action: "
                f"{SoftPinAction(self.soft_pin_action).name}, with_hard_pin: {self.with_hard_pin}, "
                f"preferred_segments: {self.preferred_segments}, preferred_segment: {self.preferred_segment!r} }}")


class Descriptor:
    """Where a memory replica lives: ``size`` bytes at ``buffer_address`` of the segment
    served at ``transport_endpoint``. In kvpool ``buffer_address`` is the byte offset in
    the segment (segments are mapped at different addresses in each process)."""

    __slots__ = ("size", "buffer_address", "transport_endpoint", "segment")

    def __init__(self, size: int = 0, buffer_address: int = 0, transport_endpoint: str = "", segment: str = ""):
        self.size, self.buffer_address = size, buffer_address
        self.transport_endpoint, self.segment = transport_endpoint, segment

    def __repr__(self) -> str:
        return (f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
                f"transport_endpoint={self.transport_endpoint}>")


class MemoryDescriptor:
    """A memory replica's buffer (``buffer_descriptor``: :class:`Descriptor`)."""

    __slots__ = ("buffer_descriptor",)

    def __init__(self, buffer_descriptor: Descriptor):
        self.buffer_descriptor = buffer_descriptor


class ReplicaDescriptor:
    """One replica of an object, as ``get_replica_desc`` returns it (memory replicas only)."""

    __slots__ = ("status", "_memory")

    def __init__(self, memory: MemoryDescriptor, status: ReplicaStatus = ReplicaStatus.COMPLETE):
        self.status, self._memory = status, memory

    def is_memory_replica(self) -> bool:
        return True

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        return self._memory

    def get_disk_descriptor(self):
        raise RuntimeError("kvpool replicas are memory replicas; there is no disk descriptor")


class BufferHandle(bytearray):
    """A value read by ``get_buffer``: a private copy of the object's bytes that
    supports the buffer protocol (``memoryview(h)``, ``np.array(h, copy=False)``),
    ``len(h)``, ``h.size()`` and ``h.ptr()`` (its address, valid while ``h`` lives).
    It holds no lease: the bytes were checked against the lease when copied."""

    def size(self) -> int:
        return len(self)

    def ptr(self) -> int:
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self)) if len(self) else 0
