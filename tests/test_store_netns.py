"""Many hosts: master, nodes and a client in separate network namespaces on a bridge.

Each "host" is a network namespace with its own stack, address and hostname (so kvpool's
host id differs and every byte crosses a veth pair, never /dev/shm); the helpers are
:mod:`kvpool.netns`. Host 0 runs the master, hosts 1 and 2 a node each, host 3 the
client (``tests/netns_client.py``, driven over JSON lines). Needs root; skipped with the
reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import proc_helpers
import pytest

from kvpool.launch import Child
from kvpool.netns import Hosts, unavailable

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"network namespaces not available: {WHY}")
CLIENT = str(Path(__file__).with_name("netns_client.py"))
SIZE = 64 << 10
MASTER, NODE_A, NODE_B, CLIENT_HOST = 0, 1, 2, 3


class Remote:
    """The client process in host ``i``: one JSON request, one JSON reply."""

    def __init__(self, hosts: Hosts, i: int, master: str):
        self.proc = subprocess.Popen([*hosts.prefix(i), sys.executable, CLIENT, master, "3"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=proc_helpers.kvpool_env())
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def __call__(self, op: str, key: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, "key": key, "size": SIZE, **kw}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture
def pool(tmp_path):
    """(hosts, master child, {host index: node child}, remote client)."""
    tag = f"kvt{os.getpid() % 100000}"
    work = tmp_path
    with Hosts(tag, 4, net=20 + os.getpid() % 200) as hosts:
        children = []
        try:
            master = Child("master", ["--host", hosts.addr(MASTER), "--port", "0", "--client-ttl", "3"],
                           work, work, "master", prefix=hosts.prefix(MASTER))
            children.append(master)
            addr = master.wait_ready(30)["addr"]
            nodes = {}
            for i in (NODE_A, NODE_B):
                nodes[i] = Child("node", ["--master", addr, "--host", hosts.addr(i), "--segment-size", "32MiB"],
                                 work, work, f"node{i}", prefix=hosts.prefix(i))
                children.append(nodes[i])
                nodes[i].wait_ready(30)
            remote = Remote(hosts, CLIENT_HOST, addr)
            try:
                yield hosts, master, nodes, remote
            finally:
                remote.close()
        finally:
            for child in reversed(children):
                child.stop()


def test_replicas_on_distinct_hosts_survive_the_loss_of_one(pool):
    hosts, _, nodes, remote = pool
    segment = {i: n.info["segment"] for i, n in nodes.items()}
    keys = [f"two/{i}" for i in range(8)]
    for key in keys:
        assert remote("put", key, replicas=2) == {"replicas": 2}
        assert sorted(remote("where", key)["segments"]) == sorted(segment.values())  # one per host
    nodes[NODE_A].stop(kill=True)  # host A is gone
    for key in keys:
        assert remote("get", key) == {"match": True}  # from host B


def test_partitioned_node_is_dropped_and_clients_read_the_survivor(pool):
    hosts, _, nodes, remote = pool
    segment_b = nodes[NODE_B].info["segment"]
    for i in range(4):
        assert remote("put", f"two/{i}", replicas=2) == {"replicas": 2}
        assert remote("put", f"only-b/{i}", replicas=1, segment=segment_b) == {"replicas": 1}
        assert remote("where", f"only-b/{i}") == {"segments": [segment_b]}
    hosts.partition(NODE_B)
    try:
        proc_helpers.wait_for(lambda: "ObjectNotFound" in remote("get", "only-b/0").get("error", ""), 30,
                              "the master to time the partitioned node out")
        for i in range(4):
            assert remote("get", f"two/{i}") == {"match": True}
            assert remote("where", f"two/{i}")["segments"] == [nodes[NODE_A].info["segment"]]
            assert "ObjectNotFound" in remote("get", f"only-b/{i}")["error"]
    finally:
        hosts.heal(NODE_B)
    # healed, the node mounts again; what the master dropped stays dropped
    fresh = iter(range(1000))

    def lands_on_b() -> bool:
        key = f"after-heal/{next(fresh)}"
        return "error" not in remote("put", key, segment=segment_b) and \
            remote("where", key).get("segments") == [segment_b]

    proc_helpers.wait_for(lands_on_b, 30, "the healed node to mount again")
    assert "ObjectNotFound" in remote("get", "only-b/0")["error"]
