"""MasterService in-process on a fake clock: leases, read grants, zombies, put discard and
release timeouts, soft pins and eviction order, owner expiry.

The service is the real one (the state machine every master RPC runs); only its clock is
ours, so deadlines are crossed by advancing the clock, not by sleeping, and the tests
mean the same on a loaded machine. The wire paths of the same cases (a killed writer
process, a killed reader, a forced removal over the network) are in test_store_faults.py
and test_store_semantics.py.
"""

from __future__ import annotations

import random

from kvpool import protocol as P
from kvpool.errors import ErrorCode
from kvpool.master.config import MasterConfig
from kvpool.master.service import MasterService

MIB = 1 << 20
OK, NOT_FOUND, HAS_LEASE = ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND, ErrorCode.OBJECT_HAS_LEASE


class FakeClock:
    """Seconds that move only when told: ``clock()`` reads, ``advance(s)`` moves."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def service(segment_size: int = 8 * MIB, **config) -> tuple[MasterService, FakeClock]:
    clock = FakeClock()
    svc = MasterService(MasterConfig(**config), clock=clock)
    assert svc.mount("owner", P.SegmentInfo("seg", "host", "shm", segment_size, "127.0.0.1:1")).code == OK
    return svc, clock


def put(svc: MasterService, key: str, size: int = 1000, **item) -> int:
    r = svc.put_start(P.PutItem(key, size, **item))
    if r.code == OK:
        assert svc.put_end(P.PutToken(key, r.put_id)).code == OK
    return r.code


def exist(svc: MasterService, keys: list[str]) -> list[bool]:
    """Like Client.batch_is_exist: every found object is leased."""
    return [c == OK for c in svc.batch_exist_key(keys).codes]


def scanned(svc: MasterService) -> tuple[int, int, int]:
    """(visible objects, zombie buffers, zombie bytes) counted the slow way."""
    zombies = list(svc.grants.zombies)
    return (sum(o.visible for o in svc.objects.values()), sum(len(z.replicas) for z in zombies),
            sum(svc.segments.rounded(r.length) for z in zombies for r in z.replicas))


def counted(svc: MasterService) -> tuple[int, int, int]:
    s = svc.stats()
    return s.object_count, s.zombie_buffers, s.zombie_bytes


def test_k04_dead_writer_is_not_found_then_taken_over_and_its_space_freed():
    svc, clock = service(put_start_discard_timeout_s=0.5, put_start_release_timeout_s=3.0)
    dead = svc.put_start(P.PutItem("victim", MIB))  # the writer dies before PutEnd
    assert dead.code == OK
    assert svc.get_replica_list("victim").code == NOT_FOUND
    assert exist(svc, ["victim"]) == [False]
    clock.advance(0.4)  # the writer may still be alive: not yet
    assert put(svc, "victim") == ErrorCode.OBJECT_ALREADY_EXISTS
    assert put(svc, "victim", upsert=True) == ErrorCode.REPLICA_IS_NOT_READY
    clock.advance(0.2)  # past the discard timeout: taken over
    assert put(svc, "victim") == OK
    assert svc.get_replica_list("victim").size == 1000
    stats = svc.stats()
    assert stats.used_bytes == MIB + 1024  # dead writer's buffer still held
    assert (stats.zombie_buffers, stats.zombie_bytes) == (1, MIB)
    clock.advance(3.0 - 0.6 - 0.01)
    svc.tick()
    assert svc.stats().used_bytes == MIB + 1024  # not before the release timeout
    clock.advance(0.02)
    svc.tick()
    assert svc.stats().used_bytes == 1024 and svc.stats().zombie_buffers == 0
    assert svc.put_end(P.PutToken("victim", dead.put_id)).code == ErrorCode.INVALID_WRITE
    assert svc.get_replica_list("victim").size == 1000
    assert svc.counters["put_discarded"] == 1


def test_a_resent_put_end_is_answered_ok_while_remembered_and_never_for_another_put():
    """A PutEnd resent after its reply was lost (the channel resends an idempotent
    request on a new connection) found the put ended and answered "no such put": the
    client then put the value again, and a put raised ObjectAlreadyExists for its own
    stored value (a batch item read INVALID_WRITE)."""
    from kvpool.master.service import ENDED_PUTS_KEPT
    svc, _ = service(segment_size=64 * MIB)
    first = svc.put_start(P.PutItem("k", 1000))
    assert svc.put_end(P.PutToken("k", first.put_id)).code == OK
    assert svc.put_end(P.PutToken("k", first.put_id)).code == OK  # the resend
    assert svc.put_end(P.PutToken("other", first.put_id)).code == NOT_FOUND  # not another key's
    assert svc.put_end(P.PutToken("k", first.put_id + 1)).code == ErrorCode.INVALID_WRITE
    assert svc.remove("k").code == OK
    assert svc.put_end(P.PutToken("k", first.put_id)).code == OK  # it was stored: later changes aside
    revoked = svc.put_start(P.PutItem("r", 1000))
    assert svc.put_revoke(P.PutToken("r", revoked.put_id)).code == OK
    assert svc.put_end(P.PutToken("r", revoked.put_id)).code == NOT_FOUND  # a revoked put never ends
    for i in range(ENDED_PUTS_KEPT):
        assert put(svc, f"f{i % 64}", upsert=True) == OK
    assert svc.put_end(P.PutToken("k", first.put_id)).code == NOT_FOUND  # forgotten: bounded memory
    assert len(svc._ended) == ENDED_PUTS_KEPT


def test_k04_abandoned_put_is_released_without_takeover():
    svc, clock = service(put_start_release_timeout_s=0.5)
    assert svc.put_start(P.PutItem("victim", MIB)).code == OK
    clock.advance(0.49)
    svc.tick()
    assert svc.stats().in_flight_puts == 1 and svc.stats().used_bytes == MIB
    clock.advance(0.02)
    svc.tick()
    stats = svc.stats()
    assert stats.in_flight_puts == 0 and stats.used_bytes == 0
    assert svc.counters["put_released"] == 1 and "victim" not in svc.objects
    assert put(svc, "victim", 2) == OK and svc.get_replica_list("victim").size == 2


def test_a_reader_that_never_reports_blocks_removal_only_until_its_lease_ends():
    svc, clock = service(default_kv_lease_ttl_ms=400)
    put(svc, "held", 100)
    assert svc.get_replica_list("held").code == OK  # the reader is killed: no ReadDone
    assert svc.remove("held").code == HAS_LEASE
    assert svc.batch_remove(["held"]).codes == [HAS_LEASE]
    clock.advance(0.399)
    assert svc.remove("held").code == HAS_LEASE
    clock.advance(0.002)
    assert svc.remove("held").code == OK
    assert exist(svc, ["held"]) == [False]


def test_forced_remove_keeps_an_unreported_read_until_the_lease_ends():
    svc, clock = service(default_kv_lease_ttl_ms=300)
    put(svc, "held")
    svc.get_replica_list("held")  # a grant never reported done: a reader may still be copying
    assert svc.remove("held", force=True).code == OK
    assert exist(svc, ["held"]) == [False]
    assert svc.stats().zombie_buffers == 1  # not reused while that read may be in flight
    clock.advance(0.299)
    svc.tick()
    assert svc.stats().used_bytes == 1024
    clock.advance(0.002)
    svc.tick()
    stats = svc.stats()
    assert stats.used_bytes == 0 and stats.zombie_buffers == 0 and stats.open_grants == 0
    assert svc.counters["read_grants_expired"] == 1


def test_read_done_frees_an_upserted_over_version_at_once_and_keeps_the_lease():
    svc, clock = service(default_kv_lease_ttl_ms=60_000)
    put(svc, "k", MIB)
    grant = svc.get_replica_list("k").grant_id
    assert put(svc, "k", MIB, upsert=True) == OK
    assert counted(svc) == (1, 1, MIB)
    clock.advance(1.0)
    svc.read_done([grant, grant, 12345])  # repeated and unknown ids are ignored
    assert counted(svc) == (1, 0, 0) and svc.stats().used_bytes == MIB
    assert svc.counters["reads_done"] == 1
    assert svc.remove("k").code == HAS_LEASE  # done reads never shorten the lease


def test_failed_allocation_evicts_by_lease_deadline_then_soft_pins_never_hard():
    svc, clock = service(default_kv_lease_ttl_ms=300, eviction_high_watermark_ratio=1.0)
    for key in ("hard0", "hard1"):
        put(svc, key, MIB, hard_pin=True)
    for key in ("soft0", "soft1"):
        put(svc, key, MIB, soft_pin=P.SOFT_PIN_ENABLE)
    for i in range(4):
        put(svc, f"plain{i}", MIB)
    assert put(svc, "x", MIB) == OK  # full: evicts the oldest unpinned object
    assert exist(svc, ["plain0", "plain1", "soft0", "soft1", "hard0"]) == [False, True, True, True, True]
    clock.advance(0.01)
    handle = svc.get_replica_list("plain1")  # a read moves plain1's lease deadline past the others
    clock.advance(handle.lease_ttl_ms / 1000 + 0.05)
    assert put(svc, "y", MIB) == OK
    assert exist(svc, ["plain1", "plain2"]) == [True, False]
    clock.advance(0.6)  # the leases of those checks run out
    assert put(svc, "big", 5 * MIB) == OK  # needs every unpinned object, then the soft pins
    assert exist(svc, ["hard0", "hard1", "soft0", "soft1", "plain1", "big"]) == [
        True, True, False, False, False, True]
    assert put(svc, "more", 5 * MIB) == ErrorCode.NO_AVAILABLE_HANDLE  # hard-pinned and leased left


def test_soft_pin_protects_until_its_fixed_deadline_only():
    svc, clock = service(2 * MIB, default_kv_lease_ttl_ms=200, soft_pin_ttl_ms=400,
                         eviction_high_watermark_ratio=1.0)
    put(svc, "soft", MIB, soft_pin=P.SOFT_PIN_ENABLE)
    put(svc, "plain", MIB)
    put(svc, "c", MIB)  # soft is older, but pinned: plain goes
    # (reads would grant leases and move deadlines: check without reading soft)
    assert exist(svc, ["plain"]) == [False] and svc.stats().object_count == 2
    clock.advance(0.399)
    assert svc.objects["soft"].soft_pinned(clock())  # fixed at PutEnd: 400 ms
    clock.advance(0.002)
    assert put(svc, "d", MIB) == OK  # the pin has run out: soft is now the oldest, it goes
    assert exist(svc, ["soft", "c", "d"]) == [False, True, True]


def test_k06_a_silent_owner_loses_its_segment_and_its_objects():
    svc, clock = service(client_ttl_s=1.0)
    svc.mount("other", P.SegmentInfo("seg2", "host", "shm2", 8 * MIB, "127.0.0.1:2"))
    for i in range(5):
        put(svc, f"on0/{i}", preferred_segment="seg")
    put(svc, "elsewhere", preferred_segment="seg2")
    clock.advance(0.9)
    assert svc.heartbeat("other").code == OK
    svc.tick()
    assert svc.stats().object_count == 6
    clock.advance(0.2)  # "owner" silent for 1.1 s, "other" for 0.2 s
    svc.tick()
    stats = svc.stats()
    assert stats.object_count == 1 and stats.owner_count == 1 and [s.name for s in stats.segments] == ["seg2"]
    assert stats.used_bytes == 1024 and svc.counters["owners_expired"] == 1
    assert svc.heartbeat("owner").code == ErrorCode.CLIENT_NOT_FOUND  # the node remounts
    assert svc.get_replica_list("on0/1").code == NOT_FOUND


def test_counts_kept_as_they_change_equal_a_full_scan():
    """Objects and zombie bytes are counted as they change (stats scans nothing): after
    every step of a random mix of puts, upserts, reads, removals, unmounts and expiries,
    the counts equal a scan of every record."""
    rng = random.Random(7)
    svc, clock = service(4 * MIB, default_kv_lease_ttl_ms=500, client_ttl_s=5.0,
                         put_start_discard_timeout_s=0.3, put_start_release_timeout_s=1.0)
    grants: list[int] = []
    for step in range(3000):
        key, op = f"k{rng.randrange(40)}", rng.randrange(10)
        if op <= 2:
            put(svc, key, rng.choice([100, 5000, 70_000]), upsert=rng.random() < 0.7)
        elif op == 3:
            svc.put_start(P.PutItem(key, 3000, upsert=True))  # abandoned
        elif op == 4:
            grants.append(svc.get_replica_list(key).grant_id)
        elif op == 5 and grants:
            svc.read_done([grants.pop(rng.randrange(len(grants)))])
        elif op == 6:
            svc.remove(key, force=rng.random() < 0.5)
        elif op == 7:
            clock.advance(rng.random() * 0.3)
            for owner in list(svc.segments.last_seen):
                svc.heartbeat(owner)
            svc.tick()
        elif op == 8 and step % 500 == 0:  # a node leaves and another comes
            name = rng.choice(list(svc.segments.segments))
            svc.unmount(svc.segments.segments[name].owner_id, name)
            svc.mount(f"o{step}", P.SegmentInfo(f"s{step}", "host", f"shm{step}", 4 * MIB, "127.0.0.1:3"))
        else:
            svc.batch_exist_key([key])
        assert counted(svc) == scanned(svc), step
    assert svc.stats().object_count > 0


def test_every_request_type_has_a_handler_that_returns_its_reply():
    import typing

    from kvpool.master.server import MasterServer

    svc, _ = service()
    server = MasterServer(svc)
    assert set(server._handlers) == set(typing.get_args(P.Request))
    put(svc, "k")
    replies = {}
    for body, reply_type in ((P.Ping(), P.Resp), (P.ExistKey("k"), P.Resp),
                             (P.BatchExistKey(["k", "nope"]), P.CodesResp),
                             (P.Remove("nope"), P.Resp), (P.GetStats(), P.StatsResp),
                             (P.BatchGetReplicaList(["k"]), P.BatchGetResp)):
        replies[type(body)] = reply = server.dispatch(P.encode_frame(body)[P.HEADER.size:])
        assert type(reply) is reply_type, (body, reply)
    assert replies[P.BatchExistKey].codes == [OK, NOT_FOUND]
    assert replies[P.Remove].code == NOT_FOUND


def test_a_batch_get_grants_each_visible_key_and_only_those():
    """The batch read loop's cases in one batch: one replica, two replicas, a put still in
    flight (invisible), an absent key and a repeated key. Each visible key gets its own
    grant, its lease extended to the batch's deadline, and is counted; the misses are
    not. An exist batch over the same keys agrees."""
    svc, clock = service(default_kv_lease_ttl_ms=2000)
    svc.mount("owner2", P.SegmentInfo("seg2", "host", "shm2", 8 * MIB, "127.0.0.1:2"))
    assert put(svc, "one") == OK and put(svc, "two", replica_num=2) == OK
    assert svc.put_start(P.PutItem("flying", 1000)).code == OK  # no PutEnd yet
    keys = ["one", "two", "flying", "absent", "one"]
    before = svc.counters["leases_granted"]
    clock.advance(1.0)
    reply = svc.batch_get_replica_list(keys)
    results = reply.results
    assert [r.code for r in results] == [OK, OK, NOT_FOUND, NOT_FOUND, OK]
    assert [len(reply.replicas(r)) for r in results] == [1, 2, 0, 0, 1]
    assert {x.segment.name for x in reply.replicas(results[1])} == {"seg", "seg2"}
    assert sorted(s.name for s in reply.segments) == ["seg", "seg2"]  # each named once
    assert reply.replicas(results[0]) == reply.replicas(results[4])
    assert results[0].size == results[1].size == 1000 and reply.lease_ttl_ms == 2000
    ids = [r.grant_id for r in results if r.code == OK]
    assert 0 not in ids and len(set(ids)) == 3 and len(svc.grants.open) == 3
    assert svc.counters["leases_granted"] - before == 3
    for key in ("one", "two"):
        assert svc.objects[key].lease_deadline == clock.now + 2.0
    assert svc.remove("one").code == HAS_LEASE
    assert exist(svc, keys) == [True, True, False, False, True]
    assert svc.counters["leases_granted"] - before == 6
    assert svc.get_replica_list("absent").code == NOT_FOUND and svc.get_replica_list("one").code == OK


def test_a_read_never_shortens_a_lease():
    """A get or exist under a shorter lease TTL than an earlier read's keeps the later
    deadline (and the record's place in the eviction order): leases only grow."""
    svc, clock = service(default_kv_lease_ttl_ms=5000)
    assert put(svc, "k") == OK
    svc.get_replica_list("k")
    long = svc.objects["k"].lease_deadline
    svc.config.default_kv_lease_ttl_ms = 1000
    assert svc.batch_get_replica_list(["k"]).results[0].code == OK and exist(svc, ["k"]) == [True]
    assert svc.objects["k"].lease_deadline == long
    clock.advance(2.0)  # past the short TTL, inside the long one: still held
    assert svc.remove("k").code == HAS_LEASE


def test_no_space_says_first_when_no_node_is_mounted_yet_or_every_node_was_seen_dead():
    """Found in a trial: a put just after a master restart read "no segment is mounted"
    (nodes mount again within moments), and one whose only node was killed led with the
    free extents of a pool it could not use, its cause last."""
    fresh = MasterService(MasterConfig(), clock=FakeClock())
    fresh.tick()  # the restore window opens at the first tick
    reply = fresh.put_start(P.PutItem("k", 1000))
    assert reply.code == ErrorCode.NO_AVAILABLE_HANDLE
    assert reply.message.endswith("no segment is mounted yet (this master started moments ago: "
                                  "its nodes mount within seconds)")
    svc, _ = service()
    svc.stream_lost("seg", svc.segments.segments["seg"].info.epoch)  # its node died
    reply = svc.put_start(P.PutItem("k", 1000))
    assert reply.code == ErrorCode.NO_AVAILABLE_HANDLE
    assert reply.message.startswith("no space for 1000 bytes: every segment's node was seen dead")
