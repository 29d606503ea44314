"""Allocation leases in MasterService on a fake clock: grants and their bounds, what a
commit must satisfy, what a commit does (the same as PutEnd), and how a lease ends
(returned, expired, its segment unmounted, the master restarted), with used bytes
exact throughout (K07). The wire paths (a killed writer, a master restart mid-lease, a
full pool) are in test_store_alloc_leases.py."""

from __future__ import annotations

import pytest

from kvpool import protocol as P
from kvpool.errors import ErrorCode
from kvpool.master.alloc_leases import RUN_MIN
from kvpool.master.config import MasterConfig
from kvpool.master.service import MasterService
from test_master_clock import FakeClock
from test_master_clock import service as clock_service

MIB = 1 << 20
OK = ErrorCode.OK
RELEASE_S = 600.0  # MasterConfig's put_start_release_timeout_s


def service(segment_size: int = 64 * MIB, **config) -> tuple[MasterService, FakeClock]:
    """A master on a fake clock with one segment "seg" of owner "owner" (64 MiB)."""
    return clock_service(segment_size, **config)


def lease(svc: MasterService, owner: str = "c1", size: int = 64 * MIB) -> P.AllocLeaseResp:
    reply = svc.alloc_lease(owner, size)
    assert reply.code == OK
    return reply


def commit(svc: MasterService, grant: P.AllocLeaseResp, key: str, at: int, size: int = 1000,
           owner: str = "c1", **options) -> ErrorCode:
    """Commit ``size`` bytes of ``key`` at ``at`` bytes past the lease's start."""
    item = P.CommitItem(key, grant.region.offset + at, size, **options)
    [code] = svc.put_commit(owner, grant.lease_id, [item]).codes
    return code


def tick(svc: MasterService) -> None:
    """A tick with the node alive (it heartbeats while the clock jumps)."""
    assert svc.heartbeat("owner").code == OK
    svc.tick()


def visible(svc: MasterService, key: str) -> bool:
    obj = svc.lookup(key)
    return obj is not None and obj.visible


def test_a_lease_is_bounded_and_counted_as_used_bytes():
    svc, _ = service(64 * MIB)
    grant = lease(svc, size=1 << 40)
    assert grant.region.length == 4 * MIB  # 1/16 of the segment
    assert grant.region.offset % 64 == 0 and grant.ttl_ms == 10_000
    assert grant.region.segment.epoch == svc.segments.segments["seg"].info.epoch
    stats = svc.stats()
    assert (stats.used_bytes, stats.leased_bytes, stats.open_leases) == (4 * MIB, 4 * MIB, 1)
    small, _ = service(1 << 30, alloc_lease_size=MIB)
    assert lease(small).region.length == MIB  # the configured size binds first
    assert lease(small, "c2", size=1000).region.length == 960  # what was asked, aligned down


def test_leases_are_refused_without_room_per_owner_beyond_the_limit_and_when_off():
    svc, _ = service(64 * MIB, max_leases_per_owner=2)
    lease(svc)
    lease(svc)
    assert svc.alloc_lease("c1", MIB).code == ErrorCode.NO_AVAILABLE_HANDLE
    assert svc.alloc_lease("c2", MIB).code == OK
    assert svc.alloc_lease("", MIB).code == ErrorCode.INVALID_PARAMS
    off, _ = service(alloc_lease_size=0)
    assert off.alloc_lease("c1", MIB).code == ErrorCode.NO_AVAILABLE_HANDLE
    # a lease never evicts and never takes used bytes above the high watermark: near it,
    # a lease is as short as the room left (a full cache's steady state), then refused
    full, _ = service(16 * MIB)
    for i in range(14):
        assert full.put_start(P.PutItem(f"f{i}", MIB)).code == OK
    room = int(0.9 * 16 * MIB) - 14 * MIB
    short = full.alloc_lease("c1", MIB)
    assert short.code == OK and short.region.length == room - room % 64
    assert full.alloc_lease("c1", MIB).code == ErrorCode.NO_AVAILABLE_HANDLE
    assert full.stats().used_bytes == 14 * MIB + short.region.length
    assert full.counters["evicted_objects"] == 0


