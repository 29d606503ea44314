"""Ports for the servers kvpool starts itself (etcd, masters and nodes in tests and
benchmarks, vLLM servers, the anchors' servers), picked before the server binds them."""

from __future__ import annotations

import random
import socket
from pathlib import Path

PORT_FLOOR = 20000  # free_port's ports lie from here up to the kernel's ephemeral range
_ports_given: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, below the kernel's ephemeral range and not given
    before by this process. Below that range no connect() or bind to port 0 elsewhere is
    handed it before its server binds it (seen in CI: a port the kernel had picked, given
    to a vLLM server's metrics, was taken in the 20 s its engine took to start); a
    process may still take it by number, which its server then reports as in use.
    Falls back to the kernel's pick when no port below the range is free."""
    low = _ephemeral_low()
    for _ in range(200 if low > PORT_FLOOR + 1000 else 0):
        port = random.randrange(PORT_FLOOR, low)
        if port in _ports_given:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _ports_given.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux: ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
