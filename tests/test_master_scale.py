"""The master's metadata at scale, in-process: compact records, the eviction order's
runs, allocation across a thousand segments, owners in heartbeat order.

Sizes are modest (CI); what is asserted is a ratio (bytes per object) or an order,
never a time. The wire-level runs are in test_bench_master.py.
"""

from __future__ import annotations

import gc
import math
import random
import tracemalloc

from kvpool import protocol as P
from kvpool.errors import ErrorCode
from kvpool.master.config import MasterConfig
from kvpool.master.objects import Replica
from kvpool.master.segments import SegmentTable
from kvpool.master.service import MasterService
from test_master_clock import FakeClock

OK = ErrorCode.OK
KEY = "kvp/{:028d}"  # 32-byte keys, as the benchmark's


def batch_put(svc: MasterService, keys: list[str], size: int = 64, **item) -> None:
    starts = svc.batch_put_start([P.PutItem(k, size, **item) for k in keys]).results
    assert all(r.code == OK for r in starts)
    codes = svc.batch_put_end([P.PutToken(k, r.put_id) for k, r in zip(keys, starts)]).codes
    assert codes == [OK] * len(keys)


def test_an_object_costs_under_300_bytes_and_no_python_object_of_its_own():
    n = 40_000
    svc = MasterService(MasterConfig(eviction_high_watermark_ratio=1.0))
    svc.mount("owner", P.SegmentInfo("seg", "host", "shm", 2 * n * 64, "127.0.0.1:1"), index=True)
    gc.collect()
    tracked = len(gc.get_objects())
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for lo in range(0, n, 1000):  # keys made here, so that their bytes count
        batch_put(svc, [KEY.format(i) for i in range(lo, lo + 1000)])
        svc.index_log.take()  # what the server sends to the node after each request
    svc.batch_get_replica_list([KEY.format(i) for i in range(1000)])  # reads in flight hold grants...
    svc.read_done(list(svc.grants.open))  # ...until done
    per_object = (tracemalloc.get_traced_memory()[0] - before) / n
    tracemalloc.stop()
    gc.collect()
    assert svc.object_count == n
    assert per_object <= 300, per_object
    assert len(gc.get_objects()) - tracked < n / 100  # no record, list or replica per object
    assert not svc.objects.grants and not svc.objects.pending and not svc.objects.more


def assert_runs_sorted(svc: MasterService) -> None:
    """Each eviction run, walked from its head, is sorted by the deadline its objects
    were linked by, and its links agree both ways."""
    t = svc.objects
    for run, head in enumerate(t.heads):
        prev, slot, last = -1, head, -math.inf
        while slot >= 0:
            assert t.run[slot] == run and t.prev[slot] == prev
            assert t.order[slot] >= last, (run, slot)
            prev, last, slot = slot, t.order[slot], t.next[slot]
        assert t.tails[run] == prev


def test_eviction_walks_objects_in_deadline_order_through_puts_reads_pins_and_restores():
    clock = FakeClock()
    svc = MasterService(MasterConfig(eviction_high_watermark_ratio=1.0, default_kv_lease_ttl_ms=5000), clock=clock)
    svc.mount("owner", P.SegmentInfo("seg", "host", "shm", 1 << 24, "127.0.0.1:1"))
    rng = random.Random(7)
    keys = [f"k{i}" for i in range(400)]
    for step in range(3000):
        clock.advance(rng.uniform(0.001, 0.05))
        key = rng.choice(keys)
        action = rng.random()
        if action < 0.05:  # a batch at one instant: its objects share one deadline
            batch_put(svc, rng.sample(keys, 8), 100, upsert=True)
        elif key not in svc.objects or action < 0.3:
            r = svc.put_start(P.PutItem(key, 100, upsert=True))
            assert r.code == OK and svc.put_end(P.PutToken(key, r.put_id)).code == OK
        elif action < 0.8:
            svc.get_replica_list(key)
        elif action < 0.9:
            svc.set_pin(key, rng.choice(["hard", "none", "soft"]))
        else:
            svc.remove(key, force=True)
        if step % 500 == 0:
            assert_runs_sorted(svc)
    assert_runs_sorted(svc)
    clock.advance(10.0)
    walked = [(o.lease_deadline, o.key) for o in svc.queue.pop_due(clock())]
    expected = sorted((o.lease_deadline, o.key) for o in svc.objects.values() if o.visible and not o.hard_pin)
    assert [d for d, _ in walked] == [d for d, _ in expected]  # every one, oldest first
    assert sorted(walked) == expected and len(svc.queue) == len(expected)


