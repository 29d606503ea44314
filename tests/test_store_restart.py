"""K18: grants across master incarnations, and what a master restart keeps.

Real master and node processes; the master is killed with SIGKILL and started again on
the same port while the nodes keep running (:meth:`kvpool.launch.Cluster.restart_master`).
Every path that moves bytes under a grant of the old master is tried after the restart:
reads of a read handle (single, into a buffer, batch, ranged) and writes of a put
allocation, over TCP, through a same-host mapping (shm) and in the hosting process
(local). The rule: a stale grant never reads another key's bytes as a success and never
writes into a range the new master gave to another key.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import select
import signal
import socket
import struct
import threading

import proc_helpers
import pytest

from kvpool import protocol as P
from kvpool.child import pause_process
from kvpool.client import Client
from kvpool.errors import ErrorCode, KVPoolError, ObjectExists, ObjectNotFound
from kvpool.launch import Cluster
from kvpool.master.restore import SETTLED_MAX, SettledKeys
from kvpool.master.service import MasterService
from kvpool.rpc import RpcChannel
from kvpool.transfer.epoch import NO_EPOCH, SHM_DIR, epoch_offset, shm_bytes
from kvpool.transfer.request import Op, TransferRequest, TransferStatus

KINDS = ("tcp", "shm", "local")
FAST = ["--client-ttl", "1"]  # heartbeats every 250 ms: a forgotten node remounts quickly
SIZE = 4096


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition"):
    """proc_helpers.wait_for, where a KVPoolError (the master still coming up) is a no."""
    def check():
        try:
            return predicate()
        except KVPoolError:
            return False
    return proc_helpers.wait_for(check, timeout_s, what)


@contextlib.contextmanager
def setup(kind: str):
    """A cluster and a client for ``kind``: "tcp" (every byte over the node's port),
    "shm" (the node's segment mapped by the client), "local" (the only segment is hosted
    by the client itself)."""
    with Cluster(segment_size="64MiB", num_nodes=0 if kind == "local" else 1, extra_master_args=FAST) as cluster:
        with Client(cluster.master_addr, force_tcp=kind == "tcp",
                    global_segment_size=(16 << 20) if kind == "local" else 0) as client:
            yield cluster, client


def restart(cluster: Cluster, client: Client, segments: int = 1) -> None:
    """kill -9 the master, start it on the same port, wait until ``segments`` are mounted."""
    cluster.restart_master(kill=True)
    wait_for(lambda: len(client.stats().segments) == segments, what="the segments to be mounted again")


def value(tag: str, size: int = SIZE) -> bytes:
    return (tag.encode() * (size // len(tag) + 1))[:size]


def reuse_offset(client: Client, old_key: str, new_key: str, size: int = SIZE) -> int:
    """Free ``old_key`` if the new master has it, then put ``new_key`` of the same size:
    it lands on the freed range (best fit). Returns the new key's offset."""
    with contextlib.suppress(ObjectNotFound):
        client.remove(old_key, force=True)
    client.put(new_key, value(new_key, size))
    handle = client.query(new_key)
    client.release([handle])
    return handle.replicas[0].offset


READS = {
    "read": lambda c, h: c.read(h),
    "read_into": lambda c, h: _into(c.read_into, h),
    "batch_read_into": lambda c, h: _batch_into(c, h),
    "batch_read_ranges": lambda c, h: _ranges(c, h),
    "open_views": lambda c, h: _views(c, h),
}


def _into(read_into, handle) -> bytes:
    buf = bytearray(handle.size)
    read_into(handle, buf)
    return bytes(buf)


def _batch_into(client, handle) -> bytes:
    buf = bytearray(handle.size)
    n = client.batch_read_into([handle], [buf])[0]
    if n < 0:
        raise KVPoolError("batch read failed", n)
    return bytes(buf)


def _ranges(client, handle) -> bytes:
    buf = bytearray(handle.size - 16)
    n = client.batch_read_ranges([handle], [[(16, buf)]])[0][0]
    if n < 0:
        raise KVPoolError("ranged read failed", n)
    return bytes(16) + bytes(buf)  # compare from byte 16 on


def _views(client, handle) -> bytes:
    opened = client.open_views([handle])
    view = opened.views[0]
    got = None if view is None else bytes(view)
    if not opened.close()[0] or got is None:  # tcp: no view at all
        raise KVPoolError("the copy out of the view may not be kept")
    return got


@pytest.mark.parametrize("path", sorted(READS))
@pytest.mark.parametrize("kind", KINDS)
def test_k18_a_read_handle_of_the_old_master_never_reads_another_keys_bytes(kind, path):
    with setup(kind) as (cluster, client):
        original = value("old-key")
        client.put("old-key", original)
        handle = client.query("old-key")  # lease of 10 s: time alone does not save us
        restart(cluster, client)
        assert reuse_offset(client, "old-key", "new-key") == handle.replicas[0].offset
        try:
            got = READS[path](client, handle)
        except KVPoolError:
            return  # refused: right
        assert got[16:] == original[16:], "a stale read handle returned another key's bytes as a success"


@contextlib.contextmanager
def _between_mounts(segment: P.SegmentInfo, fenced: int = 0):
    """Store NO_EPOCH in ``segment``'s epoch word, as its node does from its fence until
    its new mount is made (the window in which the master has already answered the
    mount and may hand out grants of the new epoch), and ``fenced`` as the last epoch
    fenced; the word's old value is put back on leaving. Yields a function that puts it
    back now (the mount finishing)."""
    fd = os.open(os.path.join(SHM_DIR, segment.shm_name), os.O_RDWR)
    try:
        with mmap.mmap(fd, shm_bytes(segment.size)) as mapped:
            word = memoryview(mapped)[epoch_offset(segment.size):][:16].cast("Q")
            epoch = word[0]

            def mounted() -> None:
                word[0] = epoch

            word[1], word[0] = fenced, NO_EPOCH
            try:
                yield mounted
            finally:
                mounted()
                word.release()
    finally:
        os.close(fd)


@pytest.mark.parametrize("path", sorted(READS))
def test_a_grant_of_a_new_mount_read_before_the_node_finished_mounting_waits_for_it(path):
    """A master answers a node's mount before the node stores its new epoch, so right
    after a restart a client may read under a grant of an epoch the word does not show
    yet (seen in CI: a get right after a restart failed as stale). A same-host read
    waits for the mount, as writes and the node's TCP port do, then checks the epoch."""
    with setup("shm") as (_, client):
        original = value("k")
        client.put("k", original)
        handle = client.query("k")
        with _between_mounts(handle.replicas[0].segment) as mounted:
            timer = threading.Timer(0.2, mounted)  # the node's mount, finishing meanwhile
            timer.start()
            try:
                got = READS[path](client, handle)
            finally:
                timer.cancel()
        assert got[16:] == original[16:]


def test_a_grant_of_the_epoch_just_fenced_fails_at_once_without_waiting():
    """A grant of the epoch the node fenced is stale for certain: it does not wait for
    the mount in progress (which would let it read once the word showed the epoch
    again here), so leftover handles and location hints of a remounted or stopped
    node cost no wait."""
    with setup("shm") as (_, client):
        client.put("k", value("k"))
        handle = client.query("k")
        segment = handle.replicas[0].segment
        with _between_mounts(segment, fenced=segment.epoch) as mounted:
            timer = threading.Timer(0.5, mounted)  # a wait would see the epoch come back
            timer.start()
            try:
                with pytest.raises(KVPoolError, match="stale"):
                    client.read(handle)
            finally:
                timer.cancel()


def test_a_read_between_mounts_gives_up_as_stale_when_no_mount_comes():
    """The wait for a mount is bounded (MOUNT_WAIT_S): a node that never opens the epoch
    costs a read that long, then the read fails as stale, with no bytes kept."""
    with setup("shm") as (_, client):
        client.put("k", value("k"))
        handle = client.query("k")
        with _between_mounts(handle.replicas[0].segment):
            with pytest.raises(KVPoolError, match="stale"):
                client.read(handle)


@pytest.mark.parametrize("kind", KINDS)
def test_k18_a_put_allocated_by_the_old_master_never_writes_into_a_reassigned_range(kind):
    with setup(kind) as (cluster, client):
        chan = RpcChannel(cluster.master_addr)
        late = chan.call(P.PutStart(P.PutItem("late", SIZE), client.host_id))
        desc = late.replicas[0]
        restart(cluster, client)
        assert reuse_offset(client, "late", "victim") == desc.offset
        src = memoryview(value("LATE"))
        status = client.engine.transfer([TransferRequest(Op.WRITE, src, 0, desc.segment, desc.offset, SIZE)])
        assert status[0] != TransferStatus.COMPLETED, "a stale allocation was written"
        assert client.get("victim") == value("victim")
        reply = chan.call(P.PutEnd(P.PutToken("late", late.put_id)))
        assert reply.code != 0
        assert not client.is_exist("late")
        chan.close()


def _filler(chan: RpcChannel) -> int:
    reply = chan.call(P.PutStart(P.PutItem("filler", SIZE)))
    chan.call(P.PutRevoke(P.PutToken("filler", reply.put_id)))
    return reply.put_id


def test_k18_a_put_end_of_the_old_master_never_commits_a_put_of_the_new_one():
    with setup("shm") as (cluster, client):
        chan = RpcChannel(cluster.master_addr)
        for _ in range(4):
            _filler(chan)
        stale = chan.call(P.PutStart(P.PutItem("x", SIZE))).put_id
        restart(cluster, client)
        for _ in range(min(stale, 16)):  # line the new master's put ids up with the stale one, if they run alike
            if _filler(chan) >= stale - 1:
                break
        assert chan.call(P.PutStart(P.PutItem("x", SIZE))).code == 0  # its bytes come later
        chan.call(P.PutEnd(P.PutToken("x", stale)))
        assert not client.is_exist("x"), "a stale PutEnd committed a put whose bytes were never written"
        chan.close()


@pytest.mark.parametrize("batch", (False, True), ids=("put", "batch_put"))
@pytest.mark.parametrize("when", ("before_the_write", "before_put_end"))
@pytest.mark.parametrize("kind", ("tcp", "shm"))
def test_a_put_the_master_forgot_in_a_restart_is_put_again_once_and_stored(kind, when, batch):
    """Found by a trial: a put whose master restarted (or failed over) between PutStart and
    PutEnd raised ObjectNotFound ("PutEnd refused"), or TransferFailed when its write came
    under the old mount epoch, though nothing of it was stored. The new master's answer
    (PutEnd or PutRevoke: no such put) says so; the bytes are still the caller's. A
    batch_put's items read OBJECT_NOT_FOUND, INVALID_WRITE or TRANSFER_FAIL before
    (found in review); now they are put again once, as a put is."""
    keys = ["spans", "spans2"] if batch else ["spans"]
    with setup(kind) as (cluster, client), \
            Client(cluster.master_addr, force_tcp=kind == "tcp", alloc_leases=False) as writer:
        write_all, restarts = writer._write_all, []

        def restart_once_around_the_write(*args):  # fault injection, real restart
            if not restarts and when == "before_the_write":
                restarts.append(restart(cluster, client))
            out = write_all(*args)
            if not restarts:
                restarts.append(restart(cluster, client))
            return out

        writer._write_all = restart_once_around_the_write
        if batch:
            assert writer.batch_put(keys, [value(k) for k in keys]) == [ErrorCode.OK] * 2
        else:
            assert writer.put("spans", value("spans")) == 1
        assert len(restarts) == 1
        assert [client.get(k) for k in keys] == [value(k) for k in keys]
        stats = client.stats()
        assert stats.object_count == len(keys)
        assert stats.used_bytes == len(keys) * SIZE + stats.leased_bytes  # K07


# (kind, race): over TCP a send to a closed peer succeeds, so only the check catches it
@pytest.mark.parametrize("kind,race", [("tcp", False), ("shm", False), ("shm", True)],
                         ids=("tcp", "shm", "shm-closing_while_sent"))
@pytest.mark.parametrize("leases", (True, False), ids=("lease_commit", "put_start"))
def test_the_first_put_after_a_master_restart_goes_to_the_new_master(kind, race, leases):
    """Found in a trial: after a master restart (kill -9, same address), each client's
    first put raised RpcFailed "the master closed the connection (Broken pipe)": the
    request went out on the connection the old master had closed, and a commit or
    PutStart is never asked again once sent. The channel now sees the close before
    sending (the socket is readable between calls) and uses a new connection; a send
    that fails outright (``race``: the close came between that check and the send, over
    the Unix socket a same-host client uses) is sent again, since no master had it whole."""
    with setup(kind) as (cluster, client), \
            Client(cluster.master_addr, force_tcp=kind == "tcp", alloc_leases=leases) as writer:
        assert writer.put("before", value("before")) == 1
        restart(cluster, client)
        if race:
            chan = writer._channel()
            proc_helpers.wait_for(lambda: chan._hangup.poll(0), what="the old connection's close")
            chan._hangup = _NeverReadable()
        assert writer.put("after", value("after")) == 1
        assert writer.batch_put(["b1", "b2"], [value("b1"), value("b2")]) == [ErrorCode.OK] * 2
        assert [client.get(k) for k in ("before", "after", "b1", "b2")] == \
            [value(k) for k in ("before", "after", "b1", "b2")]


@pytest.mark.parametrize("batch", (False, True), ids=("put", "batch_put"))
def test_a_commit_applied_just_before_a_master_restart_is_kept_and_found_existing(batch):
    """kill -9 and restart of the master after it applied a commit, before its reply
    was read. The commit is sent again; the new master knows no lease (LEASE_EXPIRED)
    and the PutStart way finds the key, which the node's index brought back with the
    client's bytes: the put says OBJECT_ALREADY_EXISTS, which is true, not success,
    which the client cannot prove (after a restart the lease's free range may go to
    another writer of the key). Before the commit was resent, RpcFailed."""
    with setup("shm") as (cluster, client), Client(cluster.master_addr) as writer:
        chan = writer._channel()
        exchange, restarts = chan._exchange, []

        def restart_after_the_commit(frame, kind, *rest):
            reply = exchange(frame, kind, *rest)
            if kind is P.PutCommit and not restarts:
                restarts.append(reply)
                restart(cluster, client)
                raise ConnectionResetError("the reply was lost (injected)")
            return reply

        chan._exchange = restart_after_the_commit
        if batch:
            assert writer.batch_put(["mine"], [value("mine")]) == [ErrorCode.OBJECT_ALREADY_EXISTS]
        else:
            with pytest.raises(ObjectExists):
                writer.put("mine", value("mine"))
        assert len(restarts) == 1 and restarts[0].codes == [ErrorCode.OK]
        assert client.get("mine") == value("mine")


class _NeverReadable:
    """A poll that never sees the close: as if it came just after the check."""

    def poll(self, timeout_ms: int = 0) -> list:
        return []


@pytest.mark.parametrize("kind", ("shm", "local"))
def test_k18_committed_objects_survive_a_master_restart(kind):
    with setup(kind) as (cluster, client):
        sizes = [100 + 997 * i for i in range(20)]
        keys = [f"k{i}" for i in range(20)]
        for k, n in zip(keys, sizes):
            client.put(k, value(k, n))
        pending = RpcChannel(cluster.master_addr)
        pending.call(P.PutStart(P.PutItem("processing", SIZE)))  # PROCESSING: must be dropped
        before = client.stats()
        restart(cluster, client)
        after = client.stats()
        assert after.object_count == 20
        # exact (K07): the pending put and the client's allocation lease are gone
        assert after.used_bytes == before.used_bytes - before.leased_bytes - 4096
        assert [client.get(k) for k in keys] == [value(k, n) for k, n in zip(keys, sizes)]
        assert not client.is_exist("processing")
        more = [f"m{i}" for i in range(20)]
        for k, n in zip(more, sizes):
            client.put(k, value(k, n))  # no two live keys share bytes
        assert [client.get(k) for k in keys + more] == [value(k, n) for k, n in zip(keys + more, sizes * 2)]
        client.remove_all(force=True)
        stats = client.stats()
        assert stats.used_bytes == stats.leased_bytes  # the client's new lease, if it took one
        pending.close()


def test_k18_upserts_removals_and_replicas_on_two_nodes_survive_a_restart():
    with Cluster(segment_size="64MiB", num_nodes=2, extra_master_args=FAST) as cluster:
        with Client(cluster.master_addr) as client:
            assert client.put("both", value("both"), replica_num=2) == 2
            client.put("gone", value("gone"))
            client.put("changed", value("old", 1000))
            client.upsert("changed", value("new", 3000))
            client.remove("gone")
            before = client.stats()
            restart(cluster, client, segments=2)
            assert client.stats().used_bytes == before.used_bytes - before.leased_bytes
            handle = client.query("both")
            assert len(handle.replicas) == 2
            assert client.read(handle) == value("both")
            assert client.get("changed") == value("new", 3000)
            assert not client.is_exist("gone")


def test_a_node_paused_across_a_master_restart_never_brings_back_what_clients_removed_or_replaced():
    """The trial's scenario on real processes: node 2 is stopped (SIGSTOP) while the
    master is killed and started again; clients upsert and remove its keys on the new
    master; node 2 resumes and mounts with its index. Removed keys stay removed, upserts
    keep the new value; keys nobody touched come back (or, past the restore window, are
    misses), never with other bytes."""
    removed, upserted, untouched = ["r0", "r1", "r2"], ["u0", "u1", "u2"], ["t0", "t1", "t2"]
    with Cluster(segment_size="64MiB", num_nodes=2, extra_master_args=["--client-ttl", "5"]) as cluster:
        with Client(cluster.master_addr) as client:
            late = cluster.nodes[1]["segment"]
            for key in removed + upserted + untouched:
                client.put(key, value("old-" + key), preferred_segment=late)
            pid = cluster.node_children[1].proc.pid
            assert pause_process(pid)
            try:
                restart(cluster, client, segments=1)
                for key in removed + upserted:
                    client.upsert(key, value("new-" + key))
                for key in removed:
                    client.remove(key, force=True)
            finally:
                os.kill(pid, signal.SIGCONT)
            wait_for(lambda: len(client.stats().segments) == 2, what="the paused node to mount again")
            assert not any(client.is_exist(key) for key in removed)
            assert [client.get(key) for key in upserted] == [value("new-" + key) for key in upserted]
            for key in untouched:
                with contextlib.suppress(ObjectNotFound):
                    assert client.get(key) == value("old-" + key)


def test_k18_a_segment_the_master_dropped_comes_back_empty_and_its_old_grants_fail():
    with Cluster(segment_size="64MiB", extra_master_args=FAST) as cluster, Client(cluster.master_addr) as client:
        client.put("k", value("k"))
        handle = client.query("k")
        pid = cluster.nodes[0]["pid"]
        assert pause_process(pid)  # silent past the client TTL: the master drops the segment
        try:
            wait_for(lambda: not client.stats().segments, what="the silent node's segment to be dropped")
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: len(client.stats().segments) == 1, what="the node to mount again")
        assert not client.is_exist("k")  # the same master removed it: not brought back
        assert client.stats().used_bytes == 0
        assert reuse_offset(client, "k", "other") == handle.replicas[0].offset
        with pytest.raises(KVPoolError):
            client.read(handle)


