"""Prometheus exposition of the cache counters, served over HTTP by the cache's process."""

import threading
import urllib.request

import torch
from prometheus_client import CollectorRegistry, generate_latest

from kvpool.cache import Namespace, PrefixCache
from kvpool.cache.disk import DiskBackend
from kvpool.cache.prometheus import CacheCollector, serve_metrics

NS = Namespace(model="tiny", page_size=4)
SHAPE = (1, 2, 1, 4, 2)


def warm_cache():
    cache = PrefixCache(NS, SHAPE, l1_pages=8)
    cache.insert(list(range(8)), torch.zeros((2, *SHAPE)))
    cache.release(cache.match(list(range(8))))
    return cache


def test_counters_and_gauges_are_exposed_with_tier_labels():
    registry = CollectorRegistry()
    registry.register(CacheCollector(warm_cache(), {"rank": "0"}))
    text = generate_latest(registry).decode()
    assert 'kvpool_cache_hit_tokens_total{rank="0",tier="L1"} 8.0' in text
    assert 'kvpool_cache_lookups_total{rank="0"} 1.0' in text
    assert 'kvpool_cache_pages_used{rank="0",tier="L1"} 2.0' in text


def test_metrics_are_served_over_http_on_loopback():
    server, port = serve_metrics(warm_cache())
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            body = resp.read().decode()
        assert 'kvpool_cache_hit_tokens_total{tier="L1"} 8.0' in body
    finally:
        server.shutdown()
        server.server_close()


class GatedDisk(DiskBackend):
    """A real disk backend whose writes wait until ``gate`` is set (a slow L3)."""

    def __init__(self, path, gate: threading.Event):
        super().__init__(path, 1 << 20)
        self.gate = gate

    def put(self, keys, blobs):
        assert self.gate.wait(30), "the test never opened the gate"
        return super().put(keys, blobs)


def depth_sample(cache) -> str:
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache))
    lines = generate_latest(registry).decode().splitlines()
    return next(x for x in lines if x.startswith("kvpool_cache_backup_queue_depth "))


def test_backup_queue_depth_rises_while_backups_wait_and_is_zero_after_flush(tmp_path):
    gate = threading.Event()
    with PrefixCache(NS, SHAPE, l1_pages=16, l3=GatedDisk(tmp_path, gate)) as cache:
        assert depth_sample(cache) == "kvpool_cache_backup_queue_depth 0.0"
        for first in (0, 100, 200):  # three prompts with no common prefix: three backups
            cache.insert(list(range(first, first + 8)), torch.zeros((2, *SHAPE)))
        assert cache.backup_queue_depth == 3  # the first blocks in put, two wait behind it
        assert depth_sample(cache) == "kvpool_cache_backup_queue_depth 3.0"
        gate.set()
        cache.flush()
        assert depth_sample(cache) == "kvpool_cache_backup_queue_depth 0.0"
        assert cache.metrics["pages_written_l3"] == 6
