"""Wake: a put tells the master its commit is coming as its write ends, so the master
polls for the commit instead of sleeping (kvpool.protocol.Wake, kvpool.client.put), run
against a real master and node. The master's side of it, BusyPoll.expect, is tested with
the rest of the busy-poll policy (tests/test_master_busy_poll.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvpool import protocol as P
from kvpool.client import Client
from kvpool.client.put import WAKE_MIN_BYTES
from kvpool.errors import ErrorCode
from kvpool.rpc import RpcChannel
from kvpool.transfer.request import Cancel, Op, TransferRequest, TransferStatus
from proc_helpers import scraped

MIB = 1 << 20


def test_cancel_calls_its_on_sent_once():
    calls = []
    cancel = Cancel(lambda: calls.append(1))
    cancel.payload_sent()
    cancel.payload_sent()
    assert calls == [1]
    Cancel().payload_sent()  # none given: nothing to call


@pytest.mark.cluster(segment_size="64MiB", extra_master_args=["--http-port", "0"])
def test_the_master_answers_no_wake_and_keeps_the_connection_in_step(cluster):
    http = cluster.master.info["http_addr"]
    chan = RpcChannel(cluster.master_addr, secret=b"")
    try:
        assert chan.notify(P.Wake(500))
        assert chan.notify(P.Wake(0))
        assert chan.call(P.Ping()).code == 0  # the Ping's reply, not one for a Wake
        assert chan.call(P.ExistKey("nothing")).code == ErrorCode.OBJECT_NOT_FOUND
    finally:
        chan.close()
    assert scraped(http, "kvpool_master_requests_total", op="Wake") == 2


def _wakes(cluster) -> float:
    return scraped(cluster.master.info["http_addr"], "kvpool_master_requests_total", op="Wake")


@pytest.mark.cluster(segment_size="64MiB", extra_master_args=["--http-port", "0"])
@pytest.mark.parametrize("force_tcp", [True, False], ids=["tcp", "shm"])
def test_a_long_put_sends_one_wake_and_a_short_one_none(cluster, force_tcp):
    assert 8 * (64 << 10) >= WAKE_MIN_BYTES > 4096  # what the puts below rely on
    rng = np.random.default_rng(7)
    big = rng.integers(0, 256, MIB, dtype=np.uint8)
    parts = [rng.integers(0, 256, 64 << 10, dtype=np.uint8) for _ in range(8)]  # 512 KiB in all
    with Client(cluster.master_addr, force_tcp=force_tcp) as c:
        before = _wakes(cluster)
        c.put("small", b"x" * 4096)
        assert _wakes(cluster) == before  # ends within the master's own poll
        c.put("big", big)
        assert _wakes(cluster) == before + 1
        assert c.batch_put([f"part{i}" for i in range(8)], parts) == [0] * 8
        assert _wakes(cluster) == before + 2  # one for the batch's write, not one per value
        assert c.get("big") == big.tobytes()
        assert [c.get(f"part{i}") for i in range(8)] == [p.tobytes() for p in parts]


@pytest.mark.cluster(segment_size="64MiB")
def test_a_tcp_write_reports_its_payload_sent_once_and_a_read_does_not(cluster):
    src = np.random.default_rng(3).integers(0, 256, 2 * MIB, dtype=np.uint8)
    with Client(cluster.master_addr, force_tcp=True) as c:
        c.put("k", src)
        replica = c.query("k").replicas[0]
        sent = []
        halves = [TransferRequest(Op.WRITE, memoryview(src)[i * MIB:(i + 1) * MIB], 0, replica.segment,
                                  replica.offset + i * MIB, MIB) for i in range(2)]
        result = c.engine.transfer(halves, 5.0, on_sent=lambda: sent.append(time.monotonic()))
        assert list(result) == [TransferStatus.COMPLETED] * 2 and len(sent) == 1
        dst = bytearray(2 * MIB)
        read = TransferRequest(Op.READ, memoryview(dst), 0, replica.segment, replica.offset, 2 * MIB)
        assert list(c.engine.transfer([read], 5.0, on_sent=lambda: sent.append(0))) == [TransferStatus.COMPLETED]
        assert len(sent) == 1 and dst == src.tobytes()
