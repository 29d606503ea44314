"""Hosts on one machine: network namespaces joined by veth pairs on a bridge.

:class:`Hosts` makes ``n`` namespaces ("hosts"), each with its own network stack and one
interface ``eth0`` at ``10.<net>.0.<i+1>/24``, its veth peer attached to a bridge in a
hub namespace (the "switch"). Nothing is added to the caller's own namespace unless
``join_caller`` (one veth at ``10.<net>.0.254``, for a test or bench driving the hosts
from where it runs); the subnet is private to the bridge, so nothing leaves the machine,
and removing the namespaces removes everything. Per host:
:meth:`Hosts.prefix` (run a command there, with a hostname of its own so kvpool's
host id differs and bytes move over the network, not through /dev/shm),
:meth:`Hosts.partition` / :meth:`Hosts.heal` (its link down / up: a partition),
:meth:`Hosts.shape` (tc netem delay and rate on its link).

Needs root (CAP_NET_ADMIN) and iproute2; :func:`unavailable` says why not where it is
refused. Raises :class:`NetnsError` when an ``ip`` command fails.

Namespaces outlive the process that made them, so each set is recorded while it exists
(:class:`Claim`, a folder locked by its maker, :mod:`kvpool.owned_dir`): a run killed
with -9 runs no cleanup, and the next set made on the machine removes what it left
(:func:`sweep_abandoned_sets`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvpool.errors import KVPoolError
from kvpool.owned_dir import OwnedDir, sweep_abandoned

CLAIM_PREFIX = "kvpool-netns-"  # temporary folders of the sets of namespaces alive
_NAMES = "namespaces"  # a claim's file: one namespace name per line


class NetnsError(KVPoolError):
    """Network namespaces cannot be made or changed here (the ``ip`` error says why)."""


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {out.stderr.strip()[:200]}")


def unavailable() -> str | None:
    """None when namespaces can be made here, else the reason (for a test's skip)."""
    if not shutil.which("ip"):
        return "iproute2 (ip) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"kvp-probe-{os.getpid()}"
    out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if out.returncode != 0:
        return f"ip netns add refused: {out.stderr.strip()[:160]}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Claim:
    """The record of one set of namespaces while this process holds them: a folder
    ``<tmp>/kvpool-netns-*`` locked by this process, listing each namespace before it
    is made. Raises OSError when the folder cannot be made."""

    def __init__(self):
        self._dir = OwnedDir(CLAIM_PREFIX)

    def add(self, name: str) -> None:
        """Record namespace ``name`` (before it is made: a kill in between leaves no
        namespace unrecorded)."""
        with open(self._dir.path / _NAMES, "a") as f:
            f.write(name + "\n")

    def release(self) -> None:
        """The namespaces are deleted: drop the record (idempotent)."""
        self._dir.remove()


def _delete_recorded(folder: Path) -> None:
    """Delete the namespaces a claim's folder lists (gone already: nothing to do)."""
    try:
        for name in (folder / _NAMES).read_text().split():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    except OSError:  # no list (killed before the first name), no ip
        pass


def sweep_abandoned_sets() -> int:
    """Delete the namespaces of sets whose maker is gone (killed with -9: its claim's
    lock was dropped by the kernel); returns how many sets were removed. Never raises."""
    return sweep_abandoned(tempfile.gettempdir(), CLAIM_PREFIX, before_removal=_delete_recorded)


def add_netns(name: str, claim: Claim) -> None:
    """``ip netns add name``, recorded in ``claim`` first. Raises NetnsError."""
    claim.add(name)
    _ip("netns", "add", name)


class Hosts:
    """``n`` namespaces named ``<tag>-h<i>`` on a bridge in ``<tag>-hub``; ``net``
    (1..254) picks the subnet 10.<net>.0.0/24, distinct per concurrent set.
    Use as a context manager (or :meth:`create` / :meth:`delete`)."""

    def __init__(self, tag: str, n: int, net: int = 77, join_caller: bool = False):
        self.tag, self.n, self.net = tag, n, net
        self.hub = f"{tag}-hub"
        self.names = [f"{tag}-h{i}" for i in range(n)]
        self.join_caller = join_caller
        self._made: list[str] = []
        self._claim: Claim | None = None

    @property
    def caller_addr(self) -> str:
        """The caller's address on the bridge (with ``join_caller``)."""
        return f"10.{self.net}.0.254"

    def addr(self, i: int) -> str:
        """The IPv4 address of host ``i``."""
        return f"10.{self.net}.0.{i + 1}"

    def prefix(self, i: int) -> tuple[str, ...]:
        """Command prefix that runs a program in host ``i`` (network namespace and a
        hostname ``<tag>-h<i>`` of its own)."""
        return ("ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.names[i])

    def create(self) -> "Hosts":
        sweep_abandoned_sets()  # a killed run's set may hold the names or the subnet
        self._claim = Claim()
        try:
            add_netns(self.hub, self._claim)
            self._made.append(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                add_netns(ns, self._claim)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", self.hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.hub, "link", "set", f"v{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
            if self.join_caller:  # one veth into the caller's namespace, gone with the hub
                routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
                taken = [line for line in routes.splitlines() if line.startswith(f"10.{self.net}.")]
                if taken:  # e.g. a set a killed run left: its namespaces hold the other end
                    raise NetnsError(f"10.{self.net}.0.0/24 is routed here already ({taken[0].strip()}): pick "
                                     "another net, or remove a set a killed run left (`ip netns list`, "
                                     "`ip netns del` each of its namespaces)")
                dev = f"{self.tag}-c"[:15]
                _ip("link", "add", dev, "type", "veth", "peer", "name", "vc", "netns", self.hub)
                _ip("-n", self.hub, "link", "set", "vc", "master", "br0", "up")
                _ip("addr", "add", f"{self.caller_addr}/24", "dev", dev)
                _ip("link", "set", dev, "up")
        except NetnsError:
            self.delete()
            raise
        return self

    def partition(self, i: int) -> None:
        """Cut host ``i`` off (its link on the switch down): packets are dropped, no
        connection is reset, as when a cable is pulled."""
        _ip("-n", self.hub, "link", "set", f"v{i}", "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", f"v{i}", "up")

    def shape(self, i: int, delay_ms: float = 0.0, rate: str | None = None) -> None:
        """tc netem on host ``i``'s outgoing link: ``delay_ms`` one way and an optional
        ``rate`` ("1gbit"); replaces an earlier shape."""
        args = ["tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{delay_ms}ms"]
        if rate:
            args += ["rate", rate]
        _ip("netns", "exec", self.names[i], *args)

    def delete(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        if self._claim is not None:
            self._claim.release()
            self._claim = None

    def __enter__(self) -> "Hosts":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.delete()
