"""Transfer engine: move value bytes between local buffers and segments.

- :mod:`~kvpool.transfer.request`: TransferRequest (op, local view, offset, segment,
  offset, length), TransferStatus, and the Transport interface.
- :mod:`~kvpool.transfer.engine`: TransferEngine (``submit`` -> BatchHandle, ``wait``),
  routing, slicing of large transfers over parallel lanes.
- transports: :class:`~kvpool.transfer.shm.LocalTransport` (segment hosted by this
  process), :class:`~kvpool.transfer.shm.ShmTransport` (same host: mapped POSIX shared
  memory), :class:`~kvpool.transfer.tcp.TcpTransport` (pooled connections, vectored I/O).
- :mod:`~kvpool.transfer.buffers`: registered caller buffers (numpy, torch, CUDA staging).
- hosting a segment: :mod:`~kvpool.transfer.segment_host`, :mod:`~kvpool.transfer.data_server`.
"""

from __future__ import annotations

import functools
import socket

from kvpool.errors import InvalidParams


@functools.lru_cache(maxsize=1)
def local_host_id() -> str:
    """Identity of this machine: hostname plus /etc/machine-id (or the boot id).

    Two processes with the same id share /dev/shm, so a segment of one can be mapped by
    the other. Containers on one kernel with separate /dev/shm should differ in hostname.
    """
    ident = ""
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path) as f:
                ident = f.read().strip()
        except OSError:
            continue
        if ident:
            break
    return f"{socket.gethostname()}/{ident}"


def as_byte_view(buf, writable: bool = False) -> memoryview:
    """A flat unsigned-byte memoryview of ``buf`` (bytes, bytearray, memoryview, numpy
    array, torch CPU tensor or any C-contiguous buffer), sharing its memory. Raises
    InvalidParams if not contiguous (or not writable when ``writable``)."""
    if type(buf).__module__.startswith("torch"):
        from kvpool.transfer.buffers import is_torch_tensor, tensor_byte_view

        if is_torch_tensor(buf):
            return tensor_byte_view(buf)
    try:
        view = memoryview(buf)
    except TypeError:
        raise InvalidParams(f"{type(buf).__name__} does not expose a buffer") from None
    if not view.c_contiguous:
        raise InvalidParams("buffer must be C-contiguous")
    if writable and view.readonly:
        raise InvalidParams("destination buffer is read-only")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
