"""Busy polling after an answer (kvpool.master.busy_poll): only while requests follow
answers quickly, for at most the configured time, then the loop sleeps in epoll again.
Clocks are injected; the loop is a real one."""

from __future__ import annotations

import asyncio

import pytest

from kvpool import protocol as P
from kvpool.master.busy_poll import EXPECT_MAX_S, BusyPoll
from kvpool.rpc import RpcChannel


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _exchange(poll: BusyPoll, clock: Clock, gap_s: float, loop=None) -> None:
    """An answer, then the next request ``gap_s`` later."""
    poll.answered(loop or _NoLoop())
    clock.now += gap_s
    poll.request()


class _NoLoop:
    def call_soon(self, *args):
        pass


def test_polls_only_while_requests_follow_answers_quickly():
    clock = Clock()
    poll = BusyPoll(max_s=300e-6, clock=clock)
    assert poll.budget() == 0.0  # nothing seen yet
    _exchange(poll, clock, 20e-6)
    assert poll.budget() == pytest.approx(40e-6)  # twice the mean gap
    for _ in range(40):
        _exchange(poll, clock, 0.5)  # the clients went quiet between requests
    assert poll.budget() == 0.0
    for _ in range(12):  # a quiet spell is forgotten within a few quick requests
        _exchange(poll, clock, 200e-6)
    assert poll.budget() == pytest.approx(300e-6)  # capped at the maximum
    assert BusyPoll(max_s=0, clock=clock).budget() == 0.0


def test_the_loop_keeps_a_callback_ready_until_the_budget_is_spent():
    clock = Clock()
    poll = BusyPoll(max_s=300e-6, clock=clock)
    _exchange(poll, clock, 50e-6)

    async def scenario():
        loop = asyncio.get_running_loop()
        poll.answered(loop)
        assert poll.polls == 1 and poll._polling
        for _ in range(5):
            await asyncio.sleep(0)  # loop iterations without sleeping: still polling
        assert poll._polling
        poll.answered(loop)  # a second answer while polling extends, starts no second poll
        assert poll.polls == 1
        clock.now += 1.0  # past the budget
        for _ in range(5):
            await asyncio.sleep(0)
        assert not poll._polling  # the loop may sleep in epoll again

    asyncio.run(scenario())


def _spin(times: int = 5):
    async def iterations():
        for _ in range(times):
            await asyncio.sleep(0)
    return iterations()


def test_a_wake_polls_after_the_next_answer_without_any_gap_history_and_the_answer_after_ends_it():
    clock = Clock()
    poll = BusyPoll(max_s=100e-6, clock=clock)

    async def scenario():
        loop = asyncio.get_running_loop()
        assert poll.budget() == 0.0  # no gaps seen: an answer alone would not poll
        poll.expect(0.001)
        poll.answered(loop)  # the Wake's own (silent) answer
        assert poll._polling and poll._until == pytest.approx(clock.now + 0.001)
        await _spin()
        assert poll._polling  # still within the expected time
        clock.now += 200e-6
        poll.request()  # the commit came, 200 us on: a gap above max_s, so no budget of its own
        poll.answered(loop)
        assert poll._until == clock.now  # the Wake's poll does not outlive the commit's answer
        await _spin()
        assert not poll._polling  # the loop may sleep in epoll again

    asyncio.run(scenario())


def test_a_wake_is_capped_ignored_without_busy_polling_and_used_once():
    clock = Clock()
    poll = BusyPoll(max_s=300e-6, clock=clock)
    poll.expect(60.0)  # a hostile or confused client cannot make the master spin long
    poll.answered(_NoLoop())
    assert poll._until - clock.now == pytest.approx(EXPECT_MAX_S)
    poll.answered(_NoLoop())  # the next answer: no Wake left, no gap history
    assert poll._until == clock.now
    off = BusyPoll(max_s=0, clock=clock)
    off.expect(0.001)
    off.answered(_NoLoop())
    assert off.polls == 0


@pytest.mark.cluster(extra_master_args=["--busy-poll", "0"])
def test_a_master_started_without_busy_polling_answers_as_before(cluster):
    chan = RpcChannel(cluster.master_addr, secret=b"")
    try:
        assert all(chan.call(P.Ping()).code == 0 for _ in range(20))
    finally:
        chan.close()
