"""Transfer faults on real processes: a node killed mid-transfer, malformed frames on a
node's data port. Nothing hangs, no partial bytes count as success, one bad connection
never harms another."""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest

from kvpool import protocol as P
from kvpool.child import pause_process
from kvpool.client import Client
from kvpool.config import parse_addr
from kvpool.errors import TransferFailed
from kvpool.transfer import local_host_id
from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.request import Op, TransferRequest, TransferStatus
from kvpool.transfer.tcp import SILENT_FIRST_S, SILENT_MAX_S, SilentPeers, TcpTransport
from proc_helpers import wait_for

BIG = 192 << 20


@pytest.mark.cluster(segment_size="256MiB")
def test_node_killed_mid_tcp_transfer_fails_within_timeout_and_reports_no_success(cluster):
    node = cluster.nodes[0]
    segment = P.SegmentInfo(node["segment"], local_host_id(), node["shm_name"], 256 << 20, node["addr"])
    src = np.full(BIG, 0xAB, np.uint8)
    with TransferEngine([TcpTransport()], timeout_s=20) as engine:
        assert engine.transfer([TransferRequest(Op.WRITE, memoryview(src), 0, segment, 0, BIG)]) == [0]
        dst = np.zeros(BIG, np.uint8)
        t0 = time.monotonic()
        handle = engine.submit([TransferRequest(Op.READ, memoryview(dst), 0, segment, 0, BIG)], timeout_s=15)
        # the first bytes of some slice have landed: the transfer is under way
        wait_for(lambda: dst[:: 1 << 20].any() or handle.done(), every_s=0.001)
        cluster.stop_node(0, kill=True)
        statuses = handle.wait()
        assert time.monotonic() - t0 < 15
        if statuses == [TransferStatus.COMPLETED]:  # finished before the kill landed
            assert (dst == 0xAB).all()
        else:
            assert statuses == [TransferStatus.FAILED]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_silent_peer_is_skipped_doubling_while_it_stays_silent_and_cleared_by_an_answer():
    clock = Clock()
    peers = SilentPeers(clock)
    peers.check("n:1")  # never timed out: asked
    peers.timed_out("n:1")
    with pytest.raises(TimeoutError, match="node n:1 let a request time out: not asked for 1 s"):
        peers.check("n:1")
    peers.check("n:2")  # other peers are asked
    clock.now += SILENT_FIRST_S
    peers.check("n:1")  # the skip is over: the next request asks it
    peers.timed_out("n:1")  # and it timed out again: twice as long
    clock.now += SILENT_FIRST_S
    with pytest.raises(TimeoutError, match="not asked for 2 s"):
        peers.check("n:1")
    for _ in range(10):
        peers.timed_out("n:1")
    with pytest.raises(TimeoutError, match=f"not asked for {SILENT_MAX_S:g} s"):
        peers.check("n:1")
    peers.answered("n:1")
    peers.check("n:1")


def test_a_node_mounted_again_on_the_address_of_a_silent_one_is_asked_at_once():
    """Found by a trial: a node restarted on the same address stayed skipped for what was
    left of its predecessor's skip (up to 30 s of misses). Its new mount epoch makes it
    another peer; the old epoch stays skipped (its grants are stale anyway)."""
    clock = Clock()
    peers = SilentPeers(clock)
    for _ in range(6):
        peers.timed_out("n:1", epoch=7)
    with pytest.raises(TimeoutError, match=f"not asked for {SILENT_MAX_S:g} s"):
        peers.check("n:1", epoch=7)
    peers.check("n:1", epoch=8)  # mounted again: asked
    peers.answered("n:1", epoch=8)
    with pytest.raises(TimeoutError):
        peers.check("n:1", epoch=7)


def test_the_silent_peers_table_holds_only_peers_that_can_still_be_skipped():
    """Found in review: an entry per (address, mount epoch) was never dropped, so a client
    that outlives many restarts of silent nodes kept them all. A time-out forgets older
    mounts of its address and peers whose last skip ended over SILENT_MAX_S ago."""
    clock = Clock()
    peers = SilentPeers(clock)
    peers.timed_out("n:1", epoch=7)
    peers.timed_out("n:2", epoch=1)
    peers.timed_out("n:1", epoch=8)  # n:1 mounted again, then silent again: epoch 7 is gone
    assert sorted(peers._skips) == [("n:1", 8), ("n:2", 1)]
    clock.now += SILENT_FIRST_S + SILENT_MAX_S + 1
    peers.timed_out("n:3", epoch=1)
    assert sorted(peers._skips) == [("n:3", 1)]


