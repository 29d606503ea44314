"""Where the master is: one address, a list of masters, or the leader named in etcd.

A master spec is what clients and nodes are given as ``--master`` / ``master_addr``:

- ``host:port`` (or ``[v6]:port``): one master, as before;
- ``host1:port1,host2:port2``: masters of one HA group; whichever answers without
  refusing (a standby refuses every request with UNAVAILABLE_IN_CURRENT_STATUS) is the
  leader;
- ``etcd://host:2379[,host:2379...][/key]``: ask etcd which master leads (the value of
  ``key``, default :data:`DEFAULT_KEY`, written by the leader: :mod:`kvpool.master.election`).

:class:`MasterAddrs` gives the addresses to try, in order: the one that answered last
first, one that failed last at the back.
"""

from __future__ import annotations

from kvpool.config import format_addr, parse_addr
from kvpool.errors import UserError

DEFAULT_KEY = "kvpool/master/leader"
ETCD_SCHEME = "etcd://"


DEFAULT_MASTER_PORT = 50051  # Mooncake master's default rpc_port


def check_spec(text: str, default_port: int | None = None) -> str:
    """The canonical form of master spec ``text``. Raises UserError naming the bad part."""
    text = str(text).strip()
    if text.startswith(ETCD_SCHEME):
        hosts, _, key = text[len(ETCD_SCHEME):].partition("/")
        if not hosts:
            raise UserError(f"bad master {text!r}: etcd://host:port[,host:port...][/key]")
        for h in hosts.split(","):
            parse_addr(h)
        return text
    addrs = [a for a in text.split(",") if a.strip()]
    if not addrs:
        raise UserError("no master address given")
    return ",".join(format_addr(*parse_addr(a, default_port)) for a in addrs)


class MasterAddrs:
    """The candidate master addresses of a spec (see the module docstring).

    ``ha``: more than one master may lead (a list or etcd): callers keep trying across
    a change of leader instead of failing at the first broken connection.
    Raises UserError for a malformed spec.
    """

    def __init__(self, spec: str):
        self.spec = check_spec(spec)
        self._etcd = None
        self._key = DEFAULT_KEY
        if self.spec.startswith(ETCD_SCHEME):
            from kvpool.etcd import Etcd

            hosts, _, key = self.spec[len(ETCD_SCHEME):].partition("/")
            self._etcd = Etcd(hosts, timeout_s=2.0)
            self._key = key or DEFAULT_KEY
            self._addrs: list[str] = []
        else:
            self._addrs = self.spec.split(",")
        self.ha = self._etcd is not None or len(self._addrs) > 1

    def candidates(self) -> list[str]:
        """Addresses to try now, best first. With etcd: the leader it names (none while
        no master leads, or etcd is unreachable)."""
        if self._etcd is None:
            return list(self._addrs)
        from kvpool.etcd import EtcdError

        try:
            leader = self._etcd.get(self._key)
        except EtcdError:
            return []
        return [leader] if leader else []

    def answered(self, addr: str) -> None:
        """``addr`` served a request: try it first next time."""
        if addr in self._addrs and self._addrs[0] != addr:
            self._addrs.remove(addr)
            self._addrs.insert(0, addr)

    def failed(self, addr: str) -> None:
        """``addr`` refused (a standby) or broke: try it last next time."""
        if addr in self._addrs and len(self._addrs) > 1:
            self._addrs.remove(addr)
            self._addrs.append(addr)