def test_an_object_is_invisible_until_committed_and_then_is_one_complete_replica():
    svc, _ = service()
    grant = lease(svc)
    assert not visible(svc, "k") and svc.get_replica_list("k").code == ErrorCode.OBJECT_NOT_FOUND
    assert commit(svc, grant, "k", 0, 1000, soft_pin=P.SOFT_PIN_ENABLE, soft_pin_ttl_ms=5000) == OK
    reply = svc.get_replica_list("k")
    assert reply.code == OK and reply.size == 1000
    [replica] = reply.replicas
    assert (replica.segment.name, replica.offset, replica.length) == ("seg", grant.region.offset, 1000)
    obj = svc.lookup("k")
    assert obj.version > 0 and obj.soft_pin_deadline > 0
    assert svc.stats().object_count == 1
    assert svc.stats().leased_bytes == 4 * MIB - 1024  # the committed range left the lease


@pytest.mark.parametrize("case", ["outside", "past the end", "misaligned", "overlapping", "another owner",
                                  "unknown lease", "zero size"])
def test_a_bad_commit_is_refused_and_nothing_becomes_visible(case):
    svc, _ = service()
    grant = lease(svc)
    length = grant.region.length
    assert commit(svc, grant, "first", 0, 1000) == OK
    before = svc.stats()
    at, size, owner, lease_id = {
        "outside": (-64, 64, "c1", grant.lease_id),
        "past the end": (length - 64, 65, "c1", grant.lease_id),
        "misaligned": (1032, 100, "c1", grant.lease_id),
        "overlapping": (960, 100, "c1", grant.lease_id),
        "another owner": (1024, 100, "c2", grant.lease_id),
        "unknown lease": (1024, 100, "c1", grant.lease_id + 1),
        "zero size": (1024, 0, "c1", grant.lease_id),
    }[case]
    item = P.CommitItem("bad", grant.region.offset + at, size)
    [code] = svc.put_commit(owner, lease_id, [item]).codes
    assert code != OK
    assert not visible(svc, "bad")
    after = svc.stats()
    assert (after.used_bytes, after.leased_bytes, after.object_count) == (
        before.used_bytes, before.leased_bytes, before.object_count)


def test_a_range_committed_and_freed_since_is_never_committed_again():
    svc, _ = service()
    grant = lease(svc)
    assert commit(svc, grant, "gone", 0, 1000) == OK
    assert svc.remove("gone").code == OK  # its range is free: it may belong to another now
    assert commit(svc, grant, "again", 0, 1000) == ErrorCode.INVALID_PARAMS
    assert commit(svc, grant, "inside", 512, 64) == ErrorCode.INVALID_PARAMS
    assert commit(svc, grant, "next", 1024, 64) == OK
    assert not visible(svc, "again") and not visible(svc, "inside")


