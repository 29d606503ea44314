"""Many threads on one Client: every byte read back is the byte written."""

from __future__ import annotations

import os

import pytest

from kvpool.client import Client
from kvpool.errors import LeaseExpired
from proc_helpers import in_threads

THREADS, OPS, SIZE = 8, 100, 1 << 20


def _value(base: bytes, t: int, i: int) -> bytes:
    """A distinct 1 MiB value per (thread, op): a header, then shared random bytes."""
    head = f"{t}:{i}:".encode()
    return head + base[len(head):]


# a short lease: each forced remove holds its buffer until the get's lease ends
@pytest.mark.cluster(segment_size="256MiB", lease_ttl_ms=50)
@pytest.mark.parametrize("force_tcp", [False, True])
def test_8_threads_put_get_remove_1mib_byte_checked(cluster, force_tcp):
    base = os.urandom(SIZE)
    with Client(cluster.master_addr, force_tcp=force_tcp) as c:

        def worker(t: int) -> None:
            for i in range(OPS):
                key, value = f"t{t}/{i}", _value(base, t, i)
                c.put(key, value)
                while True:
                    try:
                        got = c.get(key)
                        break
                    except LeaseExpired:  # a slow copy is a miss, never wrong bytes
                        continue
                assert got == value, f"{key}: wrong bytes"
                c.remove(key, force=True)

        assert in_threads(worker, THREADS) == []
        stats = c.stats()
        assert stats.object_count == 0 and stats.in_flight_puts == 0
        # every put committed once: through the allocation lease, or PutStart/PutEnd
        assert stats.counters.get("put_commit", 0) + stats.counters.get("put_end", 0) == THREADS * OPS
