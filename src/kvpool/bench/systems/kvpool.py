"""kvpool's columns of ``kvpool bench store``: the system measured, beside the anchors it is
compared with (Mooncake, Redis, the limits), through the same harness and worker protocol.

- :class:`KvpoolTarget`: a cluster (master + node processes) started by the worker and one
  client: shared-memory mapping ("kvpool shm") or ``force_tcp`` ("kvpool tcp"); with
  ``client_segment`` and no node, the client's own segment ("kvpool in-proc").
- :class:`VethKvpoolTarget`: the TCP path between two network namespaces (veth pair).
- :func:`client_memory`: resident memory of a client without segment (a probe process).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from kvpool.bench.harness import Target, Unavailable, rss_bytes
from kvpool.bench.systems.netns import VethPair, setns
from kvpool.errors import KVPoolError


class KvpoolTarget(Target):
    """A kvpool cluster (master + node processes) started by this worker, and one client.

    cfg: ``segment_size`` (bytes of the node's segment), ``force_tcp`` (bool),
    ``client_segment`` (bytes: no node; the client contributes its own segment, so
    every object lives in the measuring process: the "same process" layout), ``log_dir``,
    ``alloc_leases`` (bool, default True: False puts every value through PutStart/PutEnd).
    """

    name = "kvpool"

    def open(self, cfg: dict) -> dict:
        try:
            from kvpool.client import Client
            from kvpool.launch import Cluster
        except ImportError as exc:
            raise Unavailable(f"kvpool client not importable: {exc}") from exc
        own = int(cfg.get("client_segment", 0))
        self.cluster = Cluster(segment_size=cfg.get("segment_size", 1 << 30),
                               num_nodes=0 if own else 1, log_dir=cfg.get("log_dir")).start()
        self.master_addr = self.cluster.master_addr
        self.force_tcp = bool(cfg.get("force_tcp"))
        leases = bool(cfg.get("alloc_leases", True))
        self.client = Client(self.master_addr, force_tcp=self.force_tcp, global_segment_size=own,
                             alloc_leases=leases)
        # steady state, as a serving engine runs: the reference engine's workers and the
        # vLLM worker fill their mappings' page tables at start (a first write into an
        # unfilled range costs ~1.5x, docs/store.md); "warmed" says how many bytes
        warmed = 0 if own else self.client.warm_local_segments()
        return {"warmed": warmed, "master": self.master_addr, "force_tcp": self.force_tcp, "alloc_leases": leases,
                "segment_size": own or self.cluster.segment_size, "nodes": self.cluster.node_addrs,
                "pids": [self.cluster.master.proc.pid] + [c.proc.pid for c in self.cluster.node_children]}

    def put_bytes(self, key: str, value: bytes) -> None:
        self.client.put(key, value)

    def get_bytes(self, key: str) -> bytes:
        return self.client.get(key)

    def put_from(self, key: str, buf) -> None:
        self.client.put(key, buf)

    def get_into(self, key: str, buf) -> int:
        return self.client.get_into(key, buf)

    def batch_put_from(self, keys: list[str], bufs: list) -> None:
        bad = [(k, c) for k, c in zip(keys, self.client.batch_put(keys, bufs)) if c != 0]
        if bad:
            raise RuntimeError(f"batch_put: {len(bad)} failed, first {bad[0][0]}: {bad[0][1]!r}")

    def batch_get_into(self, keys: list[str], bufs: list) -> None:
        for key, n, buf in zip(keys, self.client.batch_get_into(keys, bufs), bufs):
            if n != buf.nbytes:
                raise RuntimeError(f"batch_get_into {key}: {n}")

    def remove(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1024):
            self.client.batch_remove(keys[i:i + 1024], force=True)

    def stats(self) -> dict:
        """Resident memory of the node and master, and of a segment-less client probe
        (bytes), then the control plane's bare round trip (``ping_p50_us``: median of
        :data:`PINGS` Pings, microseconds; ``ping_error`` instead when a Ping failed,
        so that the memory figures still count)."""
        out = {}
        if self.cluster.nodes:
            node = self.cluster.nodes[0]
            out = {"segment_size": self.cluster.segment_size,
                   "node_rss_bytes": rss_bytes(int(node["pid"])),
                   "node_peak_rss_bytes": rss_bytes(int(node["pid"]), "VmHWM"),
                   "master_rss_bytes": rss_bytes(self.cluster.master.proc.pid)}
            out.update(client_memory(self.master_addr, self.force_tcp))
        out.update(ping_stats(self.client))
        return out

    def close(self) -> None:
        if getattr(self, "client", None):
            self.client.close()
        if getattr(self, "cluster", None):
            self.cluster.stop()


PINGS = 400  # after a warm-up of as many: the master's busy poll and the client's reply wait settle


def ping_stats(client) -> dict:
    """``{"ping_p50_us": median round trip of a Ping to client's master, us}`` (the
    control plane with no metadata touched: the floor of every small operation; issue
    16 watches the 4 KiB bytes get against it), or ``{"ping_error": why}``."""
    try:
        for _ in range(PINGS):
            client.ping()
        return {"ping_p50_us": statistics.median(client.ping() for _ in range(PINGS)) * 1e6}
    except KVPoolError as exc:
        return {"ping_error": str(exc)[:300]}


_PROBE = r"""
import json, os, sys, numpy as np
from kvpool.bench.harness import rss_bytes
pid = os.getpid()
own = lambda: rss_bytes(pid, "RssAnon") + rss_bytes(pid, "RssFile")
base, base_rss = own(), rss_bytes(pid)
from kvpool.client import Client
c = Client(sys.argv[1], force_tcp=sys.argv[2] == "1")
held = 0
for size, n in ((4096, 512), (1 << 20, 16), (16 << 20, 2)):
    buf = np.ones(size, np.uint8); held += size
    keys = [f"bench-probe-{size}-{i}" for i in range(n)]
    for k in keys:
        c.put(k, buf)
    for k in keys:
        c.get_into(k, buf); c.get(k)
    c.batch_get_into(keys[:16], [np.empty(size, np.uint8) for _ in keys[:16]])
    c.batch_remove(keys, force=True)
