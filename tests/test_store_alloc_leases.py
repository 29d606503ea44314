"""Allocation leases over the wire: real master, node and client processes, real shm
and sockets. Both put paths store the same values; a killed writer's lease space comes
back; a master restart mid-lease makes the put fall back and never writes over another
key's bytes (K18); a full pool keeps taking puts. The state machine on a fake clock is
in test_master_alloc_leases.py."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

from kvpool import protocol as P
from kvpool.client import Client
from kvpool.errors import ErrorCode, ObjectExists
from kvpool.launch import Cluster
from kvpool.rpc import RpcChannel
from proc_helpers import in_threads, wait_for
from test_store_faults import kill, start_script
from test_store_restart import FAST, restart, setup, value

MiB = 1 << 20
KINDS = ("tcp", "shm", "local")

LEASE_WRITER = """
import sys
from kvpool.client import Client
c = Client(sys.argv[1])
for i in range(4):
    c.put(f"w{i}", b"w" * 1000)  # committed through the lease, which stays open
print(c.stats().open_leases, flush=True)
sys.stdin.read()
"""


def counters(client: Client) -> dict[str, int]:
    return client.stats().counters


@pytest.mark.parametrize("leases", [True, False])
@pytest.mark.parametrize("force_tcp", [False, True])
def test_both_put_paths_store_the_same_values(module_cluster, force_tcp, leases):
    with Client(module_cluster.master_addr, force_tcp=force_tcp, alloc_leases=leases) as c:
        c.remove_all(force=True)
        before = counters(c)
        value = os.urandom(100_000)
        assert c.put("one", value) == 1
        with pytest.raises(ObjectExists):
            c.put("one", b"other")
        assert c.upsert("one", value[::-1]) == 1
        arr = np.arange(5000, dtype=np.float32)
        c.put("arr", arr, soft_pin=True, soft_pin_ttl_ms=60_000)
        assert c.batch_put_parts(["parts", "empty"], [[b"head", memoryview(value)[:5000], b"tail"], [b""]]) == [
            ErrorCode.OK, ErrorCode.INVALID_PARAMS]
        buf = c.register_buffer(bytearray(value))
        assert c.put_from("from", buf, 4096, offset=64) == 1
        assert c.batch_put(["a", "b", "a"], [b"1" * 10, b"2" * 20, b"3"]) == [
            ErrorCode.OK, ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS]
        assert c.put("two", b"2" * 1000, replica_num=2) == 1  # one segment: best effort, the old path
        assert c.get("one") == value[::-1]
        assert np.array_equal(np.frombuffer(c.get("arr"), dtype=np.float32), arr)
        assert c.get("parts") == b"head" + value[:5000] + b"tail"
        assert c.get("from") == value[64 : 64 + 4096]
        assert [c.get(k) for k in "ab"] == [b"1" * 10, b"2" * 20]
        after = counters(c)
        commits = after.get("put_commit", 0) - before.get("put_commit", 0)
        starts = after.get("put_start", 0) - before.get("put_start", 0)
        assert (commits, starts) == ((7, 1) if leases else (0, 8))  # only replica_num=2 takes PutStart
        c.remove_all(force=True)


def test_a_value_over_half_a_lease_takes_put_start(module_cluster):
    with Client(module_cluster.master_addr) as c:
        c.put("small", b"s" * 100)
        lease = c.stats().leased_bytes + 128  # the 64 MiB segment's lease: 4 MiB
        before = counters(c)
        big = os.urandom(lease // 2 + 64)
        c.put("big", big)
        assert counters(c)["put_start"] == before.get("put_start", 0) + 1
        assert c.get("big") == big
        c.remove_all(force=True)


def test_close_returns_the_lease_and_used_bytes_are_exact(module_cluster):
    sizes = [100 + i for i in range(50)]
    objects = sum(-(-n // 64) * 64 for n in sizes)
    with Client(module_cluster.master_addr) as c:
        c.remove_all(force=True)
        c.batch_put([f"k{i}" for i in range(50)], [b"x" * n for n in sizes])
        stats = c.stats()
        assert stats.open_leases == 1 and stats.used_bytes == stats.leased_bytes + objects
    with Client(module_cluster.master_addr, alloc_leases=False) as other:
        stats = other.stats()
        assert stats.open_leases == 0 and stats.leased_bytes == 0 and stats.used_bytes == objects
        assert other.remove_all(force=True) == 50
        assert other.stats().used_bytes == 0


def test_threads_share_a_lease_and_every_value_reads_back():
    with Cluster(segment_size="32MiB", lease_ttl_ms=50) as cluster, Client(cluster.master_addr) as c:
        def worker(t: int) -> None:
            for i in range(60):
                key, val = f"t{t}/{i}", os.urandom(1000 + 64 * t + i)
                c.put(key, val)
                assert c.get(key) == val, f"{key}: wrong bytes"
                c.remove(key, force=True)

        assert in_threads(worker, 6) == []
        stats = c.stats()
        assert stats.object_count == 0 and stats.counters["put_commit"] == 360
        assert stats.counters.get("put_start", 0) == 0


@pytest.mark.cluster(extra_master_args=["--alloc-lease-ttl", "1", "--put-start-release-timeout", "2"])
def test_a_killed_writers_lease_space_comes_back_after_expiry_and_release(cluster):
    proc, open_leases = start_script(LEASE_WRITER, cluster.master_addr)
    try:
        assert open_leases == "1"
    finally:
        kill(proc)
    with Client(cluster.master_addr, alloc_leases=False) as c:
        assert c.stats().leased_bytes > 0
        wait_for(lambda: c.stats().used_bytes == 4 * 1024, what="the lease's gaps freed")
        stats = c.stats()
        assert stats.open_leases == 0 and stats.zombie_bytes == 0 and stats.counters["leases_expired"] == 1
        assert [c.get(f"w{i}") for i in range(4)] == [b"w" * 1000] * 4  # the commits stay


@pytest.mark.parametrize("kind", KINDS)
def test_k18_a_put_into_a_lease_of_the_old_master_falls_back_and_never_hits_another_key(kind):
    with setup(kind) as (cluster, client):
        client.put("first", value("first"))
        handle = client.query("first")
        client.release([handle])
        next_offset = handle.replicas[0].offset + 4096  # where the lease places the next value
        restart(cluster, client)
        with Client(cluster.master_addr, alloc_leases=False, force_tcp=kind == "tcp") as other:
            other.put("victim", value("victim"))  # best fit: the range the old lease would use next
            victim = other.query("victim")
            other.release([victim])
            assert victim.replicas[0].offset == next_offset
            before = counters(client)
            client.put("second", value("second"))  # the old lease: stale epoch or unknown lease
            assert counters(client)["put_start"] == before.get("put_start", 0) + 1  # fell back
            assert other.get("victim") == value("victim")
            assert client.get("second") == value("second")
            assert client.get("first") == value("first")
            client.put("third", value("third"))  # a new lease from the new master
            assert client.get("third") == value("third") and other.get("victim") == value("victim")


def test_k18_a_commit_of_a_lease_of_the_old_master_is_refused():
    with Cluster(segment_size="64MiB", num_nodes=1, extra_master_args=FAST) as cluster:
        with Client(cluster.master_addr, alloc_leases=False) as client:
            chan = RpcChannel(cluster.master_addr)
            grant = chan.call(P.AllocLease("writer", MiB))
            assert grant.code == ErrorCode.OK
            restart(cluster, client)
            item = P.CommitItem("late", grant.region.offset, 100)
            assert chan.call(P.PutCommit("writer", grant.lease_id, [item])).codes == [ErrorCode.LEASE_EXPIRED]
            assert not client.is_exist("late")
            chan.close()


@pytest.mark.cluster(segment_size="16MiB")
def test_a_bad_commit_over_the_wire_is_refused_and_nothing_becomes_visible(cluster):
    with contextlib.closing(RpcChannel(cluster.master_addr)) as chan, Client(cluster.master_addr) as c:
        grant = chan.call(P.AllocLease("writer", MiB))
        base = grant.region.offset
        bad = [P.CommitItem("out", base + grant.region.length, 64), P.CommitItem("odd", base + 8, 64)]
        assert chan.call(P.PutCommit("writer", grant.lease_id, bad)).codes == [ErrorCode.INVALID_PARAMS] * 2
        assert chan.call(P.PutCommit("thief", grant.lease_id, [P.CommitItem("x", base, 64)])).codes == [
            ErrorCode.ILLEGAL_CLIENT]
        assert c.batch_is_exist(["out", "odd", "x"]) == [False] * 3
        assert chan.call(P.ReturnLease("writer", [grant.lease_id])).count == 1
        assert c.stats().used_bytes == c.stats().leased_bytes  # only the client's own lease, if any


@pytest.mark.parametrize("watermark", ["0.9", "1.0"])
def test_a_full_pool_keeps_taking_puts(watermark):
    with Cluster(segment_size="16MiB", extra_master_args=["--eviction-high-watermark-ratio", watermark]) as cluster:
        with Client(cluster.master_addr) as c:
            values = {f"v{i}": os.urandom(256 << 10) for i in range(200)}  # 50 MiB into 16 MiB
            for key, val in values.items():
                c.put(key, val)
            stats = c.stats()
            assert stats.counters["evicted_objects"] > 0 and stats.used_bytes <= stats.total_bytes
            assert stats.counters["put_commit"] > 0
            assert c.get("v199") == values["v199"]
            alive = [k for k in values if c.is_exist(k)]
            assert alive and all(c.get(k) == values[k] for k in alive)


@pytest.mark.cluster(extra_master_args=["--alloc-lease-ttl", "1"])
def test_an_idle_clients_lease_is_returned_before_it_expires(cluster):
    with Client(cluster.master_addr) as c:
        c.put("k", b"v" * 1000)
        assert c.stats().open_leases == 1
        wait_for(lambda: c.stats().open_leases == 0, what="the keeper to return the idle lease")
        stats = c.stats()
        assert stats.counters["leases_returned"] == 1 and stats.counters.get("leases_expired", 0) == 0
        assert stats.used_bytes == 1024 and stats.zombie_bytes == 0  # freed at once, not held
        c.put("k2", b"w" * 1000)  # a new lease, returned in turn
        assert c.get("k2") == b"w" * 1000 and c.stats().open_leases == 1
        wait_for(lambda: c.stats().open_leases == 0, what="the keeper to return the second lease")
        assert c.stats().counters["leases_returned"] == 2 and c.stats().used_bytes == 2048
