"""Start an etcd server and an HA group of masters with nodes (tests, ``bench chaos``).

:class:`EtcdServer` runs Debian's ``etcd`` (package ``etcd-server``) on loopback with a
temporary data directory and free ports. :class:`HAGroup` starts ``masters`` masters
with ``--etcd`` (one leads, the others stand by) and nodes that know every master
(``--master h1:p1,h2:p2``); a master killed is started again on its own port, as a
standby. Children are :class:`kvpool.launch.Child` processes (ready files, logs, stop
ladder); ``prefix`` runs one inside a network namespace (``ip netns exec NS``).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from kvpool.auth import secret_from_env
from kvpool.child import spawn, stop_ladder
from kvpool.etcd import Etcd, EtcdError
from kvpool.launch import Child, LaunchError
from kvpool.master.cli import LOST_LEAD
from kvpool.masters import DEFAULT_KEY
from kvpool.ports import free_port
from kvpool.rpc import is_leader


def etcd_binary() -> str | None:
    """The path of the ``etcd`` server binary, or None when it is not installed."""
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/sbin/etcd") if Path(p).exists()), None)


class EtcdServer:
    """A one-member etcd cluster on ``host`` (loopback), data in a temporary folder
    removed on :meth:`stop`; ``prefix``: run it in a network namespace (``ip netns exec
    NS``; this process must reach ``host``). ``url``: its client endpoint. Raises
    LaunchError when etcd is not installed or does not answer within ``timeout_s``."""

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 20.0, prefix=()):
        binary = etcd_binary()
        if binary is None:
            raise LaunchError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.dir = Path(tempfile.mkdtemp(prefix="kvpool-etcd-"))
        # in a namespace of its own (prefix) etcd's usual ports are free, and ours cannot probe there
        client, peer = (2379, 2380) if prefix else (free_port(host), free_port(host))
        self.url = f"http://{host}:{client}"
        peer_url = f"http://{host}:{peer}"
        cmd = [*prefix, binary, "--name", "kvpool", "--data-dir", str(self.dir / "data"),
               "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
               "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
               "--initial-cluster", f"kvpool={peer_url}", "--log-level", "warn"]
        self.log_path = self.dir / "etcd.log"
        with open(self.log_path, "ab") as log:
            self.proc = spawn(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.client = Etcd(self.url, timeout_s=1.0)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.client.get("kvpool/probe")
                return
            except EtcdError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = self.log_path.read_text(errors="replace")[-2000:]
                    self.stop()
                    raise LaunchError(f"etcd did not come up (status {self.proc.poll()}):\n{tail}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        stop_ladder(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


Place = tuple[tuple[str, ...], str]  # (command prefix, e.g. ip netns exec NS; address to listen on)


class HAGroup:
    """An etcd server, ``masters`` masters in one HA group and ``num_nodes`` nodes.

    ``master_args`` / ``node_args``: more flags for every master / node;
    ``lease_ttl_s``: the masters' ``--etcd-lease-ttl``; ``host``: where everything
    listens by default. ``places`` (optional): where each runs, a :data:`Place` per
    role: ``{"etcd": place, "masters": [place per master], "nodes": [place per node]}``
    (hosts of :class:`kvpool.netns.Hosts`); a master or node started again keeps its place.
    ``master_spec``: what clients and nodes are given ("h1:p1,h2:p2"). A shared secret:
    set ``KVPOOL_SECRET`` in the environment before making the group: the children
    inherit it, and its leader checks answer with it.
    Use as a context manager; raises LaunchError when a child does not come up.
    """

    def __init__(self, masters: int = 2, num_nodes: int = 1, segment_size: str = "64MiB",
                 lease_ttl_s: int = 2, master_args=(), node_args=(), host: str = "127.0.0.1",
                 startup_timeout_s: float = 30.0, places: dict | None = None):
        self.segment_size = segment_size
        self.lease_ttl_s, self.startup_timeout_s = lease_ttl_s, startup_timeout_s
        self.master_args, self.node_args = [str(a) for a in master_args], [str(a) for a in node_args]
        self.default_place: Place = ((), host)
        here, places = self.default_place, places or {}
        self.etcd_place: Place = places.get("etcd", here)
        self.master_places: list[Place] = list(places.get("masters", [here] * masters))
        self.node_places: list[Place] = []  # per started node
        self._first_nodes: list[Place] = list(places.get("nodes", [here] * num_nodes))
        self.workdir = Path(tempfile.mkdtemp(prefix="kvpool-ha-"))
        self.etcd: EtcdServer | None = None
        self.masters: list[Child | None] = [None] * len(self.master_places)
        self.master_addrs: list[str] = [""] * len(self.master_places)
        self.nodes: list[Child] = []
        self.lost_leads = 0  # masters restarted by supervise()
        self.secret = secret_from_env() or b""  # what the children inherit (leader checks)
        self._starts = 0

    @property
    def master_spec(self) -> str:
        return ",".join(self.master_addrs)

    def _tag(self, kind: str) -> str:
        self._starts += 1
        return f"{kind}{self._starts}"

    def start(self) -> "HAGroup":
        try:
            prefix, host = self.etcd_place
            self.etcd = EtcdServer(host, prefix=prefix)
            for i in range(len(self.masters)):
                self.start_master(i, port=0)
            self.wait_leader()
            for place in self._first_nodes:
                self.start_node(place)
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self, i: int, port: int | None = None) -> Child:
        """Start master ``i`` (again: on its own place and port, as a standby while
        another leads)."""
        if port is None:
            port = int(self.master_addrs[i].rsplit(":", 1)[1])
        prefix, host = self.master_places[i]
        args = ["--host", host, "--port", str(port), "--etcd", self.etcd.url,
                "--etcd-lease-ttl", str(self.lease_ttl_s), *self.master_args]
        child = Child("master", args, self.workdir, self.workdir, self._tag("master"), prefix=prefix)
        self.masters[i] = child
        self.master_addrs[i] = child.wait_ready(self.startup_timeout_s)["addr"]
        return child

    def start_node(self, place: Place | None = None, extra_args=()) -> int:
        """Start one more node (all masters known to it) at ``place`` (default: ``host``);
        returns its index in ``nodes``."""
        prefix, host = place or self.default_place
        args = ["--master", self.master_spec, "--host", host, "--port", "0",
                "--segment-size", self.segment_size, *self.node_args, *[str(a) for a in extra_args]]
        child = Child("node", args, self.workdir, self.workdir, self._tag("node"), prefix=prefix)
        self.nodes.append(child)
        self.node_places.append((prefix, host))
        child.wait_ready(self.startup_timeout_s)
        return len(self.nodes) - 1

    def leader_addr(self) -> str | None:
        """The address etcd names as leader, None while none leads (or etcd, busy,
        did not answer in time)."""
        try:
            return self.etcd.client.get(DEFAULT_KEY)
        except EtcdError:
            return None

    def leader_index(self) -> int | None:
        """Which master leads and serves now (None: none)."""
        addr = self.leader_addr()
        # the secret its children took (KVPOOL_SECRET, inherited); b"" would ask a master
        # run with one without answering its challenge, and never find the leader
        if addr in self.master_addrs and is_leader(addr, secret=self.secret):
            return self.master_addrs.index(addr)
        return None

    def supervise(self) -> int:
        """Do what a supervisor does: start again, as standbys, the masters that stopped
        because they lost the lead (exit status 3: their lease ran out, e.g. renewals
        starved on a busy machine); returns how many. Counted in ``lost_leads``."""
        restarted = 0
        for i, child in enumerate(self.masters):
            if child is not None and not child.stopped and child.proc.poll() == LOST_LEAD:
                child.stopped = True  # its exit was the fence working, not a failure
                self.lost_leads += 1
                self.start_master(i)
                restarted += 1
        return restarted

    def wait_leader(self, timeout_s: float = 30.0) -> int:
        """Wait until a master leads and serves (restarting masters that lost the lead,
        :meth:`supervise`); returns its index. Raises LaunchError."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.supervise()
            i = self.leader_index()
            if i is not None:
                return i
            time.sleep(0.02)
        raise LaunchError(f"no master leads after {timeout_s} s (logs in {self.workdir})")

    def stop(self) -> None:
        for child in [*self.nodes, *self.masters]:
            if child is not None:
                child.stop()
        if self.etcd is not None:
            self.etcd.stop()
        failed = any(c is not None and c.failed for c in [*self.nodes, *self.masters])
        if not failed:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "HAGroup":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
