"""Location hints: a get of a key read before copies while the master answers, and the
copy counts only when the answer names the same replica of the same version
(:mod:`kvpool.client.hints`). Real master and node processes; the hint's rule itself on
crafted replies."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest
from proc_helpers import wait_for

from kvpool import protocol as P
from kvpool.child import pause_process
from kvpool.client import Client
from kvpool.client.hints import Hint, LocationHints
from kvpool.errors import KVPoolError, ObjectNotFound
from kvpool.launch import Cluster
from kvpool.rpc import RpcChannel

KINDS = ("tcp", "shm", "local")
SIZE = 64 << 10


def _seg(epoch: int = 7, name: str = "seg-a") -> P.SegmentInfo:
    return P.SegmentInfo(name, "host", "shm", 1 << 20, "127.0.0.1:1", epoch)


def _reply(replicas, version: int = 11, size: int = 100, code: int = 0) -> P.GetResp:
    return P.GetResp(code, size, 5000, replicas, 1, version)


def test_a_hint_counts_only_when_the_reply_names_the_same_replica_of_the_same_version():
    here = P.ReplicaDesc(_seg(), 4096, 100)
    hint = Hint(here, 100, 11)
    assert hint.confirmed_by(_reply([here]))
    assert hint.confirmed_by(_reply([P.ReplicaDesc(_seg(name="seg-b"), 0, 100), here]))  # one of several
    assert not hint.confirmed_by(_reply([here], version=12))  # the range was freed and written again
    assert not hint.confirmed_by(_reply([here], size=99))
    assert not hint.confirmed_by(_reply([P.ReplicaDesc(_seg(epoch=8), 4096, 100)]))  # mounted again
    assert not hint.confirmed_by(_reply([P.ReplicaDesc(_seg(), 8192, 100)]))  # moved
    assert not hint.confirmed_by(_reply([]))
    assert not hint.confirmed_by(P.GetResp(int(ObjectNotFound.code)))


def test_hints_are_bounded_and_can_be_turned_off():
    hints = LocationHints(kept=2)
    desc = P.ReplicaDesc(_seg(), 0, 100)
    for key in ("a", "b", "c"):
        hints.note(key, desc, _reply([desc]))
    assert hints.get("a") is None and hints.get("b") and hints.get("c")  # the oldest went
    hints.note("b", desc, _reply([desc]))
    hints.note("d", desc, _reply([desc]))
    assert hints.get("c") is None and hints.get("b")  # a key noted again is the newest
    hints.forget("b")
    assert hints.get("b") is None
    off = LocationHints(kept=0)
    off.note("a", desc, _reply([desc]))
    assert off.get("a") is None
    hints.note("v0", desc, _reply([desc], version=0))  # a master that names no version: no hint
    assert hints.get("v0") is None


@contextlib.contextmanager
def setup(kind: str, **cluster):
    with Cluster(segment_size="64MiB", num_nodes=0 if kind == "local" else 1, **cluster) as c:
        with Client(c.master_addr, force_tcp=kind == "tcp", alloc_leases=False,
                    global_segment_size=(16 << 20) if kind == "local" else 0) as client:
            yield c, client


def value(tag: int) -> np.ndarray:
    return np.random.default_rng(tag).integers(0, 256, SIZE, dtype=np.uint8)


@pytest.mark.parametrize("kind", KINDS)
def test_a_key_read_again_is_copied_from_its_hint_and_confirmed(kind):
    with setup(kind) as (_, client):
        client.put("k", value(1))
        assert client.get("k") == value(1).tobytes()
        assert client.hint_counts["confirmed"] == 0  # the first read had no hint
        buf = np.zeros(SIZE, np.uint8)
        assert client.get_into("k", buf) == SIZE and (buf == value(1)).all()
        assert client.get("k") == value(1).tobytes()
        assert client.hint_counts == {"confirmed": 2}


@pytest.mark.parametrize("kind", KINDS)
def test_a_hint_of_a_replaced_or_removed_value_is_a_miss_and_the_new_bytes_are_read(kind):
    with setup(kind) as (_, client):
        client.put("k", value(1))
        first = client.query("k")
        client.release([first])
        client.get("k")
        # the same key again, at the very range of its old value: only the version differs
        client.remove("k", force=True)
        client.put("k", value(2))
        again = client.query("k")
        client.release([again])
        assert again.replicas == first.replicas, "the test needs the new value on the old range"
        buf = np.zeros(SIZE, np.uint8)
        assert client.get_into("k", buf) == SIZE and (buf == value(2)).all()
        assert client.hint_counts == {"missed": 1}
        # another key on the old range, the key elsewhere
        client.remove("k", force=True)
        client.put("other", value(3))
        client.put("k", value(4))
        assert client.get("k") == value(4).tobytes()
        assert client.hint_counts["missed"] == 2
        client.remove("k", force=True)
        with pytest.raises(ObjectNotFound):
            client.get_into("k", buf)
        assert client.hints.get("k") is None


@pytest.mark.parametrize("kind", KINDS)
def test_after_a_master_restart_a_hint_never_counts(kind):
    with setup(kind, extra_master_args=["--client-ttl", "1"]) as (cluster, client):
        client.put("k", value(1))
        client.get("k")  # hinted under the old master's mount epoch
        cluster.restart_master(kill=True)

        def mounted():
            with contextlib.suppress(KVPoolError):
                return len(client.stats().segments) == 1
        wait_for(mounted, 20, "the segment mounted again")
        assert client.get("k") == value(1).tobytes()  # restored, same version, new epoch
        assert client.hint_counts == {"missed": 1}
        assert client.get("k") == value(1).tobytes()
        assert client.hint_counts == {"missed": 1, "confirmed": 1}


def test_work_done_during_a_call_that_raises_leaves_the_channel_usable(cluster):
    chan = RpcChannel(cluster.master_addr)
    ran = []

    def boom():
        ran.append(1)
        raise ValueError("during")

    with pytest.raises(ValueError):
        chan.call(P.Ping(), during=boom)
    assert isinstance(chan.call(P.Ping()), P.Resp)  # a new connection; no reply left unread
    assert chan.call(P.Ping(), during=lambda: ran.append(2)) is not None and ran == [1, 2]

    def stalled():  # the work's own OSError (a copy that timed out) is not a broken master
        raise TimeoutError("a copy timed out")

    with pytest.raises(TimeoutError):
        chan.call(P.GetReplicaList("nothing"), during=stalled)
    assert isinstance(chan.call(P.Ping()), P.Resp)
    chan.close()


def test_a_hint_to_a_node_that_stopped_answering_costs_a_bounded_wait_not_the_timeout():
    # the node is SIGSTOPped: its port still accepts, nothing answers; the master drops
    # its segment after --client-ttl. A get must not wait the client's whole timeout on
    # the hinted copy before reading the master's answer (the key is gone with the node)
    with Cluster(segment_size="64MiB", num_nodes=2, extra_master_args=["--client-ttl", "1"]) as cluster:
        with Client(cluster.master_addr, force_tcp=True, timeout_s=30) as client:
            client.put("k", value(1))
            client.get("k")
            handle = client.query("k")
            client.release([handle])
            name = handle.replicas[0].segment.name
            [victim] = [c for c in cluster.node_children if name in str(c.info)]
            assert pause_process(victim.proc.pid)
            try:
                wait_for(lambda: len(client.stats().segments) == 1, 20, "the stopped node's segment dropped")
                started = time.monotonic()
                with pytest.raises(ObjectNotFound):
                    client.get("k")
                assert time.monotonic() - started < 10, "the hinted copy waited for the client's timeout"
            finally:
                os.kill(victim.proc.pid, signal.SIGCONT)
