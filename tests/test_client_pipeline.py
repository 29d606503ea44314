"""Pipelined batches (:mod:`kvpool.client.pipeline`): a batch get asks for the next
chunk's replica lists while it copies this one, a batch put commits a chunk while it
writes the next. Real master and node processes; every value and every per-item code
lands where the unpipelined batch put it, and no commit is sent before its bytes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time

import numpy as np
import pytest

from kvpool import protocol as P
from kvpool.child import pause_process
from kvpool.client import Client
from kvpool.client.pipeline import GROWTH, LARGE_VALUE, MIN_KEYS, get_spans, put_spans, spans
from kvpool.errors import ErrorCode
from kvpool.launch import Cluster
from proc_helpers import wait_for

KINDS = ("tcp", "shm", "local")
KIB, MIB = 1 << 10, 1 << 20


@pytest.mark.parametrize("count,item_bytes", [(2, MIB), (16, MIB), (128, 4 * KIB), (33, 4 * KIB),
                                              (1000, 100), (200, 64 * KIB)])
def test_chunks_cover_the_batch_in_order_and_the_exposed_one_is_small(count, item_bytes):
    chunks = spans(count, item_bytes)
    assert [i for s, e in chunks for i in range(s, e)] == list(range(count))
    sizes = [e - s for s, e in chunks]
    assert len(sizes) > 1 and sizes[0] <= 8
    assert all(b <= a * GROWTH for a, b in zip(sizes, sizes[1:]))  # a query hides behind the copies before it


def test_a_small_batch_is_one_chunk():
    assert spans(MIN_KEYS - 1, 4 * KIB) == [(0, MIN_KEYS - 1)]
    assert spans(1, 16 * MIB) == [(0, 1)]
    assert spans(0, 0) == [(0, 0)]


def test_a_get_pipelines_small_values_only():
    assert get_spans(128, 4 * KIB) == spans(128, 4 * KIB)
    assert get_spans(128, LARGE_VALUE) == [(0, 128)]


def test_a_put_pipelines_many_large_values_copied_in_place_with_a_small_last_chunk():
    assert put_spans(1000, LARGE_VALUE - 1, in_place=True) == [(0, 1000)]  # small values
    assert put_spans(MIN_KEYS - 1, MIB, in_place=True) == [(0, MIN_KEYS - 1)]  # few keys
    assert put_spans(128, MIB, in_place=False) == [(0, 128)]  # over TCP
    chunks = put_spans(40, MIB, in_place=True)
    assert [i for s, e in chunks for i in range(s, e)] == list(range(40))
    assert sorted(e - s for s, e in chunks) == sorted(e - s for s, e in spans(40, MIB))
    assert len(chunks) > 1 and chunks[-1] == (39, 40)


@contextlib.contextmanager
def setup(kind: str, segment: int = 32 * MIB, **client):
    """A cluster and a client: "local" hosts a ``segment``-byte segment itself."""
    with Cluster(segment_size="64MiB", num_nodes=0 if kind == "local" else 1) as c:
        with Client(c.master_addr, force_tcp=kind == "tcp",
                    global_segment_size=segment if kind == "local" else 0, **client) as cl:
            yield cl


def values(count: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_pipelined_batch_get_puts_every_value_and_every_miss_in_its_place(kind):
    with setup(kind) as c:
        keys = [f"k{i}" for i in range(150)]
        vals = values(150, 4 * KIB)
        assert c.batch_put(keys, vals) == [ErrorCode.OK] * 150
        asked = list(keys)
        for i in (0, 9, 60, 149):  # misses in the first, a middle and the last chunk
            asked[i] = f"missing{i}"
        bufs = [np.zeros(4 * KIB, np.uint8) for _ in asked]
        bufs[100] = np.zeros(100, np.uint8)  # too small, in a later chunk
        got = c.batch_get_into(asked, bufs)
        for i, n in enumerate(got):
            if asked[i].startswith("missing"):
                assert n == ErrorCode.OBJECT_NOT_FOUND
            elif i == 100:
                assert n == ErrorCode.BUFFER_OVERFLOW
            else:
                assert n == 4 * KIB and (bufs[i] == vals[i]).all(), i
        plain = c.batch_get(asked)
        assert [p is None for p in plain] == [a.startswith("missing") for a in asked]
        assert all(p == vals[i].tobytes() for i, p in enumerate(plain) if p is not None)
        # every chunk's grants went back to the master (ReadDone rides on the next
        # request, or the flusher sends it)
        wait_for(lambda: c.stats().open_grants == 0, 5)


def test_a_pipelined_batch_get_refuses_a_bad_key_before_it_reads_anything():
    with setup("local") as c:
        c.batch_put([f"k{i}" for i in range(40)], values(40, KIB))
        bufs = [np.zeros(KIB, np.uint8) for _ in range(40)]
        with pytest.raises(Exception, match="key"):
            c.batch_get_into([f"k{i}" for i in range(39)] + [""], bufs)
        assert all((b == 0).all() for b in bufs)
        assert c.stats().open_grants == 0


@pytest.mark.parametrize("size,count", [(LARGE_VALUE, 40), (2 * LARGE_VALUE, MIN_KEYS)])
def test_each_commit_of_a_pipelined_batch_put_follows_the_writes_of_its_items(size, count):
    """At the moment each PutCommit is sent, every item it names is already whole in
    the segment (invisible until complete), and the batch took several commits."""
    with setup("local", segment=128 * MIB) as c:  # its lease (1/16) holds the whole batch
        keys = [f"p{i}" for i in range(count)]
        vals = values(count, size, seed=3)
        expect = dict(zip(keys, vals))
        commits, call = [], c._call

        def checked(request, *args, **kwargs):
            if isinstance(request, P.PutCommit):
                commits.append(len(request.items))
                for item in request.items:
                    with c.segment.shm.buf[item.offset:item.offset + item.size] as written:
                        whole = written == expect[item.key].tobytes()  # no view outlives the check
                    assert whole, f"{item.key} committed before its bytes were written"
            return call(request, *args, **kwargs)

        c._call = checked
        try:
            codes = c.batch_put(keys, vals)
        finally:
            del c._call
        assert codes == [ErrorCode.OK] * count
        assert len(commits) > 1 and sum(commits) == count
        assert commits[-1] == 1  # the exposed commit is the small one
        bufs = [np.zeros(size, np.uint8) for _ in keys]
        assert c.batch_get_into(keys, bufs) == [size] * count
        assert all((b == v).all() for b, v in zip(bufs, vals))


@pytest.mark.parametrize("kind,commits", [("tcp", 1), ("shm", len(put_spans(40, LARGE_VALUE, in_place=True)))])
def test_a_batch_put_over_tcp_is_one_write_and_one_commit(kind, commits):
    """40 values of 64 KiB: pipelined into the node's shared memory (copied in this
    process), one write and one commit over TCP (measured faster there, pipeline.put_spans)."""
    with setup(kind) as c:
        keys = [f"t{i}" for i in range(40)]
        vals = values(40, LARGE_VALUE, seed=5)
        sent, call = [], c._call

        def counting(request, *args, **kwargs):
            sent.append(type(request).__name__)
            return call(request, *args, **kwargs)

        c._call = counting
        try:
            assert c.batch_put(keys, vals) == [ErrorCode.OK] * 40
        finally:
            del c._call
        assert sent.count("PutCommit") == commits and commits >= 1
        bufs = [np.zeros(LARGE_VALUE, np.uint8) for _ in keys]
        assert c.batch_get_into(keys, bufs) == [LARGE_VALUE] * 40
        assert all((b == v).all() for b, v in zip(bufs, vals))


@pytest.mark.parametrize("kind", ("tcp", "shm"))
def test_a_batch_larger_than_a_lease_goes_lease_after_lease(kind):
    with setup(kind, lease_bytes=MIB) as c:  # values up to half a lease go through one
        before = c.stats().counters
        keys = [f"b{i}" for i in range(48)]
        vals = values(48, 128 * KIB, seed=5)  # 6 MiB: at least six leases
        keys[40] = keys[3]  # a duplicate in a later lease (K02): the first one stays
        codes = c.batch_put(keys, vals)
        assert codes == [ErrorCode.OK] * 40 + [ErrorCode.OBJECT_ALREADY_EXISTS] + [ErrorCode.OK] * 7
        after = c.stats().counters
        assert after.get("leases_granted_alloc", 0) - before.get("leases_granted_alloc", 0) >= 6
        assert after.get("put_start", 0) == before.get("put_start", 0)  # none went the PutStart way
        bufs = [np.zeros(128 * KIB, np.uint8) for _ in keys]
        got = c.batch_get_into(keys, bufs)
        assert got == [128 * KIB] * 48
        assert all((bufs[i] == vals[i if i != 40 else 3]).all() for i in range(48))


@pytest.mark.parametrize("op", ("get", "put"))
def test_a_connection_dead_before_a_chunk_is_sent_loses_no_chunk(op):
    """The master connection is dead (shut down) as the second chunk's request is to go
    out: the channel sees it before sending and asks on a new connection, whatever the
    request (no master had it); the get still copies the chunk whose copy was to overlap
    that request, and the put stores every chunk. Before, the put's commit went out on the
    dead connection, failed, and was not asked again: the batch raised."""
    with setup("shm") as c:
        count, size = (100, 4 * KIB) if op == "get" else (40, LARGE_VALUE)
        keys = [f"c{i}" for i in range(count)]
        vals = values(count, size, seed=7)
        if op == "get":
            assert c.batch_put(keys, vals) == [ErrorCode.OK] * count
        calls, broken, call = [], [], c._call

        def breaking(request, *args, **kwargs):
            if isinstance(request, (P.BatchGetReplicaList, P.PutCommit)):
                calls.append(type(request).__name__)
            if len(calls) == 2 and not broken:  # the second chunk's query or commit: its socket is dead
                broken.append(True)
                c._channel()._sock.shutdown(socket.SHUT_RDWR)
            return call(request, *args, **kwargs)

        c._call = breaking
        try:
            if op == "get":
                bufs = [np.zeros(size, np.uint8) for _ in keys]
                assert c.batch_get_into(keys, bufs) == [size] * count
                assert all((b == v).all() for b, v in zip(bufs, vals))
            else:
                assert c.batch_put(keys, vals) == [ErrorCode.OK] * count
        finally:
            del c._call
        assert broken and len(calls) >= 2
        if op == "put":
            assert calls == ["PutCommit"] * len(put_spans(count, size, in_place=True))
            bufs = [np.zeros(size, np.uint8) for _ in keys]
            assert c.batch_get_into(keys, bufs) == [size] * count
            assert all((b == v).all() for b, v in zip(bufs, vals))


@pytest.mark.parametrize("op", ["put", "batch_put"])
def test_a_commit_whose_reply_is_lost_is_sent_again_and_the_put_succeeds(op):
    """The connection breaks after a commit went out (the master applied it; its reply
    is lost): the channel sends it again on a new connection and the master answers OK
    for what it applied, so the put (the second chunk's commit of a pipelined batch)
    succeeds and every value reads back. Before, a commit was never sent again once it
    may have reached the master: the put raised RpcFailed though its values were stored."""
    with setup("shm") as c:
        count, size = (40, LARGE_VALUE) if op == "batch_put" else (1, 4 * KIB)
        keys = [f"c{i}" for i in range(count)]
        vals = values(count, size, seed=7)
        chan = c._channel()
        exchange, commits = chan._exchange, []

        def lose_a_commit_reply(frame, kind, *rest):
            reply = exchange(frame, kind, *rest)
            if kind is P.PutCommit:
                commits.append(reply)
                if len(commits) == min(2, count):
                    raise ConnectionResetError("the reply was lost (injected)")
            return reply

        chan._exchange = lose_a_commit_reply
        if op == "batch_put":
            assert c.batch_put(keys, vals) == [ErrorCode.OK] * count
            assert len(commits) == len(put_spans(count, size, in_place=True)) + 1  # one of them twice
        else:
            assert c.put(keys[0], vals[0]) == 1
            assert len(commits) == 2
        del chan._exchange
        assert all(code == ErrorCode.OK for reply in commits for code in reply.codes)
        bufs = [np.zeros(size, np.uint8) for _ in keys]
        assert c.batch_get_into(keys, bufs) == [size] * count
        assert all((b == v).all() for b, v in zip(bufs, vals))
        assert c.stats().object_count == count


def test_a_node_that_stops_answering_costs_a_pipelined_batch_one_timeout_not_one_per_chunk():
    """A SIGSTOPped node (its port accepts, nothing answers): every item of a batch get
    over TCP fails, after the client's timeout once: the later chunks' reads find the
    batch's deadline passed and fail at once (before: one timeout per chunk, 6.1 s with
    timeout_s=1 and six chunks; then 0.2 s a chunk, a kernel poll each). A batch put
    (one chunk over TCP) likewise waits once for its writes and its PutStart way together."""
    timeout_s = 5.0
    with Cluster(segment_size="64MiB", num_nodes=1) as cluster:
        with Client(cluster.master_addr, force_tcp=True, timeout_s=timeout_s) as c:
            keys = [f"s{i}" for i in range(128)]
            assert c.batch_put(keys, values(128, 4 * KIB)) == [ErrorCode.OK] * 128
            assert len(get_spans(128, 4 * KIB)) >= 4
            pid = int(cluster.nodes[0]["pid"])
            assert pause_process(pid)
            try:
                started = time.monotonic()
                got = c.batch_get_into(keys, [np.zeros(4 * KIB, np.uint8) for _ in keys])
                took = time.monotonic() - started
                started = time.monotonic()
                codes = c.batch_put([f"n{i}" for i in range(128)], values(128, 64 * KIB))
                took_put = time.monotonic() - started
            finally:
                os.kill(pid, signal.SIGCONT)
            assert got == [ErrorCode.TRANSFER_FAIL] * 128
            assert took < 2 * timeout_s, f"{took:.1f} s: more than one timeout"
            # the put: one timeout for its chunks in the lease and the PutStart way together
            assert ErrorCode.OK not in codes
            assert took_put < 1.5 * timeout_s, f"{took_put:.1f} s: more than one timeout"


@pytest.mark.parametrize("op", ("get", "put"))
def test_a_chunk_that_raises_returns_every_grant_and_leaves_the_client_usable(op):
    """A read (or write) of the second chunk raises while the master answers the next
    chunk: the exception reaches the caller as it was, every read grant of the batch
    goes back to the master, nothing of the put is committed after the failed chunk,
    and the next batch works."""
    with setup("shm") as c:
        size = 4 * KIB if op == "get" else LARGE_VALUE
        keys = [f"r{i}" for i in range(100 if op == "get" else 40)]
        vals = values(len(keys), size, seed=9)
        if op == "get":
            assert c.batch_put(keys, vals) == [ErrorCode.OK] * len(keys)
        name = "_read_handles" if op == "get" else "_write_lease_in_place"  # shm: copies in this process
        calls, real = [], getattr(c, name)

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise TimeoutError("injected: the second chunk's copy failed")
            return real(*args, **kwargs)

        setattr(c, name, failing)
        try:
            with pytest.raises(TimeoutError, match="injected"):
                if op == "get":
                    c.batch_get_into(keys, [np.zeros(size, np.uint8) for _ in keys])
                else:
                    c.batch_put(keys, vals)
        finally:
            delattr(c, name)
        wait_for(lambda: c.stats().open_grants == 0, 5, "every grant returned")
        if op == "put":
            first = put_spans(len(keys), size, in_place=True)[0]
            assert c.batch_is_exist(keys) == [1 if first[0] <= i < first[1] else 0 for i in range(len(keys))]
            c.batch_remove(keys, force=True)
            assert c.batch_put(keys, vals) == [ErrorCode.OK] * len(keys)
        bufs = [np.zeros(size, np.uint8) for _ in keys]
        assert c.batch_get_into(keys, bufs) == [size] * len(keys)
        assert all((b == v).all() for b, v in zip(bufs, vals))