def test_a_commit_sent_again_answers_ok_for_what_it_applied_and_changes_nothing():
    """A client resends a commit whose reply was lost: each item this incarnation applied
    the first time is OK again, whatever came after (the key upserted or removed, the
    lease returned), and nothing is applied twice. An item refused the first time, another
    key on a committed range, or a range through another lease is refused as before."""
    from kvpool.master.service import ENDED_PUTS_KEPT
    svc, _ = service()
    grant, other = lease(svc), lease(svc, "c2")
    at = grant.region.offset
    items = [P.CommitItem("a", at, 1000), P.CommitItem("b", at + 1024, 64),
             P.CommitItem("bad", at + 1000, 64)]  # misaligned: refused
    assert svc.put_commit("c1", grant.lease_id, items).codes == [OK, OK, ErrorCode.INVALID_PARAMS]
    before = svc.stats()
    version = svc.lookup("a").version
    assert svc.put_commit("c1", grant.lease_id, items).codes == [OK, OK, ErrorCode.INVALID_PARAMS]
    after = svc.stats()
    assert (after.used_bytes, after.leased_bytes, after.object_count) == (
        before.used_bytes, before.leased_bytes, before.object_count)
    assert svc.lookup("a").version == version  # not committed twice
    assert (svc.counters["put_commit"], svc.counters["commits_repeated"]) == (2, 2)
    assert commit(svc, grant, "c", 0, 1000) == ErrorCode.INVALID_PARAMS  # another key on a's range
    assert commit(svc, grant, "a", 0, 960) == ErrorCode.INVALID_PARAMS  # not the item committed
    assert commit(svc, other, "a", at - other.region.offset, 1000, owner="c2") == ErrorCode.INVALID_PARAMS
    assert commit(svc, other, "a", 0, 1000, owner="c2", upsert=True) == OK  # a moved on
    assert svc.remove("b").code == OK
    assert svc.put_commit("c1", grant.lease_id, items[:2]).codes == [OK, OK]  # applied, then changed
    assert svc.lookup("a").version != version and not visible(svc, "b")
    assert svc.return_lease("c1", [grant.lease_id]).count == 1
    assert svc.put_commit("c1", grant.lease_id, items + [P.CommitItem("new", at + 2048, 64)]).codes == [
        OK, OK, ErrorCode.LEASE_EXPIRED, ErrorCode.LEASE_EXPIRED]
    assert not visible(svc, "bad") and not visible(svc, "c") and not visible(svc, "new")
    third = lease(svc, "c3")
    for i in range(ENDED_PUTS_KEPT):  # remembered: the last ENDED_PUTS_KEPT commits only
        assert commit(svc, third, f"m{i}", 64 * i, 64, owner="c3") == OK
    assert svc.put_commit("c1", grant.lease_id, items[:1]).codes == [ErrorCode.LEASE_EXPIRED]


def test_a_commit_checks_the_key_as_put_start_does():
    svc, _ = service()
    grant = lease(svc)
    assert svc.put_start(P.PutItem("taken", 100)).code == OK and svc.lookup("taken").pending is not None
    assert commit(svc, grant, "taken", 0) == ErrorCode.OBJECT_ALREADY_EXISTS
    assert commit(svc, grant, "taken", 0, upsert=True) == ErrorCode.REPLICA_IS_NOT_READY
    assert commit(svc, grant, "", 0) == ErrorCode.INVALID_PARAMS
    assert commit(svc, grant, "k", 0, soft_pin=P.SOFT_PIN_DISABLE, soft_pin_ttl_ms=5) == ErrorCode.INVALID_PARAMS
    assert commit(svc, grant, "k", 0) == OK
    assert commit(svc, grant, "k", 1024) == ErrorCode.OBJECT_ALREADY_EXISTS
    assert svc.put_start(P.PutItem("k", 100)).code == ErrorCode.OBJECT_ALREADY_EXISTS


def test_an_upsert_commit_retires_the_old_version_like_put_end():
    svc, _ = service()
    grant = lease(svc)
    assert commit(svc, grant, "k", 0, 1000) == OK
    v1 = svc.lookup("k").version
    held = svc.get_replica_list("k")  # a read in flight on the first version
    assert commit(svc, grant, "k", 1024, 2000, upsert=True) == OK
    obj = svc.lookup("k")
    assert obj.size == 2000 and obj.version > v1 and obj.replicas[0].offset == grant.region.offset + 1024
    assert svc.stats().zombie_buffers == 1  # the old range waits for that read
    svc.read_done([held.grant_id])
    assert svc.stats().zombie_buffers == 0
    assert svc.return_lease("c1", [grant.lease_id]).count == 1
    assert svc.stats().used_bytes == 2048  # only the new version


def test_a_batch_commit_gives_one_code_per_item():
    svc, _ = service()
    grant = lease(svc)
    base = grant.region.offset
    items = [P.CommitItem("a", base, 100), P.CommitItem("b", base + 128, 100), P.CommitItem("a", base + 256, 10),
             P.CommitItem("c", base + 64, 10)]
    assert svc.put_commit("c1", grant.lease_id, items).codes == [
        OK, OK, ErrorCode.OBJECT_ALREADY_EXISTS, ErrorCode.INVALID_PARAMS]
    assert svc.counters["put_commit"] == 2


