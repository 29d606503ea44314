"""Spin-then-block reply waits (kvpool.spin): poll only for kinds of request whose replies
come quickly, never consume a byte, never poll past the budget, off with KVPOOL_SPIN_US=0."""

from __future__ import annotations

import socket
import time

import pytest

from kvpool import protocol as P
from kvpool.rpc import RpcChannel
from kvpool.spin import SPIN_MAX_US, ReplyWait, spin_max_s


def _recorded(wait: ReplyWait, kind, took_s: float, times: int = 1) -> None:
    for _ in range(times):
        wait.record(kind, time.perf_counter() - took_s)


def test_only_kinds_with_quick_replies_are_polled_for_and_never_past_the_maximum():
    wait = ReplyWait(max_s=200e-6)
    assert wait.budget("new") == 0.0  # nothing known yet: block
    _recorded(wait, "quick", 40e-6)
    assert 80e-6 <= wait.budget("quick") <= 200e-6  # twice the mean
    _recorded(wait, "slow", 0.01)
    assert wait.budget("slow") == 0.0  # a mean past the maximum: no polling at all
    _recorded(wait, "quick", 0.01, times=40)  # replies became slow: the mean follows
    assert wait.budget("quick") == 0.0
    _recorded(wait, "quick", 40e-6, times=12)  # and quick again: polled for within a few
    assert wait.budget("quick") > 0
    _recorded(wait, "near", 150e-6)
    assert wait.budget("near") == pytest.approx(200e-6)  # capped at the maximum


def test_a_poll_returns_when_a_byte_arrives_and_leaves_it_to_the_reader():
    a, b = socket.socketpair()
    try:
        wait = ReplyWait(max_s=5.0)
        _recorded(wait, "k", 1.0)
        b.sendall(b"x")
        started = time.perf_counter()
        wait.wait(a, "k", started)
        assert time.perf_counter() - started < 1.0  # did not poll on to its 2 s budget
        assert a.recv(1) == b"x"
        b.close()
        wait.wait(a, "k", time.perf_counter())  # EOF ends the poll too
        assert a.recv(1) == b""
    finally:
        a.close()


def test_a_poll_on_a_silent_socket_ends_with_its_budget():
    a, b = socket.socketpair()
    try:
        wait = ReplyWait(max_s=0.05)
        _recorded(wait, "k", 0.02)
        started = time.perf_counter()
        wait.wait(a, "k", started)
        assert 0.04 <= time.perf_counter() - started < 1.0
        a.setblocking(False)
        with pytest.raises(BlockingIOError):
            a.recv(1)  # nothing was there, nothing was invented
    finally:
        a.close()
        b.close()


def test_the_environment_sets_or_turns_off_polling(monkeypatch, caplog):
    monkeypatch.setenv("KVPOOL_SPIN_US", "0")
    wait = ReplyWait()
    _recorded(wait, "k", 1e-6)
    assert wait.budget("k") == 0.0
    monkeypatch.setenv("KVPOOL_SPIN_US", "50")
    assert spin_max_s() == pytest.approx(50e-6)
    monkeypatch.setenv("KVPOOL_SPIN_US", "lots")
    assert spin_max_s() == pytest.approx(SPIN_MAX_US / 1e6)
    assert spin_max_s() == pytest.approx(SPIN_MAX_US / 1e6)
    # a value that is ignored says so, once (every connection asks)
    said = [r.getMessage() for r in caplog.records if "KVPOOL_SPIN_US" in r.getMessage()]
    assert said == [f"KVPOOL_SPIN_US='lots' is not a whole number of microseconds: using {SPIN_MAX_US}"]


def test_the_master_channel_learns_to_poll_for_pings(module_cluster):
    chan = RpcChannel(module_cluster.master_addr, secret=b"")
    try:
        # the connection's first, slow, replies fade from the mean; on a loaded host a
        # burst of slow ones can hold it above the longest poll for a while (a CI run
        # saw it after 50), so ask until it learns, up to a bound
        for _ in range(2000):
            assert chan.call(P.Ping()).code == 0
            if not chan._replies.max_s or chan._replies.budget(P.Ping) > 0:
                break
        if chan._replies.max_s:
            assert chan._replies.budget(P.Ping) > 0
    finally:
        chan.close()
