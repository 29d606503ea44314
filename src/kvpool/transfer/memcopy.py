"""Copies between a caller's buffer and a same-host segment: streaming stores when large.

A value written into a shared-memory pool is read later, usually by another process,
so bringing its destination lines into this core's cache first (the read-for-ownership
a plain ``memcpy`` does) only costs time and evicts the writer's own working set.
Streaming (non-temporal) stores skip both: on this machine a 1 MiB copy into pool
memory not touched lately takes 104-126 us instead of 160 us with ``memcpy`` (docs/bench.md,
"Streaming stores; the TCP request-and-reply ceiling"). Smaller values keep the plain copy: their destination may well be
in the cache already (a reused buffer), where a plain copy wins (64 KiB into a cached
buffer: 1.7 us plain against 4.3 streamed; into pool memory 10 against 8).

The streaming copy is the compiled :mod:`kvpool.transfer._streamcopy` (x86-64 SSE2).
Where it was not built (no C compiler at install time) every copy is a plain
memoryview assignment, which is correct, only slower.
"""

from __future__ import annotations

try:
    from kvpool.transfer._streamcopy import copy as _stream_copy
except ImportError:  # built without a C compiler: plain copies only
    _stream_copy = None

STREAM_MIN = 256 << 10  # bytes; from here up values are copied with streaming stores


def copy_into(dst: memoryview, src) -> None:
    """Copy ``src`` (a C-contiguous buffer of ``len(dst)`` bytes) into ``dst`` (a writable,
    C-contiguous byte view). Raises ValueError when the lengths differ."""
    if _stream_copy is not None and len(dst) >= STREAM_MIN:
        _stream_copy(dst, src)
    else:
        dst[:] = src


def streaming() -> bool:
    """Whether large copies use streaming stores here (the extension is built)."""
    return _stream_copy is not None
