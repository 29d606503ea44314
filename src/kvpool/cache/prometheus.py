"""Prometheus exposition of a prefix cache's counters and occupancy.

Counters ``kvpool_cache_<name>_total`` come from ``cache.metrics``; a per-tier name
(``hit_tokens_l1``) becomes one family with a ``tier`` label, and ``page_rejects_<why>``
becomes ``kvpool_cache_page_rejects_by_reason_total{reason=...}``. Gauges give the pages
in use per tier, the tree size and ``kvpool_cache_backup_queue_depth``, the L3 backups
(one per insert) queued or being written. The process that hosts the cache serves them.
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_TIER = re.compile(r"^(.*)_(l[123])$")
_REASON = re.compile(r"^page_rejects_(\w+)$")


class CacheCollector(Collector):
    """Collects one PrefixCache; ``labels`` (e.g. {"rank": "0"}) are added to every sample."""

    def __init__(self, cache, labels: dict[str, str] | None = None):
        self.cache = cache
        self.labels = dict(labels or {})

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        families: dict[str, CounterMetricFamily] = {}
        for name, value in sorted(self.cache.metrics.snapshot().items()):
            extra_name, extra_value = [], []
            if m := _REASON.match(name):
                name, extra_name, extra_value = "page_rejects_by_reason", ["reason"], [m[1]]
            elif m := _TIER.match(name):
                name, extra_name, extra_value = m[1], ["tier"], [m[2].upper()]
            family = families.get(name)
            if family is None:
                family = families[name] = CounterMetricFamily(
                    f"kvpool_cache_{name}", f"kvpool prefix cache: {name.replace('_', ' ')}",
                    labels=names + extra_name)
            family.add_metric(values + extra_value, value)
        yield from families.values()
        used = GaugeMetricFamily("kvpool_cache_pages_used", "pages held per tier",
                                 labels=names + ["tier"])
        pool = self.cache.pool
        used.add_metric(values + ["L1"], pool.num_pages - pool.num_free)
        if self.cache.l2 is not None:
            used.add_metric(values + ["L2"], self.cache.l2.num_pages - self.cache.l2.num_free)
        yield used
        nodes = GaugeMetricFamily("kvpool_cache_tree_pages", "pages in the radix tree",
                                  labels=names)
        nodes.add_metric(values, self.cache.tree.num_nodes)
        yield nodes
        depth = GaugeMetricFamily("kvpool_cache_backup_queue_depth",
                                  "L3 backups queued or being written", labels=names)
        depth.add_metric(values, self.cache.backup_queue_depth)
        yield depth


def serve_metrics(cache, port: int = 0, addr: str = "127.0.0.1",
                  labels: dict[str, str] | None = None):
    """Serve ``/metrics`` for ``cache`` over HTTP; returns (server, port).

    Port 0 picks a free port; stop with ``server.shutdown()``.
    """
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache, labels))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server, server.server_port
