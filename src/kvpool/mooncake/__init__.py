"""Mooncake Store's Python API on kvpool: change one import and keep your code.

``from mooncake.store import MooncakeDistributedStore, ReplicateConfig`` becomes
``from kvpool.mooncake.store import MooncakeDistributedStore, ReplicateConfig`` (or
``from kvpool.mooncake import ...``). Return codes are Mooncake's ErrorCode integers
(:class:`kvpool.errors.ErrorCode`). See docs/mooncake-compat.md for what differs.
"""

from kvpool.errors import ErrorCode
from kvpool.mooncake.store import MooncakeDistributedStore
from kvpool.mooncake.types import (
    BufferHandle, Descriptor, MemoryDescriptor, ReplicaDescriptor, ReplicaStatus, ReplicateConfig, SoftPinAction,
)

__all__ = [
    "BufferHandle", "Descriptor", "ErrorCode", "MemoryDescriptor", "MooncakeDistributedStore",
    "ReplicaDescriptor", "ReplicaStatus", "ReplicateConfig", "SoftPinAction",
]
