"""Read grants: an old version (upserted over, force-removed) is kept only while a read
of it is in flight, then freed at once (ReadDone); the object's own lease is unchanged."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvpool.client import Client
from kvpool import protocol as P
from kvpool.errors import ErrorCode, KVPoolError, LeaseExpired, NoSpace, ObjectHasLease
from proc_helpers import wait_for

MIB = 1 << 20

# a reader process: gets "k" until a line arrives on stdin; every value must be whole
# (all 8-byte words equal: one version's fill) and versions never go backwards
READER = r"""
import json, sys, threading
import numpy as np
from kvpool.client import Client
from kvpool.errors import KVPoolError
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
reads = torn = backwards = errors = 0
last = -1
with Client(sys.argv[1], force_tcp=sys.argv[2] == "tcp") as c:
    while not stop.is_set():
        try:
            words = np.frombuffer(c.get("k"), dtype="<u8")
        except KVPoolError:
            errors += 1
            continue
        reads += 1
        torn += not (words == words[0]).all()
        backwards += int(words[0]) < last
        last = max(last, int(words[0]))
        if reads == 1:
            print("reading", flush=True)
print(json.dumps({"reads": reads, "torn": torn, "backwards": backwards, "errors": errors, "last": last}), flush=True)
"""


def version(v: int) -> np.ndarray:
    """1 MiB whose every 8-byte word is ``v``: a torn read mixes two versions."""
    return np.full(MIB // 8, v, dtype="<u8")


@pytest.mark.cluster(segment_size="64MiB", lease_ttl_ms=10_000)
def test_upserts_under_readers_never_run_out_of_space_and_reads_stay_whole(cluster):
    """The field repro: before read grants, 64 upserts of a 1 MiB key under readers
    filled a 64 MiB segment with old versions held for the whole 10 s lease."""
    with Client(cluster.master_addr) as w:
        w.upsert("k", version(0))
        readers = [subprocess.Popen([sys.executable, "-c", READER, cluster.master_addr, mode],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                   for mode in ("shm", "tcp")]
        try:
            for r in readers:
                assert r.stdout.readline().strip() == "reading"
            for v in range(1, 201):
                w.upsert("k", version(v))  # NoSpace would fail the test here
            results = []
            for r in readers:
                r.stdin.write("stop\n")
                r.stdin.flush()
                results.append(json.loads(r.stdout.readline()))
                assert r.wait(30) == 0
        finally:
            for r in readers:
                r.kill()
                r.wait()
        for res in results:
            assert res["reads"] > 0 and res["torn"] == 0 and res["backwards"] == 0, res
        assert np.array_equal(np.frombuffer(w.get("k"), dtype="<u8"), version(200))
        stats = w.stats()
        assert stats.object_count == 1


@pytest.mark.cluster(segment_size="8MiB", lease_ttl_ms=60_000)
def test_a_read_in_flight_keeps_the_old_version_until_it_is_done(cluster):
    with Client(cluster.master_addr) as w, Client(cluster.master_addr) as r:
        w.put("k", version(1))
        handle = r.query("k")  # granted, not yet copied: a reader mid-copy
        w.upsert("k", version(2))
        stats = w.stats()
        assert stats.zombie_buffers == 1 and stats.zombie_bytes == MIB
        with pytest.raises(NoSpace) as exc:  # pin every free byte: nothing may reuse v1
            for i in range(8):
                w.put(f"fill{i}", version(99), hard_pin=True)
        assert "held by 1 superseded or removed versions" in str(exc.value)
        assert "at the latest in" in str(exc.value)
        assert np.array_equal(np.frombuffer(r.read(handle), dtype="<u8"), version(1))
        # ReadDone went back without a reply: the old version is freed long before its lease
        wait_for(lambda: w.stats().zombie_buffers == 0, what="old version freed after ReadDone")
        w.put("fill-after", version(3), hard_pin=True)  # into the freed space
        assert np.array_equal(np.frombuffer(r.get("k"), dtype="<u8"), version(2))


@pytest.mark.cluster(segment_size="8MiB", lease_ttl_ms=60_000)
def test_done_reads_do_not_shorten_the_lease_of_a_live_object(cluster):
    with Client(cluster.master_addr) as c:
        c.put("live", b"x" * 1000)
        assert c.get("live") == b"x" * 1000  # read done and reported
        wait_for(lambda: c.stats().open_grants == 0, what="grant reported done")
        with pytest.raises(ObjectHasLease):
            c.remove("live")
        assert c.batch_remove(["live"]) == [ErrorCode.OBJECT_HAS_LEASE]
        assert c.remove_all() == 0
        c.remove("live", force=True)  # no read in flight: freed now, no zombie
        stats = c.stats()
        assert stats.used_bytes == stats.leased_bytes and stats.zombie_buffers == 0  # only the put's lease


def test_a_read_handle_reads_once(client):
    client.put("once", b"abc" * 100)
    handle = client.query("once")
    assert client.read(handle) == b"abc" * 100
    with pytest.raises(LeaseExpired, match="already used"):
        client.read(handle)
    with pytest.raises(LeaseExpired, match="already used"):
        client.read_into(handle, bytearray(300))
    assert client.batch_read_into([handle], [bytearray(300)]) == [ErrorCode.LEASE_EXPIRED]
    assert client.batch_read_ranges([handle], [[(0, bytearray(3))]]) == [[ErrorCode.LEASE_EXPIRED]]
    into = client.query("once")
    buf = bytearray(300)
    assert client.read_into(into, buf) == 300 and buf == b"abc" * 100
    with pytest.raises(LeaseExpired, match="already used"):
        client.read_into(into, buf)
    twice = client.query("once")  # the same handle twice in one batch is one read
    a, b = bytearray(300), bytearray(300)
    assert client.batch_read_into([twice, twice], [a, b]) == [300, 300] and a == b


def test_value_views_show_same_host_values_and_hold_their_grants_until_closed(module_cluster):
    with Client(module_cluster.master_addr) as shm, Client(module_cluster.master_addr,
                                                            force_tcp=True) as tcp:
        shm.put("view-a", b"a" * 5000)
        shm.put("view-b", b"b" * 300)
        handles = shm.batch_query(["view-a", "view-b"])
        opened = shm.open_views(handles)
        assert [bytes(v) for v in opened.views] == [b"a" * 5000, b"b" * 300]
        assert shm.stats().open_grants == 2  # held while the views are open
        assert opened.close() == [True, True]
        assert opened.views == [None, None] and opened.close() == [False, False]
        assert all(h.spent for h in handles)
        assert wait_for(lambda: shm.stats().open_grants == 0, 10, "ReadDone")
        # no mapping over TCP: no view, and the handle stays readable the usual way
        handle = tcp.query("view-b")
        opened = tcp.open_views([handle])
        assert opened.views == [None] and opened.close() == [False]
        buf = bytearray(300)
        assert tcp.batch_read_into([handle], [buf]) == [300] and bytes(buf) == b"b" * 300
        shm.batch_remove(["view-a", "view-b"], force=True)


@pytest.mark.parametrize("call", ["batch_query", "batch_get"])
def test_a_batch_reply_naming_a_segment_it_lacks_returns_every_grant(client, call):
    """A reply whose second key points past its segment list (a bug or a corrupt frame)
    is not read at all: it is an error, and the grants the master made for the other
    keys go back at once rather than staying open until their leases run out."""
    client.batch_put(["g0", "g1", "g2"], [b"a" * 100, b"b" * 100, b"c" * 100])
    wait_for(lambda: client.stats().open_grants == 0, what="no grant open before the batch")
    call_master = client._call

    def corrupting(request, *args, **kwargs):
        reply = call_master(request, *args, **kwargs)
        if isinstance(request, P.BatchGetReplicaList):
            reply.results[1].places = [(len(reply.segments), 0)]
        return reply

    client._call = corrupting
    try:
        with pytest.raises(KVPoolError, match="segment"):
            getattr(client, call)(["g0", "g1", "g2"])
    finally:
        del client._call
    wait_for(lambda: client.stats().open_grants == 0, 10, "every grant of the bad reply returned")
    assert client.batch_get(["g0", "g1", "g2"]) == [b"a" * 100, b"b" * 100, b"c" * 100]
    client.batch_remove(["g0", "g1", "g2"], force=True)