@pytest.mark.cluster(segment_size="64MiB")
def test_a_hung_node_costs_one_timeout_then_reads_fail_at_once_until_it_answers(cluster):
    """Found by a trial: with a node stopped (SIGSTOP; the master still lists it for its
    TTL), every read of its pages waited the client's whole timeout."""
    with Client(cluster.master_addr, force_tcp=True, timeout_s=1) as c:
        c.put("k", b"v" * 4096)
        pid = cluster.node_children[0].proc.pid
        assert pause_process(pid)
        try:
            with pytest.raises(TransferFailed):
                c.get("k")  # waits for its deadline: the node is marked silent
            with pytest.raises(TransferFailed, match="not asked for"):
                c.get("k")  # at once, without asking it
        finally:
            os.kill(pid, signal.SIGCONT)
        # the skip ends after a second; then the node answers and is cleared
        wait_for(lambda: _get_or_none(c, "k") == b"v" * 4096, timeout_s=15, what="reads from the node again")


def _get_or_none(client: Client, key: str) -> bytes | None:
    try:
        return client.get(key)
    except TransferFailed:
        return None


@pytest.mark.cluster(segment_size="256MiB")
def test_client_get_from_a_killed_node_raises_instead_of_returning_partial_bytes(cluster):
    with Client(cluster.master_addr, force_tcp=True, timeout_s=10) as c:
        c.put("big", np.full(BIG, 7, np.uint8))
        dst = np.zeros(BIG, np.uint8)
        outcome = []

        def reader():
            try:
                outcome.append(c.get_into("big", dst))
            except TransferFailed as exc:
                outcome.append(exc)

        t = threading.Thread(target=reader)
        t0 = time.monotonic()
        t.start()
        wait_for(lambda: dst[:: 1 << 20].any() or outcome, every_s=0.001)
        cluster.stop_node(0, kill=True)
        t.join(15)
        assert not t.is_alive() and time.monotonic() - t0 < 15
        assert isinstance(outcome[0], TransferFailed) or (outcome[0] == BIG and (dst == 7).all())


def _raw(addr: str) -> socket.socket:
    s = socket.create_connection(parse_addr(addr), timeout=5)
    return s


def _closed_by_peer(s: socket.socket) -> bool:
    """True when the server closed the connection (EOF or reset) within the timeout."""
    try:
        while True:
            if not s.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _frame(body: bytes) -> bytes:
    return P.HEADER.pack(P.MAGIC, len(body)) + body


MALFORMED = {
    "wrong magic": P.HEADER.pack(b"XXXX", 4) + b"abcd",
    "huge length": P.HEADER.pack(P.MAGIC, 0xFFFFFFFF),
    "length just over the limit": P.HEADER.pack(P.MAGIC, P.MAX_FRAME + 1),
    "truncated header": P.MAGIC + b"\x05",
    "truncated body": P.HEADER.pack(P.MAGIC, 100) + b"abc",
    "random bytes": os.urandom(4096),
    "body that is not msgpack": _frame(b"\xc1\xc1\xc1\xc1"),
    "control message on the data port": P.encode_frame(P.Ping()),
    "write lists of different lengths": P.encode_frame(P.DataWriteMany([0, 8], [8])),
    "write past the segment": P.encode_frame(P.DataWriteMany([0], [2**40])),
    "negative write offset": P.encode_frame(P.DataWrite(-5, 8)),
    "wrong field types": _frame(b"\x93\xa8DataRead\xa1x\xa1y"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_frames_close_that_connection_and_nothing_else(name, module_cluster):
    addr = module_cluster.node_addrs[0]
    with Client(module_cluster.master_addr, force_tcp=True) as healthy:
        healthy.put(f"keep-{name}", b"still here")
        assert healthy.get(f"keep-{name}") == b"still here"  # its pooled connection is open
        with _raw(addr) as bad:
            bad.sendall(MALFORMED[name])
            if name.startswith("truncated"):
                bad.shutdown(socket.SHUT_WR)  # the rest never comes
            assert _closed_by_peer(bad)
        assert healthy.get(f"keep-{name}") == b"still here"
        buf = bytearray(10)
        assert healthy.get_into(f"keep-{name}", buf) == 10 and buf == b"still here"
        healthy.remove(f"keep-{name}", force=True)


def test_refused_read_keeps_the_connection_and_a_stream_of_garbage_does_not_kill_the_node(module_cluster):
    addr = module_cluster.node_addrs[0]
    with _raw(addr) as s:
        s.sendall(P.encode_frame(P.DataRead([2**33], [1])))
        reply = P.data_reply_decoder.decode(P.recv_frame(s))
        assert reply.code != 0
        s.sendall(P.encode_frame(P.DataRead([0, 100], [4, 4])))
        assert P.data_reply_decoder.decode(P.recv_frame(s)).length == 8
        assert len(s.recv(8, socket.MSG_WAITALL)) == 8
    for seed in range(20):  # many hostile connections in a row
        with _raw(addr) as s:
            s.sendall(np.random.default_rng(seed).bytes(512))
            assert _closed_by_peer(s)
    with Client(module_cluster.master_addr, force_tcp=True) as c:
        c.put("after-garbage", struct.pack("<Q", 42))
        assert c.get("after-garbage") == struct.pack("<Q", 42)
        c.remove("after-garbage", force=True)