print(json.dumps({"own": own() - base - held, "rss": rss_bytes(pid) - base_rss - held,
                  "peak": rss_bytes(pid, "VmHWM") - base_rss - held,
                  "shmem": rss_bytes(pid, "RssShmem")}))
"""


def client_memory(master_addr: str, force_tcp: bool) -> dict:
    """Memory of a client without segment, beyond the interpreter and numpy (bytes).

    A fresh process imports numpy (baseline), then kvpool's client, and puts and gets
    4 KiB, 1 MiB and 16 MiB values (single, bytes and zero-copy, and a batch). Reported
    beyond the baseline and the probe's own buffers: ``client_own_bytes`` (anonymous +
    file pages: the client's memory), ``client_rss_bytes`` (also counting pages of the
    node's segment that the client touched through its mapping: the node's memory,
    shared), ``client_peak_bytes`` (VmHWM).
    """
    out = subprocess.run([sys.executable, "-c", _PROBE, master_addr, "1" if force_tcp else "0"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        return {"client_probe_error": out.stderr.strip().splitlines()[-3:]}
    m = json.loads(out.stdout.strip().splitlines()[-1])
    return {"client_own_bytes": m["own"], "client_rss_bytes": m["rss"],
            "client_peak_bytes": m["peak"], "client_shmem_bytes": m["shmem"]}


class VethKvpoolTarget(KvpoolTarget):
    """kvpool over TCP between two network namespaces joined by a veth pair.

    The worker starts in the host namespace, creates the pair, enters the server
    namespace to start master and node (they inherit it), then enters the client
    namespace to open a ``force_tcp`` client: every byte crosses the veth link.
    """

    name = "kvpool-veth"

    def open(self, cfg: dict) -> dict:
        from kvpool.client import Client
        from kvpool.launch import Cluster

        self.pair = VethPair(str(os.getpid()))
        self.pair.create()
        self.home = os.open("/proc/self/ns/net", os.O_RDONLY)
        try:
            setns(self.pair.server, self.home)
            self.cluster = Cluster(segment_size=cfg.get("segment_size", 1 << 30),
                                   log_dir=cfg.get("log_dir"),
                                   extra_master_args=["--host", self.pair.server_addr],
                                   extra_node_args=["--host", self.pair.server_addr]).start()
            self.master_addr, self.force_tcp = self.cluster.master_addr, True
            setns(self.pair.client, self.home)
            self.client = Client(self.master_addr, force_tcp=True)
        except BaseException:
            self.close()
            raise
        return {"master": self.master_addr, "node": self.cluster.node_addrs,
                "namespaces": [self.pair.server, self.pair.client]}

    def stats(self) -> dict:
        """Only the Ping (as :meth:`KvpoolTarget.stats`): the processes are the same kind
        as "kvpool tcp"'s, whose memory is measured there."""
        return ping_stats(self.client)

    def close(self) -> None:
        super().close()
        if getattr(self, "home", None) is not None:
            setns(None, self.home)
        if getattr(self, "pair", None):
            self.pair.delete()