def _seg(name: str, size: int = 1 << 20) -> P.SegmentInfo:
    return P.SegmentInfo(name, "host", name, size, "127.0.0.1:1")


def test_restore_keeps_only_entries_that_fit_and_the_newest_version_of_each_key():
    svc = MasterService()
    entries = [P.IndexEntry("a", 0, 100, 5), P.IndexEntry("overlaps-a", 64, 10, 5),
               P.IndexEntry("outside", 1 << 20, 10, 5), P.IndexEntry("misaligned", 1000, 10, 5),
               P.IndexEntry("b", 4096, 200, 7)]
    reply = svc.mount("n1", _seg("s1"), True, entries, 0)
    assert sorted(reply.dropped) == ["misaligned", "outside", "overlaps-a"]
    assert svc.stats().used_bytes == 128 + 256 and svc.stats().object_count == 2
    # a second node reports "a" again (same version: a second replica) and "b" newer
    reply = svc.mount("n2", _seg("s2"), True, [P.IndexEntry("a", 0, 100, 5), P.IndexEntry("b", 4096, 300, 9)], 0)
    assert reply.dropped == []
    assert len(svc.lookup("a").replicas) == 2
    assert [r.segment for r in svc.lookup("b").replicas] == ["s2"] and svc.lookup("b").size == 300
    assert svc.stats().used_bytes == 2 * 128 + 320  # b's old version on s1 is freed
    assert [(u.name, u.drops) for u in svc.index_log.take()] == [("s1", ["b"])]
    # the new incarnation's commits are newer than every restored version
    r = svc.put_start(P.PutItem("a", 50, upsert=True))
    assert svc.put_end(P.PutToken("a", r.put_id)).code == 0
    assert svc.lookup("a").version > 9


