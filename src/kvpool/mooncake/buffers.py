"""Memory the caller registered with ``register_buffer(ptr, size)``, and views over it.

Mooncake's zero-copy calls take raw addresses (``numpy_array.ctypes.data``,
``tensor.data_ptr()``). kvpool turns an address into a memoryview with ctypes only when
the whole range ``[ptr, ptr + size)`` lies inside one registered region, so a wrong
pointer or size is refused (-600) instead of reading or writing foreign memory. Mooncake
calls unregistered use undefined behaviour; refusing it is kvpool's stricter choice.
"""

from __future__ import annotations

import ctypes
import threading


class RegisteredBuffers:
    """Registered regions (base address -> size in bytes); thread-safe."""

    def __init__(self):
        self._regions: dict[int, int] = {}
        self._lock = threading.Lock()

    def register(self, ptr: int, size: int) -> bool:
        """Add ``[ptr, ptr + size)``; re-registering a base replaces its size.
        False for a null pointer or a size <= 0."""
        if ptr <= 0 or size <= 0:
            return False
        with self._lock:
            self._regions[ptr] = size
        return True

    def unregister(self, ptr: int) -> bool:
        """Forget the region starting at ``ptr``; False if none starts there."""
        with self._lock:
            return self._regions.pop(ptr, None) is not None

    def capacity(self, ptr: int) -> int:
        """Bytes from ``ptr`` to the end of the registered region holding it (0 if none)."""
        with self._lock:
            ends = [base + n for base, n in self._regions.items() if base <= ptr < base + n]
        return max(ends, default=ptr) - ptr

    def view(self, ptr: int, size: int) -> memoryview | None:
        """A writable byte view of ``size`` bytes at ``ptr``, or None unless the range is
        inside one registered region (and ``size`` >= 0)."""
        if not isinstance(ptr, int) or not isinstance(size, int) or size < 0 or self.capacity(ptr) < size:
            return None
        if size == 0:
            return memoryview(bytearray())
        return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")

    def clear(self) -> None:
        with self._lock:
            self._regions.clear()
