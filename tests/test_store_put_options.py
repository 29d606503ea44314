"""Put options the facade needs from the native client: per-put soft-pin TTL and
Mooncake's SoftPinAction on upsert, preferred segments on every put form, ranged reads,
and a cheap ping."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvpool import protocol as P
from kvpool.client import Client
from kvpool.errors import ErrorCode, InvalidParams
from kvpool.master.config import MasterConfig
from kvpool.master.service import MasterService
from kvpool.mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction
from proc_helpers import scraped

MIB = 1 << 20


def _service() -> MasterService:
    svc = MasterService(MasterConfig(soft_pin_ttl_ms=60_000, max_soft_pin_ttl_ms=120_000))
    svc.mount("owner", P.SegmentInfo("seg", "host", "shm", 16 * MIB, "127.0.0.1:1"))
    return svc


def _put(svc: MasterService, key: str, **item) -> int:
    r = svc.put_start(P.PutItem(key, 64, **item))
    if r.code == ErrorCode.OK:
        assert svc.put_end(P.PutToken(key, r.put_id)).code == ErrorCode.OK
    return r.code


def _pin_left_s(svc: MasterService, key: str) -> float:
    return svc.objects[key].soft_pin_deadline - time.monotonic()


def test_soft_pin_ttl_is_per_put_and_bounded_like_mooncake():
    svc = _service()
    assert _put(svc, "default", soft_pin=P.SOFT_PIN_ENABLE) == ErrorCode.OK
    assert 59 < _pin_left_s(svc, "default") <= 60
    assert _put(svc, "own", soft_pin=P.SOFT_PIN_ENABLE, soft_pin_ttl_ms=5_000) == ErrorCode.OK
    assert 4 < _pin_left_s(svc, "own") <= 5
    assert _put(svc, "too-long", soft_pin=P.SOFT_PIN_ENABLE, soft_pin_ttl_ms=120_001) == ErrorCode.INVALID_PARAMS
    assert _put(svc, "ttl-needs-enable", soft_pin_ttl_ms=5_000) == ErrorCode.INVALID_PARAMS
    assert _put(svc, "bad-action", soft_pin=7) == ErrorCode.INVALID_PARAMS
    assert not {"too-long", "ttl-needs-enable", "bad-action"} & set(svc.objects)


def test_upsert_keeps_an_existing_soft_pin_unless_told_otherwise():
    svc = _service()
    _put(svc, "k", soft_pin=P.SOFT_PIN_ENABLE, soft_pin_ttl_ms=5_000)
    deadline = svc.objects["k"].soft_pin_deadline
    assert _put(svc, "k", upsert=True) == ErrorCode.OK  # PRESERVE
    assert svc.objects["k"].soft_pin_deadline == deadline
    assert _put(svc, "k", upsert=True, soft_pin=P.SOFT_PIN_ENABLE, soft_pin_ttl_ms=0) == ErrorCode.OK
    assert svc.objects["k"].soft_pin_deadline == 0.0  # ENABLE with TTL 0 clears (Mooncake)
    _put(svc, "k", upsert=True, soft_pin=P.SOFT_PIN_ENABLE)
    assert _put(svc, "k", upsert=True, soft_pin=P.SOFT_PIN_DISABLE) == ErrorCode.OK
    assert svc.objects["k"].soft_pin_deadline == 0.0
    assert _put(svc, "new", upsert=True) == ErrorCode.OK and svc.objects["new"].soft_pin_deadline == 0.0


def test_client_refuses_a_soft_pin_ttl_without_soft_pin(module_cluster):
    with Client(module_cluster.master_addr) as c:
        with pytest.raises(InvalidParams):
            c.put("ttl-only", b"v", soft_pin_ttl_ms=1000)
        assert c.batch_put(["a"], [b"v"], soft_pin=True, soft_pin_ttl_ms=1000) == [ErrorCode.OK]
        assert c.ping() > 0
        c.remove_all(force=True)


@pytest.mark.parametrize("options, reason", [
    ({"soft_pin": True, "soft_pin_ttl_ms": 10**30}, r"must be an int in 0\.\.4398046511104, got 10{30}"),
    ({"replica_num": 1000}, r"replica_num 1000 is not in 1\.\.16 \(the master's --max-replicas\)"),
    ({"soft_pin": True, "soft_pin_ttl_ms": 10**10}, r"--max-soft-pin-ttl"),
])
def test_a_refused_put_says_why(module_cluster, options, reason):
    """Each was an OverflowError from the encoder, or a bare INVALID_PARAMS (a user asking
    1000 replicas was not told the limit)."""
    with Client(module_cluster.master_addr) as c:
        with pytest.raises(InvalidParams, match=reason):
            c.put("refused", b"v", **options)
        with pytest.raises(InvalidParams, match="timeout_s must be a finite number"):
            Client(module_cluster.master_addr, timeout_s=float("nan"))
        assert not c.is_exist("refused")


@pytest.mark.cluster(segment_size="16MiB", num_nodes=2)
def test_preferred_segment_is_honoured_by_put_upsert_and_batch_put(cluster):
    segments = [n["segment"] for n in cluster.nodes]
    with Client(cluster.master_addr) as c:
        for target in segments:
            c.put(f"p-{target}", b"x", preferred_segment=target)
            c.upsert(f"u-{target}", b"y", preferred_segment=target)
            c.upsert(f"u-{target}", b"yy", preferred_segment=target)  # replaced, same place asked
            keys = [f"b-{target}-{i}" for i in range(4)]
            assert c.batch_put(keys, [b"z"] * 4, preferred_segment=target) == [ErrorCode.OK] * 4
            for key in [f"p-{target}", f"u-{target}", *keys]:
                assert c.query(key).replicas[0].segment.name == target, key


@pytest.mark.cluster(segment_size="16MiB", num_nodes=2)
def test_facade_places_upserts_and_batches_on_the_preferred_segment(cluster):
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "m", 0, 16 * MIB, "tcp", "", cluster.master_addr) == 0
    for node in cluster.nodes:
        cfg = ReplicateConfig()
        cfg.preferred_segment = node["addr"]  # a data server "host:port", as get_hostname() gives
        cfg.soft_pin_action = SoftPinAction.ENABLE
        cfg.soft_pin_ttl_ms = 10_000
        tag = node["segment"]
        assert s.upsert(f"u-{tag}", b"v", cfg) == 0
        assert s.put_batch([f"b-{tag}-0", f"b-{tag}-1"], [b"1", b"2"], cfg) == 0
        assert s.batch_upsert_from([], [], [], cfg) == []
        for key in (f"u-{tag}", f"b-{tag}-0", f"b-{tag}-1"):
            (desc,) = s.get_replica_desc(key)
            assert desc.get_memory_descriptor().buffer_descriptor.segment == tag
    bad = ReplicateConfig()
    bad.soft_pin_ttl_ms = 1000  # a TTL without ENABLE: Mooncake refuses it
    assert s.put("ttl-without-enable", b"v", bad) == -600
    s.close()


@pytest.mark.cluster(segment_size="16MiB", extra_node_args=["--http-port", "0"])
def test_ranged_read_moves_only_the_requested_ranges(cluster):
    value = np.random.default_rng(1).integers(0, 256, 4 * MIB, dtype=np.uint8)
    node_http = cluster.nodes[0]["http_addr"]
    with Client(cluster.master_addr, force_tcp=True) as c:
        c.put("big", value)
        h = c.query("big")
        before = scraped(node_http, "kvpool_node_data_bytes_total", op="read")
        a, b = bytearray(100), np.zeros(4096, np.uint8)
        out = c.batch_read_ranges([h, h], [[(10, a), (4 * MIB - 4096, b)], [(4 * MIB - 10, bytearray(11))]])
        moved = scraped(node_http, "kvpool_node_data_bytes_total", op="read") - before
    assert out == [[100, 4096], [ErrorCode.INVALID_PARAMS]]
    assert bytes(a) == value[10:110].tobytes() and b.tobytes() == value[-4096:].tobytes()
    assert moved == 100 + 4096  # not the 4 MiB value


@pytest.mark.cluster(segment_size="16MiB", extra_master_args=["--http-port", "0"])
def test_facade_health_check_is_a_ping_not_a_stats_scan(cluster):
    master_http = cluster.master.info["http_addr"]
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "m", 0, 16 * MIB, "tcp", "", cluster.master_addr) == 0
    pings = scraped(master_http, "kvpool_master_requests_total", op="Ping")
    stats = scraped(master_http, "kvpool_master_requests_total", op="GetStats")
    assert s.health_check() == 0
    assert scraped(master_http, "kvpool_master_requests_total", op="Ping") == pings + 1
    assert scraped(master_http, "kvpool_master_requests_total", op="GetStats") == stats
    s.close()