def test_a_master_ignores_the_index_of_a_segment_it_dropped_itself():
    svc = MasterService()
    first = svc.mount("n1", _seg("s1"), True, [], 0)
    svc.unmount("n1", "s1")
    again = svc.mount("n1", _seg("s1"), True, [P.IndexEntry("a", 0, 100, 5)], first.incarnation)
    assert again.dropped == ["a"] and svc.stats().object_count == 0
    assert again.epoch != first.epoch


def test_restore_keeps_the_newest_of_overlapping_entries_not_the_first_by_offset():
    """Overlapping entries (an index that missed a drop) keep the newest version: the
    first by offset could be a key whose range was since given to another, and serve
    that other key's bytes under its name."""
    svc = MasterService()
    entries = [P.IndexEntry("stale", 0, 8192, 5), P.IndexEntry("reused", 4096, 100, 9),
               P.IndexEntry("after", 8192, 100, 6),
               P.IndexEntry("a", 16384, 200, 1), P.IndexEntry("b", 16512, 200, 3), P.IndexEntry("c", 16640, 100, 2)]
    reply = svc.mount("n1", _seg("s1"), True, entries, 0)
    assert sorted(reply.dropped) == ["a", "c", "stale"]
    assert {k: svc.lookup(k).replicas[0].offset for k in ("reused", "after", "b")} == {
        "reused": 4096, "after": 8192, "b": 16512}
    assert svc.stats().used_bytes == 128 + 128 + 256


