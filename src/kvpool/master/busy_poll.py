"""Busy polling: the master's event loop keeps polling for a short while after it
answers, while requests come that quickly.

Why: on the 2-vCPU VM of docs/bench.md the wake-up of a process blocked on another
vCPU costs some 30-40 us (an inter-processor interrupt through the hypervisor; the
guest halts an idle vCPU at once). A client that polls for its reply
(:mod:`kvpool.spin`) saves its own wake-up; a master that polls saves the other one.
Measured there (a client in a loop, Unix socket): a Ping round trip 32 -> 14 us, a
4 KiB put 95 -> 44 us, a GetReplicaList 63 -> 23 us. The same trade as NAPI busy
polling or a polling reactor: a core stays busy while requests keep coming.

The cost is bounded and adaptive. :class:`BusyPoll` keeps an exponentially weighted
mean of the gap between the master's last answer and the next request (any
connection; :class:`~kvpool.spin.PollBudget`, as the client's reply waits). It polls only while that mean is below ``max_s``, for up to twice the
mean, so a master whose clients are quiet, or only come back after long work of
their own, sleeps in epoll as before. While polling, the loop has a callback ready
at all times, so it asks the kernel for events without sleeping (uvloop and asyncio
both poll with a zero timeout when a callback is ready).

A client may also say when its next request comes (:class:`~kvpool.protocol.Wake`: a
put whose write outlasts the poll, for its commit): :meth:`BusyPoll.expect` makes the
next answer's poll that long, at most :data:`EXPECT_MAX_S`, whatever the mean; each
answer sets the poll's end afresh, so the commit's answer ends it.
"""

from __future__ import annotations

import asyncio
import os
import time

from kvpool.spin import BUSY_POLL_US, RequestGaps

EXPECT_MAX_S = 0.002  # the longest poll a Wake asks for is cut to this (seconds)


class BusyPoll:
    """The polling policy of one event loop (see the module docstring). ``max_s``:
    the longest poll after an answer, seconds (0: never poll); ``clock``: seconds,
    time.perf_counter by default."""

    def __init__(self, max_s: float = BUSY_POLL_US / 1e6, clock=time.perf_counter):
        self.max_s = max_s
        self.gaps = RequestGaps(max_s, clock)  # from an answer to the next request
        self.clock = clock
        self.polls = 0  # polls started (for tests and stats)
        self._until = 0.0
        self._polling = False
        self._expected = 0.0  # seconds a Wake asked to poll after the next answer

    def expect(self, within_s: float) -> None:
        """A client said its next request follows within ``within_s`` seconds
        (:class:`~kvpool.protocol.Wake`): the next answer is followed by a poll that
        long, at most :data:`EXPECT_MAX_S`, whatever the gaps' mean."""
        self._expected = min(within_s, EXPECT_MAX_S) if self.max_s else 0.0

    def budget(self) -> float:
        """Seconds to poll after an answer now (0: sleep in epoll)."""
        return self.gaps.budget()

    def request(self) -> None:
        """A request arrived: fold the gap since the last answer into the mean."""
        self.gaps.request()

    def answered(self, loop: asyncio.AbstractEventLoop) -> None:
        """A request was handled: poll for the next one for :meth:`budget` seconds."""
        now = self.gaps.answered()
        budget, self._expected = max(self.budget(), self._expected), 0.0
        self._until = now + budget  # an earlier poll's end is replaced: this answer's gap starts now
        if not budget:
            return
        if not self._polling:
            self._polling = True
            self.polls += 1
            loop.call_soon(self._poll, loop)

    def _poll(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.clock() < self._until:
            os.sched_yield()  # another process woken on this core (a node) runs first
            loop.call_soon(self._poll, loop)  # a ready callback: the next epoll does not sleep
        else:
            self._polling = False
