"""Same-host control connections over a Unix socket instead of loopback TCP.

A master that listens on TCP ``ip:port`` also listens on the Linux abstract Unix socket
named ``kvpool-master/ip:port`` (:func:`listen_name`): no file to clean up, the name
vanishes with the process, and like a port it belongs to one network namespace, so a
client in another namespace ("another host") never finds it and uses TCP. A client or
node given ``host:port`` tries those names first (:func:`connect`), then TCP.

Why: a request/reply round trip between two processes here costs 55-65 us over a Unix
socket against 95-110 us over loopback TCP (uvloop echo of 40-byte frames, the 2-core
VM of docs/bench.md, alternating runs): the TCP stack's send path and the wake-up of
the peer dominate a small RPC, and every put and get pays one.

Only exact names are tried, plus the wildcard master (``0.0.0.0:port``, ``[::]:port``)
for a loopback address, which is the one loopback TCP would reach too: a master at
``0.0.0.0:port`` on this host is not the one a client of ``10.0.0.5:port`` (maybe
another host) wants. A master whose name is taken refuses to start (another process
could otherwise answer this host's clients in its place). ``KVPOOL_LOCAL_SOCKET=0``
turns the Unix socket off on both sides (every connection TCP).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

from kvpool.config import format_addr

PREFIX = "kvpool-master/"
WILDCARDS = ("0.0.0.0", "::")


def enabled() -> bool:
    """Abstract Unix sockets exist on Linux only; the environment may turn them off."""
    return sys.platform == "linux" and os.environ.get("KVPOOL_LOCAL_SOCKET", "1") != "0"


def listen_name(ip: str, port: int) -> str:
    """The abstract socket name (leading NUL) of a master bound to TCP ``ip:port``."""
    return "\0" + PREFIX + format_addr(ip, port)


def _ips(host: str) -> list[str]:
    """IP literals of ``host`` (a literal, or a name resolved without the network:
    /etc/hosts first); [] when it does not resolve."""
    try:
        return [ipaddress.ip_address(host).compressed]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return list(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%")[0]).compressed for info in infos))


def connect_names(host: str, port: int) -> list[str]:
    """Names to try, in order, for a master at ``host:port`` (module docstring)."""
    ips = _ips(host)
    names = [listen_name(ip, port) for ip in ips]
    if any(ipaddress.ip_address(ip).is_loopback for ip in ips):
        names += [listen_name(w, port) for w in WILDCARDS]
    return names


def connect(host: str, port: int, timeout_s: float) -> socket.socket | None:
    """A connected Unix socket to the master of ``host:port`` on this host, or None
    (none listens under its names, or they are turned off: use TCP)."""
    if not enabled():
        return None
    for name in connect_names(host, port):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(name)
        except OSError:
            sock.close()
            continue
        return sock
    return None