def test_k07_returned_leases_and_removed_objects_bring_used_bytes_to_exactly_zero():
    svc, _ = service()
    grants = [lease(svc), lease(svc, "c2")]
    for n, grant in enumerate(grants):
        for i in range(10):
            assert commit(svc, grant, f"{n}/{i}", 4096 * i + 64 * (i % 3), 1000 + i, owner=f"c{n + 1}") == OK
    assert svc.return_lease("c1", [grants[1].lease_id]).count == 0  # not c1's
    assert svc.return_lease("c1", [grants[0].lease_id]).count == 1
    assert svc.return_lease("c2", [grants[1].lease_id, grants[1].lease_id, 12345]).count == 1
    stats = svc.stats()
    assert stats.open_leases == 0 and stats.leased_bytes == 0 and stats.used_bytes == 20 * 1024
    assert svc.batch_remove([f"{n}/{i}" for n in range(2) for i in range(10)]).codes == [OK] * 20
    stats = svc.stats()
    assert stats.used_bytes == 0 and all(s.used == 0 for s in stats.segments)


def test_k04_an_expired_lease_refuses_commits_and_holds_its_gaps_until_the_release_timeout():
    """A writer killed (or paused) mid-lease: its uncommitted space is not reused until
    the lease's deadline plus the release timeout, and then is, exactly."""
    svc, clock = service()
    grant = lease(svc)
    assert commit(svc, grant, "done", 0, 1000) == OK
    clock.advance(10.0)  # the deadline: no tick yet, the lease is still refused
    assert commit(svc, grant, "late", 1024) == ErrorCode.LEASE_EXPIRED
    tick(svc)
    stats = svc.stats()
    assert stats.open_leases == 0 and stats.leased_bytes == 0
    assert stats.used_bytes == 4 * MIB and stats.zombie_bytes == 4 * MIB - 1024  # held, not freed
    assert commit(svc, grant, "later", 2048) == ErrorCode.LEASE_EXPIRED
    clock.advance(RELEASE_S - 0.001)
    tick(svc)
    assert svc.stats().used_bytes == 4 * MIB  # never before the release timeout
    clock.advance(0.002)
    tick(svc)
    stats = svc.stats()
    assert stats.used_bytes == 1024 and stats.zombie_bytes == 0
    assert svc.get_replica_list("done").code == OK and not visible(svc, "late")
    assert svc.remove("done", force=True).code == OK
    clock.advance(30.0)
    tick(svc)
    assert svc.stats().used_bytes == 0


def test_committed_objects_are_evicted_on_their_own_while_the_lease_stays_whole():
    svc, clock = service(16 * MIB, eviction_high_watermark_ratio=1.0)
    grant = lease(svc)  # 1 MiB, not evictable
    assert commit(svc, grant, "in-lease", 0, 1000) == OK
    for i in range(15):
        assert svc.put_start(P.PutItem(f"f{i}", MIB)).code == OK
        assert svc.put_end(P.PutToken(f"f{i}", svc.lookup(f"f{i}").pending.put_id)).code == OK
    clock.advance(1.0)
    # the pool is full: a put evicts objects (the committed one among them), never the lease
    assert svc.put_start(P.PutItem("new", MIB)).code == OK
    assert svc.counters["evicted_objects"] >= 1
    stats = svc.stats()
    assert stats.leased_bytes == MIB - 1024 and stats.open_leases == 1
    assert commit(svc, grant, "after", 1024, 1000) == OK  # the lease is still good
    assert svc.stats().used_bytes <= 16 * MIB


def test_unmounting_the_segment_drops_its_leases():
    svc, _ = service()
    grant = lease(svc)
    assert commit(svc, grant, "k", 0) == OK
    assert svc.unmount("owner", "seg").code == OK
    stats = svc.stats()
    assert (stats.open_leases, stats.leased_bytes, stats.used_bytes, stats.object_count) == (0, 0, 0, 0)
    assert commit(svc, grant, "k2", 1024) == ErrorCode.LEASE_EXPIRED
    assert svc.mount("owner", P.SegmentInfo("seg", "host", "shm", 64 * MIB, "127.0.0.1:1")).code == OK
    assert svc.alloc_lease("c1", MIB).code == OK  # the owner's count went with them


