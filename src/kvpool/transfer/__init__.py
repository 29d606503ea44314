"""Transfer engine: move value bytes between local buffers and segments.

- :mod:`~kvpool.transfer.request`: TransferRequest (op, local view, offset, segment,
  offset, length), TransferStatus, and the Transport interface.
- :mod:`~kvpool.transfer.engine`: TransferEngine (``submit`` -> BatchHandle, ``wait``),
  routing, slicing of large transfers over parallel lanes.
- transports: :class:`~kvpool.transfer.shm.LocalTransport` (segment hosted by this
  process), :class:`~kvpool.transfer.shm.ShmTransport` (same host: mapped POSIX shared
  memory), :class:`~kvpool.transfer.tcp.TcpTransport` (pooled connections, vectored I/O).
- :mod:`~kvpool.transfer.buffers`: registered caller buffers (numpy, torch, CUDA staging);
  :mod:`~kvpool.transfer.views`: flat byte views of caller objects.
- the serving side of a segment (shared memory + TCP data port) is the node:
  :mod:`kvpool.node.segment_host`, :mod:`kvpool.node.data_server`.
"""

from __future__ import annotations

import functools
import socket

from kvpool.transfer.views import as_byte_view

__all__ = ["as_byte_view", "local_host_id"]


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