class Clock:
    """A settable monotonic clock (seconds) for MasterService."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _upsert(svc: MasterService, key: str) -> None:
    r = svc.put_start(P.PutItem(key, 100, upsert=True))
    assert r.code == 0
    assert svc.put_end(P.PutToken(key, r.put_id)).code == 0


def test_a_node_mounting_late_never_undoes_a_removal_or_an_upsert_made_since_the_restart():
    """Found by a trial: a node paused across a master restart mounted after clients had
    upserted and removed its keys on the new master, and its index brought the removed
    values back as hits (and, with the new master's clock behind, reverted the upserts).
    Keys this incarnation settled are not restored; keys it never touched still are."""
    clock = Clock()
    svc = MasterService(clock=clock)
    svc.tick()  # the lead's first tick opens the restore window
    assert svc.mount("n1", _seg("s1"), True, [], 0).code == 0
    _upsert(svc, "removed")
    assert svc.remove("removed").code == 0
    _upsert(svc, "upserted")
    ours = svc.lookup("upserted").version
    svc.lookup("upserted").lease_deadline = 0.0  # no read lease: evictable below
    _upsert(svc, "evicted")
    svc._evict(svc.lookup("evicted"))
    skewed = ours + 10**12  # the old master's clock ran ahead: its versions compare newer
    late = [P.IndexEntry("removed", 0, 100, skewed), P.IndexEntry("upserted", 4096, 100, skewed),
            P.IndexEntry("evicted", 8192, 100, skewed), P.IndexEntry("untouched", 12288, 100, 5)]
    clock.now = 5.0  # within the window (2 x the 10 s client TTL)
    svc.tick()
    reply = svc.mount("n2", _seg("s2"), True, late, 0)
    assert sorted(reply.dropped) == ["evicted", "removed", "upserted"]
    assert svc.lookup("removed") is None and svc.lookup("evicted") is None
    upserted = svc.lookup("upserted")
    assert upserted.version == ours and [r.segment for r in upserted.replicas] == ["s1"]
    assert [r.segment for r in svc.lookup("untouched").replicas] == ["s2"]
    assert svc.stats().used_bytes == 128 + 128  # s1: upserted; s2: untouched (dropped ranges free)


def test_a_node_mounting_after_the_restore_window_brings_back_nothing():
    """Past two client TTLs from the lead's first tick the master no longer knows every
    key it settled, so a later mount's index is dropped whole (misses, never stale hits),
    as the master would have dropped a node silent that long."""
    clock = Clock()
    svc = MasterService(clock=clock)
    svc.tick()
    clock.now = 2 * svc.config.client_ttl_s
    svc.tick()
    reply = svc.mount("n1", _seg("s1"), True, [P.IndexEntry("a", 0, 100, 5)], 0)
    assert reply.code == 0 and reply.dropped == ["a"]
    assert svc.stats().object_count == 0 and svc.stats().used_bytes == 0


def test_the_settled_keys_filter_never_misses_a_key_and_rarely_claims_another():
    """A false claim only drops an entry a late mount could have restored (a miss); a
    missed key would restore a stale value, so there must be none."""
    settled = SettledKeys()
    keys = [f"page/{i}" for i in range(SETTLED_MAX)]
    for key in keys:
        settled.add(key)
    assert all(key in settled for key in keys) and settled.added == SETTLED_MAX
    assert sum(f"other/{i}" in settled for i in range(20_000)) < 20_000 * 0.03


def test_the_restore_window_closes_early_once_too_many_keys_were_settled(monkeypatch):
    monkeypatch.setattr("kvpool.master.restore.SETTLED_MAX", 2)
    svc = MasterService(clock=Clock())
    svc.tick()
    assert svc.mount("n1", _seg("s1"), True, [], 0).code == 0
    for key in ("a", "b"):
        _upsert(svc, key)
    assert svc.mount("n2", _seg("s2"), True, [P.IndexEntry("c", 0, 100, 5)], 0).dropped == []
    _upsert(svc, "d")  # the third settled key: over the cap
    assert svc.mount("n3", _seg("s3"), True, [P.IndexEntry("e", 0, 100, 5)], 0).dropped == ["e"]


def test_index_changes_go_out_adds_first_and_an_add_replaces_its_own_drop():
    """A master killed between two index writes must leave a key's new version with some
    node (the rebuild keeps the newest) rather than neither: adds go out before drops."""
    svc = MasterService()
    log = svc.index_log
    log.drop("s1", "moved")
    log.add("s2", P.IndexEntry("moved", 0, 10, 2))
    log.drop("s2", "replaced")
    log.add("s2", P.IndexEntry("replaced", 64, 10, 3))
    log.drop("s1", "gone")
    updates = log.take()
    assert [(u.name, u.drops, [e.key for e in u.adds]) for u in updates] == [
        ("s2", [], ["moved", "replaced"]), ("s1", ["moved", "gone"], [])]


def test_a_node_mounting_again_with_the_same_master_gets_its_index_made_exact():
    """A node whose stream broke mounts again with the master that still holds its
    segment; its index may have missed updates sent meanwhile (and a later restart would
    rebuild from it). The master tells it which reported keys to forget and queues what
    it lacks or holds wrongly for the new stream."""
    svc = MasterService()
    first = svc.mount("n1", _seg("s1"), True, [], 0)
    for key in ("kept", "moved", "missed"):
        r = svc.put_start(P.PutItem(key, 100))
        assert svc.put_end(P.PutToken(key, r.put_id)).code == 0
    truth = {k: P.IndexEntry(k, svc.lookup(k).replicas[0].offset, 100, svc.lookup(k).version)
             for k in ("kept", "moved", "missed")}
    svc.index_log.take()
    reported = [truth["kept"], P.IndexEntry("moved", truth["moved"].offset + 4096, 100, 1),
                P.IndexEntry("ghost", 8192, 100, 1)]
    again = svc.mount("n1", _seg("s1"), True, reported, first.incarnation)
    assert again.code == 0 and again.epoch == first.epoch
    assert again.dropped == ["ghost"]
    assert sorted(svc.index_log.resyncs["s1"], key=lambda e: e.key) == [truth["missed"], truth["moved"]]
    assert svc.stats().object_count == 3 and svc.stats().counters["index_resyncs"] == 1
    svc.remove("missed")  # the queued resync was never sent; the next exact mount replaces it
    exact = [truth["kept"], truth["moved"]]
    assert svc.mount("n1", _seg("s1"), True, exact, first.incarnation).dropped == []
    assert svc.index_log.resyncs["s1"] == []
    svc.index_log.resyncs["s1"] = [truth["missed"]]
    svc.unmount("n1", "s1")  # and an unmount forgets it
    assert "s1" not in svc.index_log.resyncs


def test_k18_a_commit_is_acknowledged_only_once_its_index_update_left_the_master():
    """A node that stops reading its index stream (SIGSTOP) lets the kernel's buffer fill;
    the master then holds back the replies of commits on its segment instead of keeping
    their index updates in its own memory, which a kill -9 loses. Every put acknowledged
    before the master is killed is there after the restart."""
    with Cluster(segment_size="64MiB", extra_master_args=["--client-ttl", "60"]) as cluster:
        with Client(cluster.master_addr, timeout_s=30) as client:
            pid = cluster.nodes[0]["pid"]
            acked: list[str] = []
            stop = threading.Event()

            def put_until_held() -> None:
                for i in range(30_000):
                    if stop.is_set():
                        return
                    try:
                        client.put(f"k{i}", value(f"k{i}", 64))
                    except KVPoolError:
                        return  # the put held back when the master died: in flight, not checked
                    acked.append(f"k{i}")

            assert pause_process(pid)
            writer = threading.Thread(target=put_until_held, daemon=True)
            try:
                writer.start()
                held = proc_helpers.poll_until(_stops_growing(acked), 60, every_s=0.5)
                cluster.restart_master(kill=True)
            finally:
                stop.set()
                os.kill(pid, signal.SIGCONT)
            writer.join(30)
            assert held, f"puts went on past {len(acked)} with the node's index stream unread"
            assert len(acked) < 30_000, "the kernel took every update: no reply was held back, nothing tested"
            wait_for(lambda: len(client.stats().segments) == 1, what="the node to mount again")
            missing = [k for k in acked if not client.is_exist(k)]
            assert not missing, f"{len(missing)} of {len(acked)} acknowledged puts lost, e.g. {missing[:3]}"
            assert all(client.get(k) == value(k, 64) for k in acked[-50:])


def _stops_growing(items: list):
    """A check that is True once ``items`` (not empty) has not grown since its last call."""
    seen = [-1]

    def check() -> bool:
        before, seen[0] = seen[0], len(items)
        return 0 < before == len(items)
    return check


def _frame_call(sock, msg):
    sock.sendall(P.encode_frame(msg))
    return P.reply_decoder.decode(P.recv_frame(sock))


@contextlib.contextmanager
def _served(loop_kind: str = "asyncio", clock=None):
    """A MasterServer on a fresh MasterService (on ``clock``, default time.monotonic),
    its event loop ("asyncio", or "uvloop" as the master process runs) in a thread;
    yields (service, server, on, (host, port)), ``on(coro)`` running ``coro`` on that
    loop and returning its result."""
    from kvpool.master.server import MasterServer

    loop = pytest.importorskip("uvloop").new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
    svc = MasterService() if clock is None else MasterService(clock=clock)
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = MasterServer(svc, "127.0.0.1", 0)
    on = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(30)  # noqa: E731
    host, port = on(server.start()).rsplit(":", 1)
    try:
        yield svc, server, on, (host, int(port))
    finally:
        on(server.close())
        loop.call_soon_threadsafe(loop.stop)


async def _tick(svc) -> None:
    """One tick of ``svc`` on the server's loop (the service is the loop's alone)."""
    svc.tick()


def _slow_reader(addr) -> socket.socket:
    """A connection to ``addr`` whose receive buffer is 4 KiB: a node that reads nothing
    until the test does, so what the master sends it soon waits in the master."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: it sets the window
    sock.connect(addr)
    sock.settimeout(20)
    return sock