def test_a_new_master_knows_no_lease_of_the_old_one():
    old, _ = service()
    grant = lease(old)
    new, _ = service()  # a restart: another incarnation, the segment mounted again
    assert new.alloc_lease("c1", MIB).lease_id != grant.lease_id
    [code] = new.put_commit("c1", grant.lease_id, [P.CommitItem("k", grant.region.offset, 100)]).codes
    assert code == ErrorCode.LEASE_EXPIRED and not visible(new, "k")


def test_a_commit_on_an_indexed_segment_is_told_to_its_node():
    svc = MasterService(MasterConfig(), clock=FakeClock())
    assert svc.mount("owner", P.SegmentInfo("seg", "host", "shm", 64 * MIB, "127.0.0.1:1"), index=True).code == OK
    grant = lease(svc)
    assert commit(svc, grant, "k", 0, 100) == OK
    [update] = svc.index_log.take()
    assert [(e.key, e.offset, e.size) for e in update.adds] == [("k", grant.region.offset, 100)]


def _record(svc: MasterService, key: str) -> tuple:
    obj = svc.lookup(key)
    return (obj.visible, obj.size, [(r.segment, r.length) for r in obj.replicas], obj.hard_pin,
            obj.soft_pin_deadline, obj.lease_deadline, obj.version > 0)


@pytest.mark.parametrize("pins", [{}, {"hard_pin": True},
                                  {"soft_pin": P.SOFT_PIN_ENABLE, "soft_pin_ttl_ms": 5000},
                                  {"soft_pin": P.SOFT_PIN_DISABLE}])
def test_a_new_keys_commit_makes_the_same_record_as_put_end(pins):
    """A commit of a key with no record builds it in one step (the common put): the same
    record, eviction order and object count as the PutStart/PutEnd way, also in a slot
    freed by a removal (its links were reset then)."""
    svc, _ = service()
    grant = lease(svc)
    svc.remove("nobody")  # nothing to free; then a slot freed for real:
    assert commit(svc, grant, "gone", 0, 1000) == OK and svc.remove("gone", force=True).code == OK
    assert commit(svc, grant, "leased", 1024, 1000, **pins) == OK
    item = P.PutItem("started", 1000, **pins)
    started = svc.put_start(item)
    assert svc.put_end(P.PutToken("started", started.put_id)).code == OK
    assert _record(svc, "leased")[:5] == _record(svc, "started")[:5]
    in_order = {obj.key for obj in svc.queue.pop_due(float("inf"))}
    assert ("leased" in in_order) == ("started" in in_order) == (not pins.get("hard_pin"))
    assert svc.stats().object_count == 2


def _indexed_service() -> tuple[MasterService, P.AllocLeaseResp]:
    """A master on a fake clock with one indexed segment "seg" (its node keeps an
    index), a lease of client "c1" on it, and one key removed before (its slot free)."""
    svc = MasterService(MasterConfig(), clock=FakeClock())
    assert svc.mount("owner", P.SegmentInfo("seg", "host", "shm", 64 * MIB, "127.0.0.1:1"), index=True).code == OK
    grant = lease(svc)
    assert commit(svc, grant, "gone", 0, 64) == OK and svc.remove("gone", force=True).code == OK
    svc.index_log.take()
    return svc, grant


def _state(svc: MasterService, keys: list[str]) -> tuple:
    """Everything a commit changes, comparable between two masters: records, counts,
    the lease's claims and used bytes, the index entries sent (versions by rank), and
    the eviction order."""
    entries = [e for update in svc.index_log.take() for e in update.adds]
    ranks = {v: i for i, v in enumerate(sorted(e.version for e in entries))}
    [lease_] = svc.alloc_leases.open.values()
    stats = svc.stats()
    return ([_record(svc, k) for k in keys], svc.object_count, lease_.committed, stats.used_bytes,
            stats.leased_bytes, sorted((e.key, e.offset, e.size, ranks[e.version]) for e in entries),
            [obj.key for obj in svc.queue.pop_due(float("inf"))])


