"""Waiting for a reply on a blocking socket: poll it briefly, then block.

Why: on the 2-vCPU VM of docs/bench.md a request/reply round trip to the master
(a Ping over its Unix socket) took 62-70 us when the caller blocked in recv, and 30 us
when it polled the socket meanwhile; with both processes pinned to one vCPU it took
15 us. Waking a process blocked on another vCPU costs some 35 us there (an
inter-processor interrupt through the hypervisor); a process that polls needs no
wake-up. Transfer engines make the same trade when they busy-poll completion queues:
the caller's core stays busy for as long as the reply takes, so the spin is bounded
and only used where replies usually come within it.

:class:`ReplyWait` keeps, per kind of request, an exponentially weighted mean of how
long replies take (send to reply; :class:`PollBudget`, which the master's busy poll
uses too). It polls only for kinds whose mean is below its
``max_s``, for up to twice the mean; a reply that takes longer is then waited for in
the blocking recv as before, so slow replies (a batch of thousands of keys) cost no
spinning. ``KVPOOL_SPIN_US`` sets ``max_s`` in microseconds (0 turns polling off: a
host with more busy processes than cores).

Servers poll from the other side: :class:`RequestGaps` keeps the mean gap from a
server's answer to the next request and polls for that request (:func:`poll_readable`)
while the gaps are short, up to :data:`BUSY_POLL_US` (the master's event loop,
:mod:`kvpool.master.busy_poll`; a node's data connections after a read,
:mod:`kvpool.node.data_server`).
"""

from __future__ import annotations

import logging
import os
import socket
import time

SPIN_MAX_US = 200  # default longest poll, us (a polled put commit took 76 us here, blocked 120)
# default longest poll of a server for the next request after an answer, us (the master's
# event loop, kvpool.master.busy_poll; a node's data connections): covers a client
# copying 1 MiB (~150 us here) before it asks again
BUSY_POLL_US = 300
_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT
_WEIGHT = 1 / 8  # of the newest wait in the mean
log = logging.getLogger("kvpool.spin")
_warned: set[str] = set()  # bad KVPOOL_SPIN_US values already warned about


def spin_max_s() -> float:
    """Longest poll in seconds: ``KVPOOL_SPIN_US`` (microseconds, >= 0), else
    :data:`SPIN_MAX_US`. A value that is not a whole number is ignored, with a warning
    (once per process: every connection asks)."""
    text = os.environ.get("KVPOOL_SPIN_US", "")
    try:
        return max(0, int(text or SPIN_MAX_US)) / 1e6
    except ValueError:
        if text not in _warned:
            _warned.add(text)
            log.warning("KVPOOL_SPIN_US=%r is not a whole number of microseconds: using %d",
                        text, SPIN_MAX_US)
        return SPIN_MAX_US / 1e6


def poll_readable(sock: socket.socket, end: float, clock=time.perf_counter) -> bool:
    """Poll ``sock`` (peeking, never consuming) until a byte waits in it, or EOF, or an
    error (the caller's next recv reports those), or ``clock()`` reaches ``end``
    (seconds, time.perf_counter by default). True when the socket was seen readable
    (a receive will not block). The core is yielded between polls, so a process woken
    on this core (often the peer itself) runs first."""
    one = bytearray(1)
    while True:
        try:
            sock.recv_into(one, 1, _PEEK)
            return True  # a byte is there, or EOF (0)
        except BlockingIOError:
            pass
        except OSError:
            return True
        if clock() >= end:
            return False
        os.sched_yield()


class PollBudget:
    """How long to poll for the next event of one stream of waits: an exponentially
    weighted mean of the observed waits (each clamped to twice ``max_s``: one of
    seconds says no more than "long", so the mean comes back within a few quick ones),
    and a budget of twice the mean, at most ``max_s``, or 0 (do not poll) while the mean
    is not below ``max_s`` or nothing was seen yet. Seconds throughout."""

    def __init__(self, max_s: float):
        self.max_s = max_s
        self.mean: float | None = None

    def budget(self) -> float:
        mean = self.mean
        if not self.max_s or mean is None or mean >= self.max_s:
            return 0.0
        return min(self.max_s, 2 * mean)

    def record(self, waited_s: float) -> None:
        waited_s = min(waited_s, 2 * self.max_s)
        self.mean = waited_s if self.mean is None else self.mean + (waited_s - self.mean) * _WEIGHT


class RequestGaps:
    """A server's side of one stream of requests: the gap from each answer to the next
    request, and how long polling for the next request is worth (:class:`PollBudget`
    of those gaps). ``max_s``: the longest poll, seconds (0: never poll); ``clock``:
    seconds, time.perf_counter by default. Used by the master's event loop
    (:mod:`kvpool.master.busy_poll`) and by each data connection of a node
    (:mod:`kvpool.node.data_server`)."""

    def __init__(self, max_s: float = BUSY_POLL_US / 1e6, clock=time.perf_counter):
        self.gaps = PollBudget(max_s)
        self.clock = clock
        self.answered_at: float | None = None  # the last answer's time, until a request follows it

    def budget(self) -> float:
        """Seconds to poll for the next request after an answer (0: block at once)."""
        return self.gaps.budget()

    def request(self) -> None:
        """A request arrived: fold the gap since the last answer into the mean."""
        if self.answered_at is not None:
            self.gaps.record(self.clock() - self.answered_at)
            self.answered_at = None

    def answered(self) -> float:
        """A request was answered (now, returned): the next gap starts."""
        self.answered_at = self.clock()
        return self.answered_at

    def poll(self, sock: socket.socket) -> bool:
        """Poll the blocking ``sock`` for the next request until the budget after the
        last answer is spent (:func:`poll_readable`); True when one was seen waiting."""
        budget = self.budget() if self.answered_at is not None else 0.0
        return bool(budget) and poll_readable(sock, self.answered_at + budget, self.clock)


class ReplyWait:
    """Spin-then-block waits for the replies of one connection (not thread-safe: one
    per connection, like the connection). ``max_s``: the longest poll, seconds (None:
    :func:`spin_max_s`; 0: never poll)."""

    def __init__(self, max_s: float | None = None):
        self.max_s = spin_max_s() if max_s is None else max_s
        self._kinds: dict[object, PollBudget] = {}  # kind of request -> its reply times

    def budget(self, kind) -> float:
        """Seconds to poll for a reply to a request of ``kind`` (0: block at once)."""
        found = self._kinds.get(kind)
        return 0.0 if found is None else found.budget()

    def wait(self, sock: socket.socket, kind, sent_at: float) -> bool:
        """Return once ``sock`` has a byte to read (or EOF, or an error: the caller's
        recv reports it), or once the poll budget of ``kind`` since ``sent_at``
        (time.perf_counter) is spent; the caller then receives as usual. True when the
        socket was seen readable (a receive will not block)."""
        budget = self.budget(kind)
        return bool(budget) and poll_readable(sock, sent_at + budget)

    def record(self, kind, sent_at: float) -> None:
        """A reply to a request of ``kind`` sent at ``sent_at`` (time.perf_counter) has
        been received: fold its time into the mean."""
        found = self._kinds.get(kind)
        if found is None:
            found = self._kinds[kind] = PollBudget(self.max_s)
        found.record(time.perf_counter() - sent_at)