async def _fall_behind(server, name: str = "S1") -> None:
    """Write filler index updates to segment ``name``'s stream (its node reads nothing)
    until the kernel's buffer is full and the rest waits in the master's memory: the
    stream is behind. Run on the server's loop."""
    stream = server._streams[name][1]
    filler = P.IndexUpdate(name, [], [P.IndexEntry(f"f{i}", 0, 1, 1) for i in range(20_000)])
    while not stream.transport.get_write_buffer_size():
        server._write_index(stream, filler)


def test_a_mount_takes_its_own_stream_while_another_stream_is_behind():
    """An index mount's connection becomes its segment's stream even when another
    node's stream is behind (the mount's restore writes to it) and other requests come
    in meanwhile: before, the mount waited for that stream between its handler and its
    adoption, and a Ping's connection took the stream in its place."""
    with _served() as (svc, server, on, addr):
        _stream_taken_while_another_is_behind(svc, server, on, addr)


def _stream_taken_while_another_is_behind(svc, server, on, addr) -> None:
    host, port = addr
    conns = []

    def conn():
        s = socket.create_connection((host, int(port)), timeout=20)
        conns.append(s)
        return s

    try:
        slow = _slow_reader((host, int(port)))  # S1's node reads nothing: its stream falls behind
        conns.append(slow)
        assert _frame_call(slow, P.MountSegment("o1", _seg("S1"), True)).code == 0

        async def fall_behind_with_x() -> int:
            await _fall_behind(server)
            r = svc.put_start(P.PutItem("X", 100))
            svc.put_end(P.PutToken("X", r.put_id))
            svc.index_log.take()
            return svc.lookup("X").version

        newer = on(fall_behind_with_x()) + 10**9  # S2 reports X newer: its restore drops X on S1
        mounting = conn()
        done = []
        t = threading.Thread(target=lambda: done.append(_frame_call(mounting, P.MountSegment(
            "o2", _seg("S2"), True, [P.IndexEntry("X", 0, 100, newer)]))))
        t.start()
        other = conn()
        assert isinstance(_frame_call(other, P.Ping()), P.Resp)
        t.join(20)
        assert done and done[0].code == 0

        async def stream_peer():
            return server._streams["S2"][1].get_extra_info("peername")
        assert on(stream_peer()) == mounting.getsockname()
    finally:
        for s in conns:
            s.close()


def test_changes_on_a_segment_mounting_again_are_answered_once_its_new_stream_has_them():
    """Found while hunting a failover flake: a node's index stream ended while its master
    lived (the node mounts again at once), and a put committed and a key removed on its
    segment meanwhile were answered at once, their index changes dropped (no stream).
    A master killed before the node's new mount then lost the put and restored the
    removed key, whose range a new object may have taken (the rebuild would serve that
    object's bytes under the removed key). Their replies now wait for the new stream:
    its mount forgets the removed key, its resync carries the put, and only then do the
    replies go out; the removed key's range takes no new object until then, and a
    buffer placed on the segment meanwhile is given to its writer only then."""
    with _served() as (svc, server, on, addr), _live_data_port() as seg:
        socks = [socket.create_connection(addr, timeout=20) for _ in range(3)]
        node, putter, remover = socks
        try:
            reported, new_id = _mount_commit_and_lose_the_stream(server, on, seg, node, putter)
            putter.sendall(P.encode_frame(P.PutEnd(P.PutToken("new", new_id))))
            remover.sendall(P.encode_frame(P.Remove("gone")))
            proc_helpers.wait_for(lambda: svc.counters["replies_held_for_stream"] == 2, 20, "both replies held")
            # the node's index still names "gone" there: its range takes no new object,
            # and no writer is given a buffer on the segment, until the node's next
            # mount has it forget the key
            used = svc.segments.segments["S1"].allocator.used
            other = socket.create_connection(addr, timeout=20)
            socks.append(other)
            other.sendall(P.encode_frame(P.PutStart(P.PutItem("other", 100))))
            proc_helpers.wait_for(lambda: svc.counters["replies_held_for_stream"] == 3, 20, "the placement held")
            assert svc.segments.segments["S1"].allocator.used > used
            assert select.select([putter, remover, other], [], [], 0)[0] == []  # none answered yet
            again = socket.create_connection(addr, timeout=20)
            socks.append(again)
            mounted = _frame_call(again, P.MountSegment("o1", seg, True, reported))
            assert mounted.code == 0 and mounted.dropped == ["gone"]
            assert [e.key for e in P.reply_decoder.decode(P.recv_frame(again)).adds] == ["new"]
            for sock in (putter, remover):
                assert P.reply_decoder.decode(P.recv_frame(sock)).code == 0
            # "gone"'s range, freed at its removal, given to a writer only now
            assert P.reply_decoder.decode(P.recv_frame(other)).replicas[0].offset == reported[0].offset
        finally:
            for sock in socks:
                sock.close()


