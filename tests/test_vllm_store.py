"""The vLLM connector's GuardedStore against a real master that stops answering: vLLM's
threads (the scheduler's lookup above all) pay one timeout per outage, never one per
reconnection attempt. No vLLM needed: the store is the part of the connector that
talks to kvpool."""

from __future__ import annotations

import logging
import os
import signal
import time

from kvpool.child import pause_process
from kvpool.integrations.vllm.store import GuardedStore
from kvpool.launch import Cluster

TIMEOUT_S = 1.0


class Clock:
    """An injected monotonic clock: reconnections fall due when the test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _timed(store: GuardedStore):
    started = time.monotonic()
    result = store.call("lookup", lambda c: c.batch_is_exist(["k"]))
    return result, time.monotonic() - started


def test_a_stopped_master_costs_a_lookup_one_timeout_per_outage_not_one_per_retry():
    clock = Clock()
    with Cluster(segment_size="16MiB") as cluster:
        store = GuardedStore(cluster.master_addr, False, TIMEOUT_S, logging.getLogger("test"),
                             retry_s=30.0, clock=clock)
        try:
            assert _timed(store)[0] == [0]  # connected on first use, answers
            master = cluster.master.proc.pid
            assert pause_process(master)
            try:
                assert _timed(store)[0] is None  # the call that finds the outage waits once
                for _ in range(3):  # then each retry is due; before, each waited timeout_s
                    clock.now += 31.0
                    result, took = _timed(store)
                    assert result is None and took < TIMEOUT_S / 2, took
                    assert store.wait_reconnected(10 * TIMEOUT_S)  # the attempt fails on its thread
                    assert store.down
            finally:
                os.kill(master, signal.SIGCONT)
            clock.now += 31.0
            assert store.down  # asking starts the reconnection (all a producer asks, via saves)
            assert _timed(store)[0] is None  # lookups go on meanwhile, as misses
            assert store.wait_reconnected(10 * TIMEOUT_S)
            assert not store.down and _timed(store)[0] == [0]
        finally:
            store.close()


def test_a_reconnection_that_ends_after_close_is_discarded():
    clock = Clock()
    with Cluster(segment_size="16MiB") as cluster:
        store = GuardedStore(cluster.master_addr, False, TIMEOUT_S, logging.getLogger("test"),
                             retry_s=30.0, clock=clock)
        master = cluster.master.proc.pid
        assert pause_process(master)
        try:
            assert _timed(store)[0] is None  # down from the first connection
            clock.now += 31.0
            assert _timed(store)[0] is None  # a reconnection starts, and waits on the master
            store.close()  # the engine shuts down while the attempt is in flight
        finally:
            os.kill(master, signal.SIGCONT)  # the attempt may now succeed
        assert store.wait_reconnected(10 * TIMEOUT_S)
        assert store._client is None  # what it made was closed, not published
