"""Prometheus exposition of the cache counters, served over HTTP by the cache's process."""

import urllib.request

import torch
from prometheus_client import CollectorRegistry, generate_latest

from kvpool.cache import Namespace, PrefixCache
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