def test_a_buffer_goes_to_a_writer_only_once_the_drop_of_what_it_held_left_the_master():
    """Found re-reading the restart argument: a key removed while its segment's index
    stream was behind (its node reading slowly) had its drop wait in the master's
    memory, but its range went back to the allocator at once, and the next PutStart
    was given that range while the drop still waited. The writer's bytes there and a
    master killed then would have had the rebuild serve them under the removed key
    (the node's index still named it there). Now a reply that places buffers on a
    segment waits until its stream took every update written before it."""
    with _served() as (svc, server, on, addr), _live_data_port() as seg:
        node = _slow_reader(addr)  # reads nothing for now
        putter, remover, other = (socket.create_connection(addr, timeout=20) for _ in range(3))
        seen: list[P.IndexUpdate] = []
        try:
            assert _frame_call(node, P.MountSegment("o1", seg, True)).code == 0
            r = _frame_call(putter, P.PutStart(P.PutItem("gone", 100)))
            assert _frame_call(putter, P.PutEnd(P.PutToken("gone", r.put_id))).code == 0
            seen.append(P.reply_decoder.decode(P.recv_frame(node)))

            on(_fall_behind(server))
            remover.sendall(P.encode_frame(P.Remove("gone")))  # its drop waits behind the filler
            other.sendall(P.encode_frame(P.PutStart(P.PutItem("other", 100))))
            proc_helpers.wait_for(lambda: svc.counters["placements_held"] == 1, 20, "the placement held")
            assert select.select([remover, other], [], [], 0)[0] == []  # neither answered yet

            def node_reads() -> None:
                with contextlib.suppress(OSError, P.FrameError):  # until the shutdown below
                    while True:
                        seen.append(P.reply_decoder.decode(P.recv_frame(node)))
            reader = threading.Thread(target=node_reads, daemon=True)
            reader.start()
            placed = P.reply_decoder.decode(P.recv_frame(other))
            assert placed.code == 0 and placed.replicas[0].offset == r.replicas[0].offset  # the range reused
            assert P.reply_decoder.decode(P.recv_frame(remover)).code == 0
            # answered only once the drop had left the master: the node gets it
            proc_helpers.wait_for(lambda: any("gone" in u.drops for u in seen), 20, "the drop at the node")
        finally:
            with contextlib.suppress(OSError):
                node.shutdown(socket.SHUT_RDWR)  # wakes the reader's recv (a close would not)
            for sock in (node, putter, remover, other):
                sock.close()


def test_placement_takes_a_segment_whose_stream_is_behind_only_when_no_other_fits():
    """A buffer placed on a segment whose node reads its index stream slowly waits for
    that stream (above), so a slow node held half the puts of a two-node pool. Placement
    now takes such a segment last: while another can take the value, nothing waits."""
    with _served() as (svc, server, on, addr):
        slow = _slow_reader(addr)  # reads nothing
        socks = [slow] + [socket.create_connection(addr, timeout=20) for _ in range(2)]
        fast, putter = socks[1:]
        try:
            assert _frame_call(slow, P.MountSegment("o1", _seg("S1"), True)).code == 0
            assert _frame_call(fast, P.MountSegment("o2", _seg("S2", 64 << 10), True)).code == 0
            on(_fall_behind(server))
            for i in range(20):
                placed = _frame_call(putter, P.PutStart(P.PutItem(f"k{i}", 1000)))
                assert placed.code == 0 and placed.replicas[0].segment.name == "S2"
            assert svc.counters["placements_held"] == 0
            # what an operator chasing slow puts sees (GetStats, the admin /segments page)
            assert [(g.name, g.lagging, g.withheld) for g in svc.stats().segments] == [
                ("S1", True, False), ("S2", False, False)]
            # a value only S1 can take goes there, and waits for its stream
            putter.sendall(P.encode_frame(P.PutStart(P.PutItem("big", 100 << 10))))
            proc_helpers.wait_for(lambda: svc.counters["placements_held"] == 1, 20, "the placement held")
            slow.close()  # the node dies (its data port refuses): the placement is refused, not answered
            refused = P.reply_decoder.decode(P.recv_frame(putter))
            assert isinstance(refused, P.PutStartResp) and refused.code == ErrorCode.NO_AVAILABLE_HANDLE
            assert "seen dead" in refused.message and not refused.replicas
            assert "S1" in svc.segments.withheld
        finally:
            for sock in socks:
                sock.close()


def test_closing_the_server_ends_a_connection_held_in_a_placement_wait():
    """MasterServer.close() ends the connections it serves, a request held waiting for
    a stream included (unanswered, as when the master process ends): asyncio's
    Server.close() leaves open connections served, and an embedding loop stopped after
    close() destroyed such a handler pending."""
    with _served() as (svc, server, on, addr):
        slow = _slow_reader(addr)  # reads nothing
        putter = socket.create_connection(addr, timeout=20)
        try:
            assert _frame_call(slow, P.MountSegment("o1", _seg("S1"), True)).code == 0
            on(_fall_behind(server))
            putter.sendall(P.encode_frame(P.PutStart(P.PutItem("k", 1000))))
            proc_helpers.wait_for(lambda: svc.counters["placements_held"] == 1, 20, "the placement held")
            on(server.close())
            assert not server._conns
            putter.settimeout(5)
            assert putter.recv(1) == b""  # closed, not answered
        finally:
            slow.close()
            putter.close()


def test_a_placement_in_a_new_lead_waits_for_the_first_mount_and_later_ones_do_not():
    """After a failover or a restart the nodes find the new leader within their remount
    retry; a put in between found no segment at all and raised NoSpace. In the lead's
    first FIRST_MOUNT_WAIT_S a placement (PutStart, AllocLease) that would find no
    segment waits for the first mount; a request that places nothing is answered at
    once, and so is a placement once the lead is older (on the master's clock)."""
    from kvpool.master.server import FIRST_MOUNT_WAIT_S

    now = [1000.0]
    with _served(clock=lambda: now[0]) as (svc, server, on, addr):
        socks = [socket.create_connection(addr, timeout=20) for _ in range(4)]
        node, putter, leaser, other = socks
        try:
            on(_tick(svc))  # the lead's first tick
            putter.sendall(P.encode_frame(P.PutStart(P.PutItem("k", 1000))))
            leaser.sendall(P.encode_frame(P.AllocLease("c1", 64 << 10)))
            proc_helpers.wait_for(lambda: svc.counters["placements_held_for_mount"] == 2, 20, "both held")
            assert _frame_call(other, P.Ping()).code == 0  # the master serves meanwhile
            assert _frame_call(node, P.MountSegment("o1", _seg("S1"), True)).code == 0
            placed = P.reply_decoder.decode(P.recv_frame(putter))
            assert placed.code == 0 and placed.replicas[0].segment.name == "S1"
            leased = P.reply_decoder.decode(P.recv_frame(leaser))
            assert leased.code == 0 and leased.region.segment.name == "S1"
            assert _frame_call(node, P.UnmountSegment("o1", "S1")).code == 0
            now[0] += FIRST_MOUNT_WAIT_S  # the lead is no longer young: no wait
            refused = _frame_call(other, P.PutStart(P.PutItem("k2", 1000)))
            assert refused.code == ErrorCode.NO_AVAILABLE_HANDLE
            assert svc.counters["placements_held_for_mount"] == 2
        finally:
            for sock in socks:
                sock.close()