def test_a_read_moves_nothing_in_the_eviction_runs_and_the_walk_skips_what_was_read():
    clock = FakeClock()
    svc = MasterService(MasterConfig(eviction_high_watermark_ratio=1.0, default_kv_lease_ttl_ms=5000), clock=clock)
    svc.mount("owner", P.SegmentInfo("seg", "host", "shm", 1 << 24, "127.0.0.1:1"))
    keys = [f"k{i}" for i in range(10)]
    for k in keys:
        batch_put(svc, [k])
        clock.advance(0.01)
    t = svc.objects
    links = (list(t.prev), list(t.next), list(t.run))
    for _ in range(3):
        assert svc.batch_get_replica_list(keys[2:5]).results[0].code == OK
    assert (list(t.prev), list(t.next), list(t.run)) == links  # deadlines moved, links did not
    clock.advance(1.0)  # the puts' deadlines are due, the reads' are not
    walked = [o.key for o in svc.queue.pop_due(clock())]
    assert walked == keys[:2] + keys[5:]
    clock.advance(10.0)
    assert [o.key for o in svc.queue.pop_due(clock())] == keys[:2] + keys[5:] + keys[2:5]


def test_unmount_drops_exactly_the_objects_whose_replicas_were_all_there():
    svc = MasterService(MasterConfig(eviction_high_watermark_ratio=1.0))
    for name in ("a", "b", "c"):
        svc.mount(f"o-{name}", P.SegmentInfo(name, "host", "shm", 1 << 20, "127.0.0.1:1"))
    batch_put(svc, [f"one/{i}" for i in range(300)])
    batch_put(svc, [f"two/{i}" for i in range(300)], replica_num=2)
    on_a = {k for k in svc.objects if {r.segment for r in svc.objects[k].replicas} <= {"a"}}
    assert on_a and svc.unmount("o-a", "a").code == OK
    assert not on_a & set(svc.objects) and len(svc.objects) == 600 - len(on_a) == svc.object_count
    assert all(r.segment != "a" for k in svc.objects for r in svc.objects[k].replicas)
    assert all(len(svc.objects[f"two/{i}"].replicas) >= 1 for i in range(300))
    stats = svc.stats()
    replicas = sum(len(svc.objects[k].replicas) for k in svc.objects)
    assert stats.used_bytes == sum(s.used for s in stats.segments) == 64 * replicas


def test_random_placement_spreads_over_a_thousand_segments_and_fills_them_all():
    table = SegmentTable("random")
    for i in range(1000):
        table.mount(f"o{i}", P.SegmentInfo(f"s{i}", f"h{i % 10}", "", 1024, "127.0.0.1:1"), 0.0)
    first = [table.allocate(64, 1)[0].segment for _ in range(2000)]
    assert len(set(first)) > 800  # random, not the same few segments
    placed = first + [r.segment for _ in range(14_000) for r in table.allocate(64, 1)]
    assert len(placed) == 16_000 and table.used_bytes == table.total_bytes == 1000 * 1024
    assert table.allocate(64, 1) == []  # full: nothing, without error
    table.free(Replica("s1", 0, 64))
    table.free(Replica("s2", 64, 64))
    pair = table.allocate(64, 2)  # replicas on distinct segments: the only two with room
    assert sorted((r.segment, r.offset) for r in pair) == [("s1", 0), ("s2", 64)]
    assert table.used_bytes == sum(s.allocator.used for s in table.segments.values())


