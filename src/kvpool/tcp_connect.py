"""TCP connections that never end up connected to themselves.

A client retrying a port nobody listens on, on its own host, can be given that very
port as its source port: Linux then joins the socket to itself (a TCP "simultaneous
open"), the connect succeeds, and the socket lingers in TIME-WAIT once closed, holding
the port, so the master (or node) cannot start on it again (EADDRINUSE). Master and node
ports chosen inside the ephemeral range (32768-60999 by default, 50051 for one) are
exposed; a trial hit it by restarting a master while four TCP clients retried it.
:func:`connect` refuses such a socket as the refused connection it stands for and
closes it with a reset, which leaves no TIME-WAIT behind.
"""

from __future__ import annotations

import errno
import socket
import struct

_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, no TIME-WAIT


def connect(addr: tuple[str, int], timeout: float | None) -> socket.socket:
    """``socket.create_connection(addr, timeout)`` (``addr``: (host, port); timeout in
    seconds). Raises what it raises, and ConnectionRefusedError (ECONNREFUSED) for a
    socket connected to itself (nothing listens on the port)."""
    sock = socket.create_connection(addr, timeout=timeout)
    try:
        self_connected = sock.getsockname() == sock.getpeername()
    except OSError:
        self_connected = False  # reset already: the caller's first send or recv says so
    if self_connected:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        sock.close()
        raise ConnectionRefusedError(errno.ECONNREFUSED, "connection refused (nothing listens: "
                                     "the socket was connected to itself)")
    return sock