def test_a_placement_held_for_a_first_mount_that_never_comes_is_refused_when_the_lead_ages():
    """The wait above is bounded by the lead's age on the master's clock."""
    from kvpool.master.server import FIRST_MOUNT_WAIT_S

    now = [1000.0]
    with _served(clock=lambda: now[0]) as (svc, server, on, addr):
        with socket.create_connection(addr, timeout=20) as putter:
            on(_tick(svc))
            putter.sendall(P.encode_frame(P.PutStart(P.PutItem("k", 1000))))
            proc_helpers.wait_for(lambda: svc.counters["placements_held_for_mount"] == 1, 20, "held")
            assert select.select([putter], [], [], 0.2)[0] == []  # the lead is young: still held
            now[0] += FIRST_MOUNT_WAIT_S
            refused = P.reply_decoder.decode(P.recv_frame(putter))
            assert isinstance(refused, P.PutStartResp) and refused.code == ErrorCode.NO_AVAILABLE_HANDLE


def test_a_reply_held_for_a_stream_that_never_comes_back_goes_out_after_the_client_ttl():
    """The wait above is bounded: a node that keeps its data port open (and would keep
    heartbeating) but never mounts again holds a reply for the client TTL plus
    INDEX_DRAIN_S on the master's clock, then the segment is withheld from placement and
    the reply goes out: a commit's as it is, a placement's refused (NO_AVAILABLE_HANDLE:
    the range it was given may still be named by the node's index under a key removed
    meanwhile, so nobody may write there; the writer puts again elsewhere)."""
    from kvpool.master.server import INDEX_DRAIN_S

    now = [1000.0]
    with _served(clock=lambda: now[0]) as (svc, server, on, addr), _live_data_port() as seg:
        socks = [socket.create_connection(addr, timeout=20) for _ in range(4)]
        node, putter, remover, other = socks
        try:
            _, new_id = _mount_commit_and_lose_the_stream(server, on, seg, node, putter)
            putter.sendall(P.encode_frame(P.PutEnd(P.PutToken("new", new_id))))
            remover.sendall(P.encode_frame(P.Remove("gone")))
            proc_helpers.wait_for(lambda: svc.counters["replies_held_for_stream"] == 2, 20, "both replies held")
            other.sendall(P.encode_frame(P.PutStart(P.PutItem("other", 100))))  # may take "gone"'s range
            proc_helpers.wait_for(lambda: svc.counters["replies_held_for_stream"] == 3, 20, "the placement held")
            now[0] += svc.config.client_ttl_s + INDEX_DRAIN_S - 0.5
            assert select.select([putter, remover, other], [], [], 0.2)[0] == []  # not yet: 0.5 s of the wait left
            now[0] += 1.0
            for sock in (putter, remover):
                assert P.reply_decoder.decode(P.recv_frame(sock)).code == 0
            refused = P.reply_decoder.decode(P.recv_frame(other))
            assert isinstance(refused, P.PutStartResp) and refused.code == ErrorCode.NO_AVAILABLE_HANDLE
            assert "seen dead" in refused.message and not refused.replicas
            assert svc.counters["placements_refused"] == 1
            # and no later put is placed there, nor waits for it, until it mounts again
            assert svc.counters["segments_withheld"] == 1 and "S1" in svc.segments.withheld
            assert _frame_call(other, P.PutStart(P.PutItem("later", 100))).code == ErrorCode.NO_AVAILABLE_HANDLE
        finally:
            for sock in socks:
                sock.close()


def test_a_placement_waits_for_a_mount_reply_still_in_the_master():
    """A node mounting again is told in its mount's reply which keys to forget (removed
    while it had no stream); their ranges are free at once. When that reply is too large
    for the kernel's buffer (the node reads it slowly), a placement on the segment was
    answered at once, and a writer's bytes in such a range with the master killed before
    the reply left would have had the rebuild serve them under a forgotten key. The
    placement now waits for the reply to leave, as for a stream that is behind."""
    with _served() as (svc, server, on, addr), _live_data_port() as seg:
        socks = [socket.create_connection(addr, timeout=20) for _ in range(3)]
        node, putter, other = socks
        again = _slow_reader(addr)  # the node's next mount: reads nothing for now
        socks.append(again)
        try:
            reported, _ = _mount_commit_and_lose_the_stream(server, on, seg, node, putter)
            putter.sendall(P.encode_frame(P.Remove("gone")))  # held until the mount below
            proc_helpers.wait_for(lambda: svc.counters["replies_held_for_stream"] == 1, 20, "the removal held")
            # the node's index also names 3,000 keys of 4,000 bytes the master no longer
            # has: its mount's reply (12 MB of keys to forget) outgrows the kernel's buffers
            stale = [P.IndexEntry(f"{i:04d}" + "s" * 3996, 4096, 1, 1) for i in range(3000)]
            again.sendall(P.encode_frame(P.MountSegment("o1", seg, True, reported + stale)))
            proc_helpers.wait_for(lambda: svc.counters["index_resyncs"] == 1, 20, "the node mounted again")
            other.sendall(P.encode_frame(P.PutStart(P.PutItem("other", 100))))  # may take "gone"'s range
            proc_helpers.wait_for(lambda: svc.counters["placements_held"] == 1, 20, "the placement held")
            # neither the removal (the forget of "gone" is in that reply) nor the placement
            assert select.select([putter, other], [], [], 0.2)[0] == []
            mounted = P.reply_decoder.decode(P.recv_frame(again))  # the node reads its reply
            assert mounted.code == 0 and len(mounted.dropped) == 3001
            assert P.reply_decoder.decode(P.recv_frame(putter)).code == 0
            assert P.reply_decoder.decode(P.recv_frame(other)).replicas[0].offset == reported[0].offset
        finally:
            for sock in socks:
                sock.close()


@contextlib.contextmanager
def _live_data_port():
    """A segment whose node's data port takes connections (the master's check of a
    stream that ended finds the node alive); yields its SegmentInfo."""
    with socket.create_server(("127.0.0.1", 0)) as data:
        yield P.SegmentInfo("S1", "host", "S1", 1 << 20, "127.0.0.1:%d" % data.getsockname()[1])


def _mount_commit_and_lose_the_stream(server, on, seg, node, putter) -> tuple[list, int]:
    """Mount ``seg`` with an index on socket ``node``, commit "gone" through ``putter``
    (its update reaches the node) and start a put of "new" there, then close ``node``:
    the segment stays mounted with no stream. Returns the node's index ([the entry of
    "gone"]) and the put id of "new" (its bytes are written while the node mounts again)."""
    assert _frame_call(node, P.MountSegment("o1", seg, True)).code == 0
    r = _frame_call(putter, P.PutStart(P.PutItem("gone", 100)))
    assert _frame_call(putter, P.PutEnd(P.PutToken("gone", r.put_id))).code == 0
    new_id = _frame_call(putter, P.PutStart(P.PutItem("new", 100))).put_id
    reported = P.reply_decoder.decode(P.recv_frame(node)).adds
    assert [e.key for e in reported] == ["gone"]

    async def streams() -> list[str]:
        return list(server._streams)
    node.close()  # its stream ends; the node would mount again
    proc_helpers.wait_for(lambda: on(streams()) == [], 20, "the master to see the stream end")
    return reported, new_id


