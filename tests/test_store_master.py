"""MasterService in-process at scale: eviction order and cost, bounded metadata."""

from __future__ import annotations

from kvpool import protocol as P
from kvpool.errors import ErrorCode
from kvpool.master.config import MasterConfig
from kvpool.master.service import MasterService

N, SIZE = 20_000, 4096


def full_service(**config) -> MasterService:
    svc = MasterService(MasterConfig(eviction_high_watermark_ratio=1.0, **config))
    svc.mount("owner", P.SegmentInfo("seg", "host", "shm", N * SIZE, "127.0.0.1:1"))
    for i in range(N):
        put(svc, f"k{i}")
    return svc


def put(svc: MasterService, key: str, size: int = SIZE) -> int:
    r = svc.put_start(P.PutItem(key, size))
    if r.code == ErrorCode.OK:
        assert svc.put_end(P.PutToken(key, r.put_id)).code == ErrorCode.OK
    return r.code


def test_put_into_a_full_pool_evicts_exactly_the_oldest_object():
    svc = full_service()
    assert svc.stats().used_bytes == N * SIZE
    for i in range(100):
        svc.get_replica_list(f"k{i}")  # leased: skipped, and now the newest
    assert put(svc, "new") == ErrorCode.OK
    assert "k100" not in svc.objects and "k0" in svc.objects
    assert len(svc.objects) == N and svc.counters["evicted_objects"] == 1


def test_futile_put_evicts_nothing_even_with_many_objects():
    svc = full_service()
    assert put(svc, "huge", N * SIZE + 1) == ErrorCode.NO_AVAILABLE_HANDLE
    for i in range(N):  # every object leased: nothing may go
        svc.get_replica_list(f"k{i}")
    assert put(svc, "new") == ErrorCode.NO_AVAILABLE_HANDLE
    assert len(svc.objects) == N and svc.counters.get("evicted_objects", 0) == 0


def test_eviction_pass_frees_the_ratio_in_bounded_steps():
    svc = full_service(eviction_ratio=0.25)
    evicted = svc.evict_pass(limit=1000)
    assert evicted == 1000 and svc.wants_eviction  # the rest of the 25% comes next tick
    while svc.wants_eviction:
        evicted += svc.evict_pass(limit=1000)
    assert evicted == N // 4
    assert "k0" not in svc.objects and f"k{N // 4 - 1}" not in svc.objects and f"k{N // 4}" in svc.objects


def test_eviction_order_metadata_stays_bounded_under_many_reads():
    svc = full_service()
    for _ in range(5):
        for i in range(N):
            svc.get_replica_list(f"k{i}")  # each grant moves the deadline: a new heap entry
    assert len(svc.queue) <= 2 * len(svc.objects) + 1024
