"""Vectored socket receives with polling (kvpool.transfer.iov) on real socket pairs:
bytes land in order across views, EOF and deadlines are reported, and a peer that
trickles its bytes cannot keep the receiver polling."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvpool.transfer import iov


def _pair():
    a, b = socket.socketpair()
    for s in (a, b):
        s.settimeout(None)
    return a, b


@pytest.mark.parametrize("split", [[1 << 20], [3, 70_000, 1 << 20]])
def test_a_polled_receive_fills_every_view_in_order(split):
    a, b = _pair()
    payload = bytes(range(256)) * (sum(split) // 256 + 1)
    payload = payload[:sum(split)]
    sender = threading.Thread(target=a.sendall, args=(payload,))
    sender.start()
    bufs = [bytearray(n) for n in split]
    iov.recv_views(b, [memoryview(x) for x in bufs], time.monotonic() + 10, poll_s=0.001)
    sender.join()
    assert b"".join(bufs) == payload
    a.close()
    b.close()


def test_a_polled_receive_reports_the_peer_closing_mid_payload():
    a, b = _pair()
    a.sendall(b"x" * 10)
    a.close()
    with pytest.raises(ConnectionError):
        iov.recv_views(b, [memoryview(bytearray(100))], time.monotonic() + 10, poll_s=0.001)
    b.close()


def test_a_peer_that_trickles_its_bytes_cannot_keep_the_receiver_polling():
    # every byte restarts the idle clock (poll_s is long here), so only the total bound
    # (POLL_TOTAL_S) ends the poll; the rest is then received blocking
    a, b = _pair()
    stop = threading.Event()

    def trickle():
        for _ in range(200):
            if stop.wait(0.002):
                return
            a.send(b"y")

    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        rest = iov._poll_into(b, [memoryview(bytearray(200))], 10.0, time.monotonic() + 30)
        assert rest and sum(len(v) for v in rest) > 100, "polled until the trickle ended"
    finally:
        stop.set()
        sender.join()
        a.close()
        b.close()
