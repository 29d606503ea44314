"""Eviction: futile puts evict nothing, order by lease deadline, pins, watermark."""

from __future__ import annotations

import time

import pytest

from kvpool.client import Client
from kvpool.errors import NoSpace

MiB = 1 << 20
NO_WATERMARK = ["--eviction-high-watermark-ratio", "1.0"]


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


@pytest.mark.cluster(segment_size="64MiB", extra_master_args=NO_WATERMARK)
def test_k10_futile_put_fails_at_once_and_evicts_nothing(cluster):
    with Client(cluster.master_addr) as c:
        keys = [f"live/{i}" for i in range(64)]
        c.batch_put(keys, [b"L" * MiB] * 64)  # the segment is full
        assert c.stats().object_count == 64
        with pytest.raises(NoSpace):
            c.put("huge", b"H" * (80 * MiB))
        stats = c.stats()
        assert stats.object_count == 64 and stats.counters.get("evicted_objects", 0) == 0
        assert c.put("two", b"2" * 100, replica_num=2) == 1  # one segment: best effort, reported


@pytest.mark.cluster(segment_size="8MiB", lease_ttl_ms=10_000, extra_master_args=NO_WATERMARK)
def test_k10_leased_objects_are_not_evicted_for_a_put(cluster):
    with Client(cluster.master_addr) as c:
        keys = [f"k{i}" for i in range(8)]
        c.batch_put(keys, [b"x" * MiB] * 8)
        c.batch_get(keys)  # every object leased for 10 s
        with pytest.raises(NoSpace):
            c.put("new", b"n" * MiB)
        assert c.stats().object_count == 8


@pytest.mark.cluster(segment_size="8MiB", lease_ttl_ms=300, extra_master_args=NO_WATERMARK)
def test_failed_allocation_evicts_by_lease_deadline_then_soft_pins_never_hard(cluster):
    with Client(cluster.master_addr) as c:
        c.batch_put(["hard0", "hard1"], [b"h" * MiB] * 2, hard_pin=True)
        c.batch_put(["soft0", "soft1"], [b"s" * MiB] * 2, soft_pin=True)
        for i in range(4):
            c.put(f"plain{i}", b"p" * MiB)
        c.put("x", b"x" * MiB)  # full: evicts the oldest unpinned object
        assert c.batch_is_exist(["plain0", "plain1", "soft0", "soft1", "hard0"]) == [False, True, True, True, True]
        handle = c.query("plain1")  # a read moves plain1's lease deadline past the others
        wait_for(lambda: time.monotonic() > handle.deadline + 0.05, what="lease expiry")
        c.put("y", b"y" * MiB)
        assert c.batch_is_exist(["plain1", "plain2"]) == [True, False]
        wait_for(lambda: time.monotonic() > handle.deadline + 0.6, what="is_exist leases to expire")
        c.put("big", b"B" * (5 * MiB))  # needs every unpinned object, then the soft pins
        assert c.batch_is_exist(["hard0", "hard1", "soft0", "soft1", "plain1", "big"]) == [
            True, True, False, False, False, True]
        with pytest.raises(NoSpace):  # only hard-pinned and leased objects are left
            c.put("more", b"m" * (5 * MiB))


@pytest.mark.cluster(segment_size="16MiB", extra_master_args=[
    "--eviction-high-watermark-ratio", "0.5", "--eviction-ratio", "0.25"])
def test_watermark_eviction_brings_usage_down_and_keeps_hard_pins(cluster):
    with Client(cluster.master_addr) as c:
        c.put("keep", b"k" * MiB, hard_pin=True)
        for i in range(12):
            c.put(f"fill{i}", b"f" * MiB)
        stats = c.stats()
        wait_for(lambda: c.stats().used_bytes <= stats.total_bytes * 0.5, what="watermark eviction")
        assert c.stats().counters["evicted_objects"] >= 5
        assert c.get("keep") == b"k" * MiB
        assert not c.is_exist("fill0")  # the oldest went first


@pytest.mark.cluster(segment_size="4MiB", extra_master_args=NO_WATERMARK)
def test_pin_modes_can_be_set_after_put(cluster):
    with Client(cluster.master_addr) as c:
        c.batch_put(["a", "b", "c", "d"], [b"z" * MiB] * 4)
        c.pin("a", "hard")
        c.pin("b", "soft")
        c.put("e", b"e" * MiB)
        assert c.batch_is_exist(["a", "b", "c", "d"]) == [True, True, False, True]
        c.pin("a", "none")


@pytest.mark.cluster(segment_size="2MiB", lease_ttl_ms=200,
                     extra_master_args=NO_WATERMARK + ["--soft-pin-ttl", "400"])
def test_soft_pin_protects_until_its_fixed_deadline_only(cluster):
    with Client(cluster.master_addr) as c:
        c.put("soft", b"s" * MiB, soft_pin=True)
        pinned_until = time.monotonic() + 0.4
        c.put("plain", b"p" * MiB)
        c.put("c", b"c" * MiB)  # soft is older, but pinned: plain goes
        assert time.monotonic() < pinned_until, "machine too slow for this timing"
        # (reads would grant leases and move deadlines: check without reading soft)
        assert not c.is_exist("plain") and c.stats().object_count == 2
        wait_for(lambda: time.monotonic() > pinned_until + 0.1, what="soft pin to run out")
        c.put("d", b"d" * MiB)  # the pin has run out: soft is now the oldest, it goes
        assert c.batch_is_exist(["soft", "c", "d"]) == [False, True, True]


@pytest.mark.cluster(segment_size="2MiB", extra_master_args=NO_WATERMARK)
def test_upsert_on_a_full_segment_may_evict_its_own_old_value(cluster):
    with Client(cluster.master_addr) as c:
        c.put("u", b"1" * MiB)
        c.put("other", b"o" * MiB)
        c.upsert("u", b"2" * MiB)  # evicts the oldest: u's own old value
        assert c.get("u") == b"2" * MiB
        stats = c.stats()
        assert stats.in_flight_puts == 0 and stats.used_bytes == 2 * MiB