def test_a_batch_of_new_keys_commits_in_one_pass_to_the_same_state_as_item_by_item():
    """A client's batch as its lease placed it (new keys, no pin, values back to back)
    takes the one-pass commit: the same records, claims, used bytes, index entries
    (versions in item order), eviction order and object count as the same items
    committed one by one, a freed slot reused first; a resend answers OK for each and
    changes nothing."""
    keys = [f"k{i}" for i in range(5)]  # at least RUN_MIN
    sizes = [100, 64, 4096, 1, 1000]
    at = [64]
    for size in sizes[:-1]:
        at.append(at[-1] + -(-size // 64) * 64)
    one_pass, grant = _indexed_service()
    items = [P.CommitItem(k, grant.region.offset + a, n) for k, a, n in zip(keys, at, sizes)]
    one_pass._commit_item = None  # not called: the one-pass way took every item
    assert one_pass.put_commit("c1", grant.lease_id, items).codes == [OK] * 5
    del one_pass._commit_item
    by_item, grant_b = _indexed_service()
    assert grant_b.region.offset == grant.region.offset
    for k, a, n in zip(keys, at, sizes):
        assert commit(by_item, grant_b, k, a, n) == OK
    assert _state(one_pass, keys) == _state(by_item, keys)
    versions = [one_pass.lookup(k).version for k in keys]
    assert versions == sorted(set(versions))  # distinct, in item order
    assert one_pass.put_commit("c1", grant.lease_id, items).codes == [OK] * 5  # a resend
    assert one_pass.counters["commits_repeated"] == 5 and one_pass.object_count == 5


@pytest.mark.parametrize("case", ["key twice", "key known", "gap", "soft pin", "hard pin", "overlap",
                                  "bad key", "empty value"])
def test_a_batch_the_one_pass_commit_does_not_fit_is_decided_item_by_item(case):
    """Any item that is not a new, unpinned key back to back with the previous one sends
    the whole batch the item-by-item way, with nothing half applied: each item gets the
    code it gets alone (here the third of five is the odd one)."""
    svc, grant = _indexed_service()
    base = grant.region.offset
    assert commit(svc, grant, "known", 1024, 64) == OK  # committed before, at +1024
    keys, at, sizes = ["a", "b", "c", "d", "e"], [64, 128, 192, 256, 320], [64] * 5
    assert len(keys) >= RUN_MIN
    options: dict = {}
    if case == "key twice":
        keys[2] = "a"
    elif case == "key known":
        keys[2] = "known"
    elif case == "gap":
        at[2] = 2048
    elif case == "soft pin":
        options = {"soft_pin": P.SOFT_PIN_ENABLE, "soft_pin_ttl_ms": 1000}
    elif case == "hard pin":
        options = {"hard_pin": True}
    elif case == "overlap":
        at[2] = 1024  # "known"'s range
    elif case == "bad key":
        keys[2] = "x" * (P.MAX_KEY_BYTES + 1)
    elif case == "empty value":
        sizes[2] = 0
    items = [P.CommitItem(k, base + a, n, **(options if i == 2 else {}))
             for i, (k, a, n) in enumerate(zip(keys, at, sizes))]
    codes = svc.put_commit("c1", grant.lease_id, items).codes
    odd = {"key twice": ErrorCode.OBJECT_ALREADY_EXISTS, "key known": ErrorCode.OBJECT_ALREADY_EXISTS,
           "overlap": ErrorCode.INVALID_PARAMS, "bad key": ErrorCode.INVALID_PARAMS,
           "empty value": ErrorCode.INVALID_PARAMS}.get(case, OK)
    assert codes == [OK, OK, odd, OK, OK]
    assert svc.object_count == 1 + 4 + (odd == OK)  # "known" too
    if case == "hard pin":
        assert svc.lookup("c").hard_pin
    if case == "soft pin":
        assert svc.lookup("c").soft_pin_deadline > 0
