"""Value types of Mooncake's Python store API, as kvpool's facade returns and accepts them.

Names, fields and enum values follow ``mooncake.store`` (Mooncake's pybind module,
mooncake-integration/store/store_py.cpp; ``ReplicateConfig`` in mooncake-store/include/
replica.h), so code that builds a config or reads a replica descriptor runs unchanged.
"""

from __future__ import annotations

import ctypes
import enum
import numbers
import operator
from collections.abc import Sequence


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


def _uint(name: str, value, optional: bool = False) -> int | None:
    """An unsigned 64-bit int, as pybind11 converts to ``size_t`` / ``uint64_t``:
    ints and objects with ``__index__`` (numpy ints, bools) pass; floats, text and
    negatives raise TypeError; None only where the C++ field is optional."""
    if value is None and optional:
        return None
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"ReplicateConfig.{name} must be an unsigned int{' or None' if optional else ''}, "
                        f"not {type(value).__name__}") from None
    if not 0 <= number < 1 << 64:
        raise TypeError(f"ReplicateConfig.{name} must be in 0..2**64-1, got {number}")
    return number


def _flag(name: str, value) -> bool:
    """pybind11's bool conversion: True/False, None (False), and numbers (their truth);
    text, lists and other objects raise TypeError."""
    if value is None or isinstance(value, (bool, numbers.Number)):
        return bool(value)
    raise TypeError(f"ReplicateConfig.{name} must be bool, not {type(value).__name__}")


def _text(name: str, value) -> str:
    """A std::string field: str, or bytes decoded as UTF-8; anything else TypeError."""
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise TypeError(f"ReplicateConfig.{name}: bytes that are not UTF-8") from None
    if not isinstance(value, str):
        raise TypeError(f"ReplicateConfig.{name} must be str, not {type(value).__name__}")
    return value


def _texts(name: str, value) -> list[str]:
    """A std::vector<std::string> field: any non-text sequence of str (copied)."""
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise TypeError(f"ReplicateConfig.{name} must be a list of str, not {type(value).__name__}")
    return [_text(name, v) for v in value]


def _action(name: str, value) -> SoftPinAction:
    """A SoftPinAction member only (pybind11 enums do not convert from int)."""
    if not isinstance(value, SoftPinAction):
        raise TypeError(f"ReplicateConfig.{name} must be a SoftPinAction, not {type(value).__name__}")
    return value


class _Field:
    """One typed attribute: ``check(name, value)`` converts or raises TypeError on set,
    as pybind11's ``def_readwrite`` does; a list field reads back as a copy (pybind
    converts a std::vector to a new list on each read)."""

    def __init__(self, check, default):
        self.check, self.default = check, default

    def __set_name__(self, owner, name):
        self.name, self.slot = name, "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = getattr(obj, self.slot, self.default)
        return list(value) if isinstance(value, list) else value

    def __set__(self, obj, value):
        setattr(obj, self.slot, self.check(self.name, value))


class ReplicateConfig:
    """Placement and pinning of one put (Mooncake's ReplicateConfig).

    Attributes (settable; each is type-checked on assignment like Mooncake's pybind11
    binding: a wrong type raises TypeError; an unknown attribute raises AttributeError):
        replica_num: unsigned int; replicas on distinct segments, best effort (>= 1,
            else the put returns -600).
        soft_pin_action: SoftPinAction: ENABLE soft-pins the object (evicted last),
            DISABLE clears a soft pin, PRESERVE (default) keeps an existing one on upsert.
        soft_pin_ttl_ms: unsigned int or None; the soft pin's TTL in ms (None, the
            default and what assigning None restores = the master's --soft-pin-ttl);
            only with ENABLE, at most the master's --max-soft-pin-ttl (else -600);
            0 with ENABLE clears the pin, as in Mooncake.
        with_soft_pin: bool; older spelling of ``soft_pin_action == ENABLE``.
        with_hard_pin: bool; never evicted.
        preferred_segment: str; where to place the first replica: a segment name, or
            the "host:port" that ``get_hostname()`` of its owner returns.
        preferred_segments: list of str, one per replica (reads back as a copy).
        prefer_alloc_in_same_node: bool; refused by put forms with -600, as in Mooncake.
    """

    __slots__ = ("_replica_num", "_soft_pin_action", "_soft_pin_ttl_ms", "_with_hard_pin",
                 "_preferred_segment", "_preferred_segments", "_prefer_alloc_in_same_node")

    replica_num = _Field(_uint, 1)
    soft_pin_action = _Field(_action, SoftPinAction.PRESERVE)
    soft_pin_ttl_ms = _Field(lambda name, v: _uint(name, v, optional=True), None)
    with_hard_pin = _Field(_flag, False)
    preferred_segment = _Field(_text, "")
    preferred_segments = _Field(_texts, [])
    prefer_alloc_in_same_node = _Field(_flag, False)

    @property
    def with_soft_pin(self) -> bool:
        return self.soft_pin_action == SoftPinAction.ENABLE

    @with_soft_pin.setter
    def with_soft_pin(self, value) -> None:
        self.soft_pin_action = SoftPinAction.ENABLE if _flag("with_soft_pin", value) else SoftPinAction.PRESERVE

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else self.soft_pin_ttl_ms
        return (f"ReplicateConfig: {{ replica_num: {self.replica_num}, soft_pin_action: "
                f"{self.soft_pin_action.name}, soft_pin_ttl_ms: {ttl}, with_hard_pin: {self.with_hard_pin}, "
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
