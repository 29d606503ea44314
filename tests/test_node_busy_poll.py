"""Busy polling of a node's data connections (kvpool.node.data_server, the policy of
kvpool.spin.RequestGaps): after an answer, a connection whose requests have followed
its answers quickly polls for the next one before it blocks; one whose client pauses
longer, or a server started with 0, never polls. A real DataServer serves a real
socket pair; its clock is injected, so "quickly" does not depend on this machine's
speed. Requests are sent ahead (pipelined), so a poll finds the next one waiting."""

from __future__ import annotations

import socket
import threading

import pytest

from kvpool import protocol as P
from kvpool.errors import ErrorCode
from kvpool.node.data_server import DataServer
from kvpool.spin import RequestGaps, poll_readable
from kvpool.transfer.tcp import read_reply

SEGMENT = bytes(range(256)) * 16  # 4 KiB of known bytes


class SteppingClock:
    """Seconds that advance by ``step`` at every reading."""

    def __init__(self, step: float):
        self.now, self.step = 100.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _serve_reads(busy_poll_s: float, step_s: float, reads: int) -> dict:
    """Send ``reads`` DataReads of 64 bytes at once on one connection, check every
    answer's bytes, close; returns the server's counters."""
    server = DataServer(socket.socket(), memoryview(bytearray(SEGMENT)), busy_poll_s=busy_poll_s,
                        clock=SteppingClock(step_s))
    client, served = socket.socketpair()
    worker = threading.Thread(target=server._serve_conn, args=(served,), daemon=True)
    worker.start()
    try:
        client.settimeout(10)
        offsets = [64 * i for i in range(reads)]
        client.sendall(b"".join(P.encode_frame(P.DataRead([o], [64])) for o in offsets))
        for offset in offsets:
            assert read_reply(client, None).code == ErrorCode.OK
            got = bytearray(64)
            assert client.recv_into(got, 64, socket.MSG_WAITALL) == 64
            assert bytes(got) == SEGMENT[offset : offset + 64]
    finally:
        client.close()
        worker.join(10)
        server.sock.close()
    assert not worker.is_alive()
    return server.counters.snapshot()


def test_requests_that_follow_answers_quickly_are_caught_by_the_poll():
    # the 1st request has no answer before it, the 2nd gives the first gap: from the
    # 3rd on, each is found waiting by the poll after the previous answer
    snap = _serve_reads(busy_poll_s=300e-6, step_s=1e-6, reads=6)
    assert snap["requests"] == {"read": 6}
    assert snap["polled"] == 4


def test_writes_are_not_followed_by_a_poll():
    """A writer's next request comes after its commit to the master: no poll after a
    write's answer, however quickly the next one follows; the bytes land all the same."""
    server = DataServer(socket.socket(), memoryview(bytearray(len(SEGMENT))), busy_poll_s=300e-6,
                        clock=SteppingClock(1e-6))
    client, served = socket.socketpair()
    worker = threading.Thread(target=server._serve_conn, args=(served,), daemon=True)
    worker.start()
    try:
        client.settimeout(10)
        frames = [P.encode_frame(P.DataWriteMany([64 * i], [64])) + SEGMENT[64 * i : 64 * i + 64]
                  for i in range(6)]
        client.sendall(b"".join(frames))
        for _ in frames:
            assert read_reply(client, None).code == ErrorCode.OK
    finally:
        client.close()
        worker.join(10)
        server.sock.close()
    snap = server.counters.snapshot()
    assert snap["requests"] == {"write": 6} and snap["polled"] == 0
    assert bytes(server.segment[: 6 * 64]) == SEGMENT[: 6 * 64]


def test_a_client_that_pauses_longer_than_the_poll_is_never_polled_for():
    snap = _serve_reads(busy_poll_s=300e-6, step_s=1.0, reads=6)  # every gap reads as seconds
    assert snap["requests"] == {"read": 6} and snap["polled"] == 0


def test_a_server_started_with_no_busy_poll_never_polls():
    snap = _serve_reads(busy_poll_s=0.0, step_s=1e-6, reads=6)
    assert snap["requests"] == {"read": 6} and snap["polled"] == 0


def test_poll_readable_returns_when_a_byte_waits_and_gives_up_at_its_end():
    a, b = socket.socketpair()
    with a, b:
        clock = SteppingClock(1e-3)
        assert not poll_readable(a, clock.now + 5e-3, clock)  # nothing came: gave up
        b.sendall(b"x")
        assert poll_readable(a, clock.now + 5e-3, clock)
        assert a.recv(1) == b"x"  # peeked, not consumed
        b.close()
        assert poll_readable(a, clock.now + 5e-3, clock)  # EOF: the next recv says so


def test_request_gaps_poll_only_after_an_answer():
    clock = SteppingClock(1e-6)
    gaps = RequestGaps(300e-6, clock)
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"x")
        assert not gaps.poll(a)  # no answer yet: nothing to poll after
        gaps.answered()
        gaps.request()
        gaps.answered()
        assert gaps.budget() == pytest.approx(2e-6)  # twice the mean gap
        assert gaps.poll(a)


@pytest.mark.cluster(extra_node_args=["--busy-poll", "0"])
def test_a_node_started_without_busy_polling_serves_tcp_as_before(cluster):
    from kvpool.client import Client

    with Client(cluster.master_addr, force_tcp=True) as c:
        for i in range(5):
            c.put(f"np{i}", bytes([i]) * 70_000)
        assert all(c.get(f"np{i}") == bytes([i]) * 70_000 for i in range(5))


def test_a_negative_busy_poll_is_a_one_line_error():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "kvpool", "node", "--busy-poll", "-5"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "busy-poll" in proc.stderr and "must be >= 0" in proc.stderr
    assert "Traceback" not in proc.stderr
