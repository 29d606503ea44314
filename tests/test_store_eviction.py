"""Eviction over the wire: futile puts evict nothing, leases and pins protect, watermark.
Eviction order by lease deadline and soft-pin deadlines are stepped through on a fake
clock in test_master_clock.py."""

from __future__ import annotations


import pytest

from kvpool.client import Client
from kvpool.errors import NoSpace
from proc_helpers import wait_for

MiB = 1 << 20
NO_WATERMARK = ["--eviction-high-watermark-ratio", "1.0"]


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


@pytest.mark.cluster(segment_size="2MiB", extra_master_args=NO_WATERMARK)
def test_upsert_on_a_full_segment_may_evict_its_own_old_value(cluster):
    with Client(cluster.master_addr) as c:
        c.put("u", b"1" * MiB)
        c.put("other", b"o" * MiB)
        c.upsert("u", b"2" * MiB)  # evicts the oldest: u's own old value
        assert c.get("u") == b"2" * MiB
        stats = c.stats()
        assert stats.in_flight_puts == 0 and stats.used_bytes == 2 * MiB
