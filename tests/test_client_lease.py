"""The client's allocation-lease bookkeeping (kvpool.client.lease): bump placement,
64-byte alignment, retirement, and when a lease may be returned. No processes: the
lease a master would grant is made up here; the wire paths are in
test_store_alloc_leases.py."""

from __future__ import annotations

import time

from kvpool import protocol as P
from kvpool.client.lease import RETRY_S, LocalLeases

SEG = P.SegmentInfo("seg", "host", "shm", 1 << 20, "127.0.0.1:1", epoch=7)


def leases_with(lease_id: int = 1, offset: int = 4096, length: int = 1024, ttl_ms: int = 10_000) -> LocalLeases:
    leases = LocalLeases(want=64 << 20)
    leases.install(lease_id, P.ReplicaDesc(SEG, offset, length), time.monotonic(), ttl_ms)
    return leases


def test_values_take_consecutive_aligned_ranges_and_a_batch_takes_what_fits():
    leases = leases_with()
    assert leases.max_value == 512
    lease, offsets = leases.place([1, 100, 64])
    assert offsets == [4096, 4160, 4288]  # each range rounded up to 64 bytes
    _, more = leases.place([500, 200, 200])
    assert more == [4352, 4864]  # up to the lease's end exactly; the third would pass it
    assert leases.place([200]) is None
    assert lease.writing == 2


def test_no_placement_without_a_lease_or_past_its_use():
    assert LocalLeases(want=1 << 20).place([64]) is None
    leases = leases_with(ttl_ms=0)  # its use ended at once (the margin included)
    assert leases.place([64]) is None


def test_a_retired_lease_is_returned_only_once_no_write_is_in_flight():
    leases = leases_with(lease_id=1)
    first, _ = leases.place([64])
    second, _ = leases.place([64])
    leases.install(2, P.ReplicaDesc(SEG, 0, 1024), time.monotonic(), 10_000)  # retires lease 1
    assert leases.take_returns() == []
    leases.finish(first)
    assert leases.take_returns() == []
    leases.finish(second)
    assert leases.take_returns() == [1]
    assert leases.take_returns() == []


def test_a_dropped_lease_takes_no_more_values_and_close_returns_everything():
    leases = leases_with(lease_id=1)
    lease, _ = leases.place([64])
    leases.finish(lease, drop=True)  # e.g. the write met a stale mount epoch
    assert leases.current is None and leases.place([64]) is None
    assert leases.take_returns() == [1]
    leases.install(2, P.ReplicaDesc(SEG, 0, 1024), time.monotonic(), 10_000)
    leases.place([64])  # a write still in flight when the client closes
    assert leases.take_returns(everything=True) == [2]


def test_the_current_lease_retires_when_its_use_ends():
    leases = leases_with(ttl_ms=10_000)
    until = leases.retire_used_up()
    assert until is not None and until > time.monotonic()
    expired = leases_with(lease_id=5, ttl_ms=0)
    assert expired.retire_used_up() is None and expired.take_returns() == [5]


def test_a_short_grant_lowers_the_largest_leased_value_only_for_a_while():
    """A lease shorter than asked (the pool was nearly full) sends larger values the
    PutStart way, but not for ever: after RETRY_S a full lease is asked for again (a
    client once stayed on two round trips per put after its pool filled up once)."""
    now = [100.0]
    leases = LocalLeases(want=64 << 20, clock=lambda: now[0])
    assert leases.max_value == 32 << 20
    leases.install(1, P.ReplicaDesc(SEG, 0, 1 << 20), now[0], 10_000)
    assert leases.max_value == 512 << 10  # half the short grant
    now[0] += 2 * RETRY_S
    assert leases.max_value == 32 << 20  # and back
    leases.install(2, P.ReplicaDesc(SEG, 0, 64 << 20), now[0], 10_000)
    assert leases.max_value == 32 << 20
