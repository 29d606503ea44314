"""Hostile input and hostile clients (K22 what a connection may cost, K23 one request must
not stall the server, rogue field values): real master and node processes, raw sockets.
"""

from __future__ import annotations

import socket
import time

import pytest

from kvpool import protocol as P
from kvpool.client import Client
from kvpool.config import parse_addr

STALLERS = 12  # the field recipe: 12 idle connections, each a header announcing MAX_FRAME


def _rss(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes (/proc/PID/status VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _stall(addr: str, header: bytes, body_part: bytes = b"") -> socket.socket:
    sock = socket.create_connection(parse_addr(addr), timeout=10)
    sock.sendall(header + body_part)
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    """True once the server has closed ``sock`` (EOF or reset), False while it is open."""
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def _wait_all_closed(socks, sample, timeout_s: float = 30.0) -> None:
    """Poll until the server closed every socket, calling ``sample()`` on each round."""
    deadline = time.monotonic() + timeout_s
    open_socks = list(socks)
    while open_socks:
        sample()
        assert time.monotonic() < deadline, f"{len(open_socks)} stalled connections still open"
        open_socks = [s for s in open_socks if not _closed_by_peer(s)]
        time.sleep(0.02)


@pytest.mark.cluster(segment_size="16MiB", extra_node_args=("--frame-timeout", "1"))
def test_node_memory_is_bounded_by_the_bytes_a_connection_sent(cluster):
    """K22: headers announcing 64 MiB bodies cost the node what was sent, not what was
    announced; the node closes them after its frame timeout; other clients keep working."""
    pid, addr = int(cluster.nodes[0]["pid"]), cluster.node_addrs[0]
    header = P.HEADER.pack(P.MAGIC, P.MAX_FRAME)
    with Client(cluster.master_addr, force_tcp=True, timeout_s=5.0) as c:
        c.put("warm", b"w" * 4096)
        assert c.get("warm") == b"w" * 4096
        before = _rss(pid)
        socks = [_stall(addr, header, b"\x00" * 100) for _ in range(STALLERS)]
        peak = [before]
        try:
            c.put("during", b"d" * 65536)  # a well-behaved client is served meanwhile
            assert c.get("during") == b"d" * 65536
            _wait_all_closed(socks, lambda: peak.append(_rss(pid)))
        finally:
            for s in socks:
                s.close()
        grown = max(peak) - before
        assert grown < 32 << 20, f"node RSS grew {grown >> 20} MiB for {STALLERS} stalled headers"
        assert c.get("warm") == b"w" * 4096


@pytest.mark.cluster(segment_size="16MiB", extra_master_args=("--frame-timeout", "1"))
def test_master_closes_a_connection_stalled_mid_frame(cluster):
    """K22 on the control port: a frame whose body never comes is closed after the frame
    timeout, at no memory cost, while other clients' requests are answered."""
    pid = int(cluster.master.info["pid"])
    header = P.HEADER.pack(P.MAGIC, P.MAX_FRAME)
    before = _rss(pid)
    socks = [_stall(cluster.master_addr, header, b"\x91") for _ in range(STALLERS)]
    peak = [before]
    try:
        with Client(cluster.master_addr, timeout_s=5.0) as c:
            assert c.ping() >= 0
            c.put("m", b"m" * 1024)
            assert c.get("m") == b"m" * 1024
        _wait_all_closed(socks, lambda: peak.append(_rss(pid)))
    finally:
        for s in socks:
            s.close()
    assert max(peak) - before < 32 << 20
