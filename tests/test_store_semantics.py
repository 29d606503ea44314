"""Mooncake Store semantics: leases, batches, accounting, removal, replicas, visibility."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import pytest

from kvpool import protocol as P
from kvpool.client import Client
from kvpool.client.shortfall import ReplicaShortfall
from kvpool.launch import Cluster
from kvpool.errors import ErrorCode, InvalidParams, LeaseExpired, ObjectNotFound, RpcFailed
from kvpool.rpc import RpcChannel
from kvpool.transfer.shm import _data_ranges
from proc_helpers import wait_for


@pytest.fixture
def cluster_short_lease():
    with Cluster(segment_size="64MiB", lease_ttl_ms=2000) as c:
        yield c


def _held(stats: P.StatsResp) -> int:
    """Allocated bytes but the unused space of open allocation leases (the client's)."""
    return stats.used_bytes - stats.leased_bytes


def test_k02_batch_put_duplicates_one_result_each_and_no_leak(client):
    base = _held(client.stats())
    codes = client.batch_put(["d", "d", "e"], [b"1" * 100, b"2" * 100, b"3" * 100])
    assert codes == [ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS, ErrorCode.OK]
    assert client.get("d") == b"1" * 100
    assert client.batch_put(["d"], [b"x" * 100]) == [ErrorCode.OBJECT_ALREADY_EXISTS]
    stats = client.stats()
    assert _held(stats) - base == 2 * 128  # two objects, 64-byte aligned: nothing leaked
    assert stats.in_flight_puts == 0


@pytest.mark.cluster(lease_ttl_ms=1)
@pytest.mark.parametrize("force_tcp", [False, True])
def test_k05_lease_expiry_on_every_read_path_hands_out_no_bytes(cluster, force_tcp):
    # a 1 ms lease cannot outlive a 32 MiB copy (that would take > 30 GB/s)
    big = os.urandom(1 << 20) * 32
    with Client(cluster.master_addr, force_tcp=force_tcp) as c:
        c.put("big", big)
        with pytest.raises(LeaseExpired):
            c.get("big")
        with pytest.raises(LeaseExpired):
            c.get_into("big", bytearray(len(big)))
        assert c.batch_get(["big"]) == [None]
        assert c.batch_get_into(["big"], [bytearray(len(big))]) == [ErrorCode.LEASE_EXPIRED]


@pytest.mark.cluster(lease_ttl_ms=300)
def test_k05_read_after_the_lease_ran_out_fails_on_handle_paths(cluster):
    with Client(cluster.master_addr) as c:
        c.put("k", b"v" * 1000)
        handle = c.query("k")
        [batch_handle] = c.batch_query(["k"])
        wait_for(lambda: time.monotonic() > handle.deadline + 0.05, what="lease expiry")
        with pytest.raises(LeaseExpired):
            c.read(handle)
        with pytest.raises(LeaseExpired):
            c.read_into(handle, bytearray(1000))
        assert c.batch_read_into([batch_handle], [bytearray(1000)]) == [ErrorCode.LEASE_EXPIRED]
        assert c.get("k") == b"v" * 1000  # a fresh lease reads fine


@pytest.mark.parametrize("leases", [True, False])
def test_k07_accounting_returns_to_exactly_zero(cluster, leases):
    client = Client(cluster.master_addr, alloc_leases=leases)
    client.put("eleven", b"hello world")
    stats = client.stats()
    assert stats.used_bytes > 0 and stats.object_count == 1
    assert stats.used_bytes == sum(s.used for s in stats.segments)
    assert (stats.open_leases, stats.leased_bytes > 0) == ((1, True) if leases else (0, False))
    assert client.remove_all() == 1
    stats = client.stats()
    assert stats.used_bytes == stats.leased_bytes and stats.object_count == 0
    assert all(v >= 0 for v in stats.counters.values())
    client.close()  # returns the lease
    with Client(cluster.master_addr, alloc_leases=False) as other:
        stats = other.stats()
    assert stats.used_bytes == 0 and stats.open_leases == 0 and stats.leased_bytes == 0
    assert all(s.used == 0 for s in stats.segments)


def test_forced_remove_keeps_an_unreported_read_until_the_lease_ends(cluster_short_lease):
    with Client(cluster_short_lease.master_addr) as c:
        c.put("held", b"x" * 1000)
        c.query("held")  # a grant never reported done: a reader may still be copying
        c.remove("held", force=True)
        assert not c.is_exist("held")
        assert c.stats().zombie_buffers == 1  # not reused while that read may be in flight
        wait_for(lambda: _held(c.stats()) == 0, what="buffer freed after lease end")


def test_remove_all_skips_leased_objects_unless_forced(client):
    client.batch_put(["a", "b", "c"], [b"1", b"2", b"3"])
    client.get("b")  # leased for 10 s
    assert client.remove_all() == 2
    assert client.batch_is_exist(["a", "b", "c"]) == [False, True, False]
    assert client.remove_all(force=True) == 1


def test_remove_by_regex_and_batch_remove(client):
    client.batch_put(["a/1", "a/2", "b/1", "xa/3"], [b"1"] * 4)
    assert client.remove_by_regex("^a/") == 2
    assert client.batch_is_exist(["a/1", "a/2", "b/1", "xa/3"]) == [False, False, True, True]
    with pytest.raises(InvalidParams):
        client.remove_by_regex("(")
    assert client.batch_remove(["b/1", "b/1"], force=True) == [ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND]


def test_get_size_and_query_describe_replicas(client):
    client.put("sized", b"z" * 12345)
    assert client.get_size("sized") == 12345
    handle = client.query("sized")
    assert handle.size == 12345 and len(handle.replicas) == 1
    assert handle.replicas[0].length == 12345
    with pytest.raises(ObjectNotFound):
        client.get_size("nope")


@pytest.mark.cluster(num_nodes=1)
def test_replica_num_above_the_live_nodes_is_placed_short_counted_and_warned(cluster, caplog):
    """As Mooncake's allocation does, a put asking more replicas than there are segments
    places as many as it can and succeeds; the native client says so: the count it
    returns, ``replica_shortfall.count``, and a WARNING at most once per ``every_s``
    (an injected clock here) with how many puts were placed short meanwhile."""
    now = [0.0]
    with Client(cluster.master_addr) as c:
        c.replica_shortfall = ReplicaShortfall(every_s=60.0, clock=lambda: now[0])
        with caplog.at_level("WARNING", logger="kvpool.client"):
            assert c.put("three", b"3" * 5000, replica_num=3) == 1
            assert c.put("two", b"2" * 5000, replica_num=2) == 1
            assert c.batch_put(["b1", "b2"], [b"b" * 5000] * 2, replica_num=2) == [ErrorCode.OK] * 2
            assert c.put("one", b"1" * 5000) == 1  # asked for one: not short
            told = [r.getMessage() for r in caplog.records if r.name == "kvpool.client"]
            assert len(told) == 1 and "put 'three': 1 of 3 replicas placed" in told[0]
            assert c.replica_shortfall.count == 4
            now[0] = 60.0
            assert c.put("again", b"a" * 5000, replica_num=2) == 1
            told = [r.getMessage() for r in caplog.records if r.name == "kvpool.client"]
            assert len(told) == 2 and "put 'again': 1 of 2" in told[1]
            assert "4 put(s) placed short since the last" in told[1]  # two, two batch items, this
        assert [len(c.query(k).replicas) for k in ("three", "b1", "again")] == [1, 1, 1]


@pytest.mark.cluster(num_nodes=2, extra_master_args=["--client-ttl", "1.0"])
def test_replicas_land_on_distinct_segments_and_survive_a_dead_node(cluster):
    with Client(cluster.master_addr) as c:
        assert c.put("r2", b"R" * 5000, replica_num=2) == 2
        segs = {r.segment.name for r in c.query("r2").replicas}
        assert len(segs) == 2
        assert c.put("r3", b"S" * 5000, replica_num=3) == 2  # best effort, reported
        cluster.stop_node(0, kill=True)
        wait_for(lambda: len(c.stats().segments) == 1, what="dead node's segment unmounted")
        assert c.get("r2") == b"R" * 5000
        assert len(c.query("r2").replicas) == 1


@pytest.mark.cluster(num_nodes=2)
def test_a_batch_read_whose_same_host_copy_fails_reads_the_next_replica(cluster):
    """Same-host values of a batch are copied one by one (no request batch); one whose
    copy fails (here: a grant of a stale mount epoch) is read from its next replica,
    and the rest of the batch is unaffected."""
    with Client(cluster.master_addr) as c:
        values = {f"b{i}": bytes([i]) * 3000 for i in range(6)}
        for key, value in values.items():
            assert c.put(key, value, replica_num=2) == 2
        handles = c.batch_query(list(values))
        first = handles[2].replicas[0]
        stale = msgspec.structs.replace(first.segment, epoch=first.segment.epoch ^ 1)
        handles[2].replicas[0] = msgspec.structs.replace(first, segment=stale)
        bufs = [bytearray(3000) for _ in handles]
        assert c.batch_read_into(handles, bufs) == [3000] * 6
        assert [bytes(b) for b in bufs] == list(values.values())


@pytest.mark.cluster(num_nodes=2, extra_master_args=["--client-ttl", "1.0"])
def test_k06_killed_node_objects_not_found_counts_drop(cluster):
    with Client(cluster.master_addr) as c:
        seg0 = cluster.nodes[0]["segment"]
        for i in range(5):
            c.put(f"on0/{i}", b"x" * 1000, preferred_segment=seg0)
        c.put("elsewhere", b"y" * 1000, preferred_segment=cluster.nodes[1]["segment"])
        before = c.stats()
        assert before.object_count == 6
        cluster.stop_node(0, kill=True)
        wait_for(lambda: c.stats().object_count == 1, what="objects of the dead node dropped")
        stats = c.stats()
        assert stats.used_bytes == 64 * 16 and stats.owner_count == 1  # 1000 B -> 1024 aligned
        assert not c.is_exist("on0/0")
        assert c.get("elsewhere") == b"y" * 1000
        with pytest.raises(ObjectNotFound):
            c.get("on0/1")


def test_k06_mount_unmount_cycles_do_not_grow_metadata(module_cluster):
    chan = RpcChannel(module_cluster.master_addr)
    with Client(module_cluster.master_addr) as c:
        base = c.stats()
        for cycle in range(100):
            info = P.SegmentInfo(f"fake-{cycle}", "elsewhere", "none", 1 << 20, "127.0.0.1:9")
            assert chan.call(P.MountSegment("fake-owner", info)).code == ErrorCode.OK
            start = chan.call(P.PutStart(P.PutItem("cycle", 100, preferred_segment=info.name)))
            assert start.code == ErrorCode.OK and start.replicas[0].segment.name == info.name
            assert chan.call(P.PutEnd(P.PutToken("cycle", start.put_id))).code == ErrorCode.OK
            assert chan.call(P.UnmountSegment("fake-owner", info.name)).code == ErrorCode.OK
            assert not c.is_exist("cycle")
        after = c.stats()
    chan.close()
    assert after.object_count == base.object_count
    assert len(after.segments) == len(base.segments)
    assert after.owner_count == base.owner_count
    assert after.used_bytes == base.used_bytes
    assert after.zombie_buffers == base.zombie_buffers and after.in_flight_puts == 0


def test_k11_object_is_invisible_until_complete_then_seen_by_every_client(module_cluster):
    value = os.urandom(1 << 20) * 16
    seen_partial = []
    done = threading.Event()

    def reader():
        with Client(module_cluster.master_addr, force_tcp=True) as r:
            while not done.is_set():
                got = r.batch_get(["vis"])[0]
                if got is not None and got != value:
                    seen_partial.append(len(got))

    t = threading.Thread(target=reader)
    t.start()
    with Client(module_cluster.master_addr, force_tcp=True) as w:
        w.put("vis", value)
        done.set()
        t.join()
        with Client(module_cluster.master_addr) as other_shm, \
                Client(module_cluster.master_addr, force_tcp=True) as other_tcp:
            assert other_shm.get("vis") == value and other_tcp.get("vis") == value
        w.remove("vis", force=True)
    assert not seen_partial


def test_k11_upsert_is_seen_whole_or_not_at_all(module_cluster):
    size = 4 << 20
    olds, news = b"\x01" * size, b"\x02" * size
    bad = []
    done = threading.Event()
    with Client(module_cluster.master_addr) as w:
        w.put("ups", olds)

        def reader():
            with Client(module_cluster.master_addr, force_tcp=True) as r:
                while not done.is_set():
                    got = r.batch_get(["ups"])[0]
                    if got not in (None, olds, news):
                        bad.append(got[:8])

        t = threading.Thread(target=reader)
        t.start()
        for i in range(6):
            w.upsert("ups", news if i % 2 == 0 else olds)
        done.set()
        t.join()
        assert w.get("ups") == olds
        w.remove("ups", force=True)
    assert not bad


def test_master_refuses_bad_put_parameters_on_the_wire(module_cluster):
    chan = RpcChannel(module_cluster.master_addr)
    for item in (P.PutItem("k", 0), P.PutItem("k", 10, replica_num=0), P.PutItem("", 10),
                 P.PutItem("é" * 2049, 10), P.PutItem("k", 10, replica_num=100)):
        assert chan.call(P.PutStart(item)).code == ErrorCode.INVALID_PARAMS
    for item in (P.PutItem("k", -5), P.PutItem("k" * 4097, 10), P.PutItem("k", 10, replica_num=10**6)):
        with pytest.raises(RpcFailed) as refused:  # out of the protocol's limits: refused at decode
            chan.call(P.PutStart(item))
        assert refused.value.code == ErrorCode.INVALID_PARAMS
    assert chan.call(P.PutEnd(P.PutToken("never-started", 1))).code == ErrorCode.OBJECT_NOT_FOUND
    assert chan.call(P.SetPin("nope", "hard")).code == ErrorCode.OBJECT_NOT_FOUND
    chan.close()


@pytest.mark.parametrize("replica_num", [0, -1, 1.5, True, "2"])
def test_a_bad_replica_count_is_refused_before_any_request(module_cluster, replica_num):
    """InvalidParams on every put path, not a wire-level refusal (RpcFailed) of a
    negative count, and nothing of the key stored."""
    with Client(module_cluster.master_addr) as c:
        for put in (lambda: c.put("rn", b"x", replica_num), lambda: c.upsert("rn", b"x", replica_num),
                    lambda: c.batch_put(["rn"], [b"x"], replica_num)):
            with pytest.raises(InvalidParams, match="replica_num"):
                put()
        assert not c.is_exist("rn")


def test_a_closed_client_refuses_every_call(module_cluster):
    """A call after close() would open a new connection and go through unnoticed: it
    raises instead, and a second close() does nothing (it used to send a late release
    through a connection it opened again and never closed)."""
    c = Client(module_cluster.master_addr)
    c.put("closed-k", b"x")
    held = c.query("closed-k")  # a read grant still held at close
    c.close()
    for call in (lambda: c.get("closed-k"), lambda: c.put("closed-k2", b"y"), lambda: c.is_exist("closed-k"),
                 lambda: c.batch_get(["closed-k"]), c.ping):
        with pytest.raises(RpcFailed, match="closed"):
            call()
    c.release([held])  # queued: no connection opens for it, not even at a second close
    c.close()
    assert c._local.chan._sock is None and not c._channels
    with Client(module_cluster.master_addr) as other:
        assert other.get("closed-k") == b"x" and not other.is_exist("closed-k2")
        other.remove("closed-k", force=True)


def test_allocation_strategies_place_replicas_as_named():
    from kvpool.master.segments import SegmentTable

    def table(strategy):
        t = SegmentTable(strategy)
        t.mount("a", P.SegmentInfo("here", "host-a", "x", 1 << 20, "127.0.0.1:1"), 0.0)
        t.mount("b", P.SegmentInfo("there", "host-b", "y", 1 << 20, "127.0.0.1:2"), 0.0)
        return t

    local = table("local_first")
    assert all(local.allocate(100, 1, host_id="host-b")[0].segment == "there" for _ in range(20))
    emptiest = table("free_ratio_first")
    placed = [emptiest.allocate(1000, 1)[0].segment for _ in range(10)]
    assert placed.count("here") == placed.count("there") == 5
    spread = table("random")
    assert {spread.allocate(64, 1)[0].segment for _ in range(50)} == {"here", "there"}
    assert len({r.segment for r in spread.allocate(64, 2)}) == 2


def test_client_contributed_segment_serves_others_and_leaves_with_its_client(module_cluster):
    addr = module_cluster.master_addr
    owner = Client(addr, global_segment_size=16 << 20)
    seg = owner.segment.info.name
    shm_path = f"/dev/shm/{owner.segment.info.shm_name}"
    with Client(addr) as reader, Client(addr, force_tcp=True) as remote:
        assert any(s.name == seg for s in reader.stats().segments)
        owner.put("on-client", b"c" * 5000, preferred_segment=seg)
        assert reader.query("on-client").replicas[0].segment.name == seg
        assert reader.get("on-client") == b"c" * 5000
        assert remote.get("on-client") == b"c" * 5000
        owner.close()
        assert not os.path.exists(shm_path)
        assert not reader.is_exist("on-client")
        assert all(s.name != seg for s in reader.stats().segments)


def test_client_contributed_segment_is_allocated_behind_its_puts_keeping_their_bytes(module_cluster):
    # its pages are allocated on a thread after start; values written before and while
    # that runs must keep their bytes (MADV_POPULATE_WRITE keeps content)
    with Client(module_cluster.master_addr, global_segment_size=64 << 20) as owner:
        seg = owner.segment.info
        values = {f"behind-{i}": os.urandom(100_000) for i in range(40)}
        for key, value in values.items():
            owner.put(key, value, preferred_segment=seg.name)
        path = f"/dev/shm/{seg.shm_name}"
        wait_for(lambda: _data_ranges(path, seg.size) == [(0, seg.size)], what="the whole segment allocated")
        assert {k: owner.get(k) for k in values} == values


def test_a_batch_get_over_two_mapped_segments_lands_every_value_in_its_place(monkeypatch):
    """Same-host batch reads group their values per segment (one memcpy loop each,
    ``GetPath._read_local``): values spread over two nodes' segments, with a miss
    between them, land where they belong and nothing past them; a grant of a stale
    mount epoch fails its own item only, not the others on its segment; a key with two
    replicas in the batch takes the general path and lands too."""
    from kvpool.client.get import GetPath

    local = []
    read_local = GetPath._read_local
    monkeypatch.setattr(GetPath, "_read_local", lambda self, *a: local.append(read_local(self, *a)) or local[-1])
    with Cluster(segment_size="64MiB", num_nodes=2) as cluster:
        # PutStart for each value (no allocation lease): the master places each one
        with Client(cluster.master_addr, alloc_leases=False) as c:
            keys = [f"k{i}" for i in range(40)]
            for i, k in enumerate(keys):
                c.put(k, bytes([i + 1]) * (1000 + i))
            handles = c.batch_query(keys)
            assert len({h.replicas[0].segment.name for h in handles}) == 2, "values on both segments"
            c.release(handles)

            def check(asked, got, bufs, failed=()):
                for k, n, buf in zip(asked, got, bufs):
                    if k == "missing":
                        assert n == ErrorCode.OBJECT_NOT_FOUND
                    elif k in failed:
                        assert n == ErrorCode.TRANSFER_FAIL
                    else:
                        i = int(k[1:])
                        assert n == 1000 + i and bytes(buf[:n]) == bytes([i + 1]) * n, k
                        assert bytes(buf[n:]) == b"\xff" * (len(buf) - n), k  # nothing past the value

            asked = keys[:20] + ["missing"] + keys[20:]
            bufs = [bytearray(b"\xff" * 2000) for _ in asked]
            check(asked, c.batch_get_into(asked, bufs), bufs)
            assert local and all(isinstance(r, dict) for r in local)

            handles = c.batch_query(keys)
            seg = handles[3].replicas[0].segment
            first = handles[3].replicas[0]
            stale = msgspec.structs.replace(seg, epoch=seg.epoch ^ 1)  # as after a remount
            handles[3].replicas[0] = msgspec.structs.replace(first, segment=stale)
            bufs = [bytearray(b"\xff" * 2000) for _ in keys]
            got = c.batch_read_into(handles, bufs)
            check(keys, got, bufs, failed={"k3"})
            assert any(h.replicas[0].segment.name == seg.name for i, h in enumerate(handles) if i != 3)

            local.clear()
            assert c.put("both", b"b" * 3000, replica_num=2) == 2
            bufs = [bytearray(4000) for _ in range(3)]
            assert c.batch_get_into(["both", "k0", "k1"], bufs) == [3000, 1000, 1001]
            assert [bytes(b[:n]) for b, n in zip(bufs, (3000, 1000, 1001))] == [b"b" * 3000, b"\1" * 1000, b"\2" * 1001]
            assert local == [None]  # the general path read them
