"""Network namespaces for the benchmark: a private one, and a pair joined by veth.

- :func:`private_netns_prefix`: a command prefix that runs a worker in a fresh network
  namespace holding only loopback. Mooncake's transfer engine listens on the wildcard
  address; inside such a namespace nothing outside the machine can reach it.
- :class:`VethPair`: two namespaces joined by a veth pair (a real network device instead
  of loopback), when the machine allows it (root), for kvpool's "other host" layout.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

from kvpool.bench.harness import Unavailable
from kvpool.netns import Claim, sweep_abandoned_sets

_PRIVATE = ("unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh")


def private_netns_prefix() -> tuple[tuple[str, ...], str | None]:
    """(prefix, None) when a private network namespace can be made here, else ((), reason)."""
    if not shutil.which("unshare") or not shutil.which("ip"):
        return (), "unshare/ip not found"
    probe = subprocess.run([*_PRIVATE, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return (), f"private network namespace refused: {probe.stderr.strip()[:160]}"
    return _PRIVATE, None


_CLONE_NEWNET = 0x40000000
_SERVER_ADDR, _CLIENT_ADDR = "127.77.0.1", "127.77.0.2"


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise Unavailable(f"ip {' '.join(args)}: {out.stderr.strip()[:160]}")


def setns(name: str | None, original: int) -> None:
    """Move this (single-threaded) process into netns ``name`` (None: back to ``original``).

    Python 3.11 has no ``os.setns``; libc's ``setns(2)`` does the same. Children and
    threads started afterwards inherit the namespace, sockets opened before keep theirs.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY) if name else original
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise Unavailable(f"setns({name}): {os.strerror(ctypes.get_errno())}")
    finally:
        if name:
            os.close(fd)


class VethPair:
    """Two network namespaces joined by a veth pair, addressed inside 127.0.0.0/8.

    The addresses are loopback-range (with ``route_localnet``), live only inside the two
    private namespaces and vanish with them: nothing leaves the machine.
    Raises Unavailable when the machine refuses (not root, no ``ip netns``).
    """

    server_addr = _SERVER_ADDR

    def __init__(self, tag: str):
        self.server, self.client = f"kvb-{tag}-s", f"kvb-{tag}-c"
        self.made: list[str] = []
        self._claim: Claim | None = None

    def create(self) -> None:
        if not shutil.which("ip"):
            raise Unavailable("iproute2 (ip) not installed")
        sweep_abandoned_sets()  # what a benchmark killed with -9 left (kvpool.netns)
        self._claim = Claim()
        try:
            for ns in (self.server, self.client):
                self._claim.add(ns)
                _ip("netns", "add", ns)
                self.made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", "kvb0", "netns", self.server, "type", "veth",
                "peer", "name", "kvb1", "netns", self.client)
            for ns, dev, addr in ((self.server, "kvb0", _SERVER_ADDR),
                                  (self.client, "kvb1", _CLIENT_ADDR)):
                for scope in ("all", dev):
                    _ip("netns", "exec", ns, "sysctl", "-qw",
                        f"net.ipv4.conf.{scope}.route_localnet=1")
                _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
        except Unavailable:
            self.delete()
            raise

    def delete(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()
        if self._claim is not None:
            self._claim.release()
            self._claim = None