@pytest.mark.parametrize("loop_kind", ("uvloop", "asyncio"))
def test_a_killed_nodes_index_stream_never_costs_another_request_or_stream(loop_kind):
    """Found in a trial: a node killed (-9) while clients committed to its segment made
    the master's next write to its index stream raise (uvloop: RuntimeError "the handler
    is closed"), which ended the serving of the client's request that wrote it (RpcFailed
    "connection closed mid-frame") and left the other segments' updates of that request
    unsent. Here the node's stream is reset and two commits follow, one loop step apart
    (as two requests are): every request is answered and the live node's stream gets its
    updates."""
    with _served(loop_kind) as (svc, server, on, addr):
        socks = [socket.create_connection(addr, timeout=20) for _ in range(3)]
        try:
            _a_stream_reset_between_two_commits(svc, server, on, socks)
        finally:
            for s in socks:
                s.close()


def _a_stream_reset_between_two_commits(svc, server, on, socks) -> None:
    dead, live, client = socks
    assert _frame_call(dead, P.MountSegment("o1", _seg("S1"), True)).code == 0
    assert _frame_call(live, P.MountSegment("o2", _seg("S2"), True)).code == 0
    dead.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    async def two_commits_on_each() -> None:
        dead.close()  # a reset, as the kernel sends for a killed process with unread bytes
        for i in range(2):
            for seg in ("S1", "S2"):
                key = f"{seg}-{i}"
                r = svc.put_start(P.PutItem(key, 100, preferred_segment=seg))
                assert r.code == 0 and r.replicas[0].segment.name == seg
                svc.put_end(P.PutToken(key, r.put_id))
            server._send_index()  # the first write meets the reset: the transport closes
            await asyncio.sleep(0)  # ...before the stream's handler drops the stream

    on(two_commits_on_each())
    assert isinstance(_frame_call(client, P.Ping()), P.Resp)  # the master serves on
    got = set()
    while len(got) < 2:
        update = P.reply_decoder.decode(P.recv_frame(live))
        got.update(e.key for e in update.adds)
    assert got == {"S2-0", "S2-1"}


def test_a_batch_put_whose_retry_finds_no_master_keeps_its_first_codes():
    """Found in review: when the retry of the items a master forgot raised (no master
    answered it: still restarting, no leader yet), batch_put raised and every item's code,
    the committed ones' too, was lost. The retry's failure now leaves the first codes."""
    from kvpool.errors import RpcFailed

    with setup("shm") as (cluster, client), \
            Client(cluster.master_addr, alloc_leases=False) as writer:
        put_started, calls = writer._put_started, []

        def forget_then_fail(items, srcs, deadline):
            calls.append(len(items))
            if len(calls) == 2:
                raise RpcFailed("no master answered the retry (injected)")
            codes, _ = put_started(items, srcs, deadline)
            return codes, [0]  # as if the master had forgotten the first item

        writer._put_started = forget_then_fail
        assert writer.batch_put(["r1", "r2"], [value("r1"), value("r2")]) == [ErrorCode.OK] * 2
        assert calls == [2, 1]
        assert [client.get(k) for k in ("r1", "r2")] == [value("r1"), value("r2")]


def test_a_mount_whose_reply_cannot_be_written_still_has_its_node_checked(monkeypatch):
    """Found in review: a node that died between its MountSegment and the reply left its
    mount applied but no index stream adopted, so no check of the node ran and puts kept
    being placed on a dead segment until its owner's TTL. Its stream is now adopted (and
    dropped at once), and the check withholds the segment (its data port is closed)."""
    from kvpool.master import server as server_module

    write = server_module._write

    def refuse_mount_replies(writer, frame):
        if isinstance(P.reply_decoder.decode(frame[P.HEADER.size:]), P.MountResp):
            return False  # as for a transport its peer closed
        return write(writer, frame)

    monkeypatch.setattr(server_module, "_write", refuse_mount_replies)
    with _served() as (svc, _, _, addr), socket.create_connection(addr) as node:
        node.sendall(P.encode_frame(P.MountSegment("o1", _seg("S1"), True)))
        proc_helpers.wait_for(lambda: "S1" in svc.segments.withheld, 20, "the dead node's segment withheld")
        assert svc.put_start(P.PutItem("k", 100)).code == ErrorCode.NO_AVAILABLE_HANDLE


@pytest.mark.parametrize("commit", ("put_end", "put_commit"))
def test_a_resent_commit_is_answered_only_once_its_index_update_left_the_master(commit):
    """Found by the review: a commit resent after its connection broke (its first reply
    held while its segment's index stream was behind) was answered OK at once from the
    master's memory of recent commits, while the first send's index update still sat in
    the master's own buffer: a kill -9 then lost a key the client was told is stored.
    The resend's reply now waits, as the first one did, until the stream drained."""
    with _served() as (svc, server, on, (host, port)):
        slow = socket.create_connection((host, port), timeout=20)  # S1's node: reads nothing yet
        first, again = (socket.create_connection((host, port), timeout=20) for _ in range(2))
        try:
            assert _frame_call(slow, P.MountSegment("o1", _seg("S1", 64 << 20), True)).code == 0

            if commit == "put_end":  # placed before the stream falls behind: placed since, it would wait
                started = _frame_call(first, P.PutStart(P.PutItem("K", 100)))
                request = P.PutEnd(P.PutToken("K", started.put_id))
            else:
                grant = _frame_call(first, P.AllocLease("c1", 1 << 20))
                request = P.PutCommit("c1", grant.lease_id, [P.CommitItem("K", grant.region.offset, 100)])
            on(_fall_behind(server))
            first.sendall(P.encode_frame(request))  # applied; its reply waits for the stream
            wait_for(lambda: svc.lookup("K") is not None and svc.lookup("K").visible, what="the commit")
            first.close()  # the connection breaks: the client sends the commit again
            again.sendall(P.encode_frame(request))
            wait_for(lambda: svc.counters["commits_repeated"] == 1, what="the resend")
            on(asyncio.sleep(0))  # the loop step that answered the resend has ended
            assert not select.select([again], [], [], 0)[0], "answered before the update left"
            def node_reads() -> bool:  # True once the resend's reply came
                if select.select([again], [], [], 0)[0]:
                    return True
                while select.select([slow], [], [], 0.01)[0]:
                    slow.recv(1 << 20)
                return False

            wait_for(node_reads, what="the reply, while the node reads its stream")
            reply = P.reply_decoder.decode(P.recv_frame(again))
            assert (reply.code if commit == "put_end" else reply.codes) in (0, [0])
        finally:
            for s in (slow, first, again):
                s.close()


def test_a_commit_whose_index_changes_the_lost_lead_kept_back_is_refused_not_answered_ok():
    """Found in review: the lead ran out between a PutEnd's handler (its own check
    passed) and the sending of its index changes (not sent: the master no longer
    leads). Before, the client was told OK all the same: a commit no node was told of,
    so a new leader could never know it. Now the answer is the refusal."""
    with _served() as (svc, server, on, addr), socket.create_connection(addr) as node, \
            socket.create_connection(addr) as client:
        for s in (node, client):
            s.settimeout(20)
        assert _frame_call(node, P.MountSegment("o1", _seg("S1"), True)).code == 0
        started = _frame_call(client, P.PutStart(P.PutItem("K", 100)))
        assert started.code == 0
        asked = []

        def lead_runs_out_after_the_handler() -> str | None:
            asked.append(1)  # asked before and after the handler, then before the index
            return None if len(asked) <= 2 else "this master lost the lead (injected)"

        server.gate = lead_runs_out_after_the_handler
        reply = _frame_call(client, P.PutEnd(P.PutToken("K", started.put_id)))
        assert len(asked) >= 3, "the gate was not asked before the index changes went out"
        assert isinstance(reply, P.ErrorResp) and reply.code == ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS, reply