def test_local_first_and_free_ratio_first_still_choose_as_before():
    local = SegmentTable("local_first")
    emptiest = SegmentTable("free_ratio_first")
    for table in (local, emptiest):
        for i in range(100):
            table.mount(f"o{i}", P.SegmentInfo(f"s{i}", f"h{i % 10}", "", 1 << 16, "127.0.0.1:1"), 0.0)
    assert all(int(local.allocate(64, 1, host_id="h3")[0].segment[1:]) % 10 == 3 for _ in range(500))
    three = local.allocate(64, 12, host_id="h3")  # 10 local segments, then others
    assert len({r.segment for r in three}) == 12
    assert sum(int(r.segment[1:]) % 10 == 3 for r in three) == 10
    for _ in range(300):
        emptiest.allocate(640, 1)
    used = [s.allocator.used for s in emptiest.segments.values()]
    assert max(used) - min(used) <= 640  # always the emptiest: they fill evenly


def test_silent_owners_are_found_in_heartbeat_order():
    clock = FakeClock()
    svc = MasterService(MasterConfig(client_ttl_s=10.0), clock=clock)
    for i in range(50):
        svc.mount(f"o{i}", P.SegmentInfo(f"s{i}", "host", "", 1 << 16, "127.0.0.1:1"))
    clock.advance(6.0)
    alive = {f"o{i}" for i in range(0, 50, 3)}
    for owner in sorted(alive):
        assert svc.heartbeat(owner).code == OK
    clock.advance(6.0)
    svc.tick()
    assert set(svc.segments.last_seen) == alive
    assert {s.owner_id for s in svc.segments.segments.values()} == alive


def test_a_withheld_segment_gets_no_new_buffer_keeps_its_objects_and_is_not_evicted_for_room():
    """A segment whose node's index stream closed (stream_lost) takes no new buffer under
    any strategy, even as a preferred segment or once space is freed on it; eviction does
    not empty it to make room it could not use; a mount by its owner lifts it."""
    for strategy in ("random", "free_ratio_first", "local_first"):
        table = SegmentTable(strategy)
        for name in ("a", "b"):
            table.mount(f"o-{name}", P.SegmentInfo(name, "h", "", 1 << 12, "127.0.0.1:1"), 0.0)
        on_a = table.allocate(64, 1, host_id="h", preferred="a")[0]
        assert table.withhold("a") and not table.withhold("a")
        table.free(on_a)
        got = [table.allocate(64, 2, host_id="h", preferred="a") for _ in range(64)]
        assert all([r.segment for r in g] == ["b"] for g in got) and table.allocate(64, 1) == []
        assert table.mount("o-a", table.segments["a"].info, 0.0) is table.segments["a"]
        assert table.allocate(64, 1)[0].segment == "a"
        table.withhold("a")
        table.unmount("a")
        assert table.withheld == set()
    svc = MasterService(MasterConfig(eviction_high_watermark_ratio=1.0))
    for name in ("a", "b"):
        svc.mount(f"o-{name}", P.SegmentInfo(name, "host", "shm", 1 << 20, "127.0.0.1:1"))
    batch_put(svc, [f"old/{i}" for i in range(32)], size=64 << 10)  # both segments full
    on_a = {k for k in svc.objects if svc.objects[k].replicas[0].segment == "a"}
    svc.stream_lost("a", svc.segments.segments["a"].info.epoch)
    assert svc.stats().counters["segments_withheld"] == 1
    assert [s.withheld for s in svc.stats().segments] == [True, False]
    batch_put(svc, [f"new/{i}" for i in range(8)], size=64 << 10)  # evicts on b only
    assert on_a <= set(svc.objects)
    assert all(svc.objects[f"new/{i}"].replicas[0].segment == "b" for i in range(8))
