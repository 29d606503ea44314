"""Transfer engine: move value bytes between a local buffer and a replica's buffer.

Two transports behind one interface (``write(desc, src)``, ``read_into(desc, dst)``,
batch forms): :class:`~kvpool.transfer.shm.ShmTransport` maps a same-host segment's
POSIX shared memory and copies with one memcpy; :class:`~kvpool.transfer.tcp.TcpTransport`
talks to the owning node's data port. :func:`local_host_id` decides which applies.
"""

from __future__ import annotations

import functools
import socket


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
    array or any C-contiguous buffer). Raises InvalidParams if not contiguous (or not
    writable when ``writable``)."""
    from kvpool.errors import InvalidParams

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
