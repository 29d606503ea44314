"""The node's admin HTTP app (``/health``, ``/metrics``), served from its own thread.

A node is thread-based (data server and heartbeat threads), so the app runs on a private
event loop in a daemon thread. Used bytes live on the master (it allocates), so a scrape
asks the master once (``GetStats``) on a channel of its own; when the master cannot be
reached the scrape still answers, with ``kvpool_node_master_reachable 0``.

Metrics: ``kvpool_node_segment_capacity_bytes``, ``kvpool_node_segment_used_bytes``
(labels segment, owner_id, data_addr), ``kvpool_node_master_reachable``,
``kvpool_node_serving``, the data plane's counters (read from the data server, no
master call): ``kvpool_node_data_requests_total{op}`` and
``kvpool_node_data_bytes_total{op}`` (op read / write),
``kvpool_node_data_errors_total{kind}`` (the kinds of
:class:`~kvpool.node.data_server.DataCounters`: refused, stale, no_memory, bad_frame, auth,
broken, stalled, accept, full, and idle_closed, which is no fault: an idle connection
closed to make room under ``--max-connections``),
``kvpool_node_data_connections_total``, ``kvpool_node_data_connections_open`` and
``kvpool_node_data_polled_total`` (requests the busy poll after a read's answer found waiting);
and the process collector's ``process_*``.
"""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpool import protocol as P
from kvpool.errors import KVPoolError
from kvpool.http import metrics_response, start_site
from kvpool.node.segment_host import SegmentHost
from kvpool.rpc import RpcChannel

MASTER_TIMEOUT_S = 2.0


class NodeCollector:
    """Prometheus collector for one hosted segment."""

    def __init__(self, node: SegmentHost):
        self.node = node
        self._master = RpcChannel(node.master_addr, MASTER_TIMEOUT_S, node.secret or b"")
        self._lock = threading.Lock()  # scrapes run in worker threads

    def describe(self):
        return []  # no master call at registration time

    def _used_bytes(self) -> int | None:
        """Bytes the master has allocated in this segment; None if the master is away."""
        try:
            with self._lock:
                stats = self._master.call(P.GetStats())
        except KVPoolError:
            return None
        return next((s.used for s in stats.segments if s.name == self.node.info.name), 0)

    def collect(self):
        node, info = self.node, self.node.info
        labels = ["segment", "owner_id", "data_addr"]
        values = [info.name, node.owner_id, node.data_addr]
        cap = GaugeMetricFamily("kvpool_node_segment_capacity_bytes", "size of the hosted segment", labels=labels)
        cap.add_metric(values, info.size)
        yield cap
        used = self._used_bytes()
        yield GaugeMetricFamily("kvpool_node_master_reachable", "1 if the master answered this scrape",
                                value=0 if used is None else 1)
        if used is not None:
            fam = GaugeMetricFamily("kvpool_node_segment_used_bytes", "bytes the master allocated in the segment",
                                    labels=labels)
            fam.add_metric(values, used)
            yield fam
        yield GaugeMetricFamily("kvpool_node_serving", "1 while the data server accepts connections",
                                value=0 if node.server.stopped.is_set() else 1)
        yield from data_plane_metrics(node.server.counters.snapshot())

    def close(self) -> None:
        with self._lock:
            self._master.close()


def data_plane_metrics(snap: dict):
    """Prometheus families of a :class:`~kvpool.node.data_server.DataCounters` snapshot."""
    for name, key, label, doc in (
        ("requests", "requests", "op", "data-plane requests served, by op (read, write)"),
        ("bytes", "bytes", "op", "payload bytes moved, by op (read, write)"),
        ("errors", "errors", "kind", "data-plane failures: refused, bad_frame, broken, accept"),
    ):
        family = CounterMetricFamily(f"kvpool_node_data_{name}", doc, labels=[label])
        for value, n in sorted(snap[key].items()):
            family.add_metric([value], n)
        yield family
    yield CounterMetricFamily("kvpool_node_data_connections", "data connections accepted",
                              value=snap["connections"])
    yield GaugeMetricFamily("kvpool_node_data_connections_open", "data connections open now",
                            value=snap["open_connections"])
    yield CounterMetricFamily("kvpool_node_data_polled", "requests found waiting by the busy poll "
                              "after a read's answer (no wake-up needed)", value=snap["polled"])


def node_app(node: SegmentHost, collector: NodeCollector) -> web.Application:
    """aiohttp app with ``/health`` (200 while serving, else 503) and ``/metrics``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)

    async def health(request: web.Request) -> web.Response:
        serving = not node.server.stopped.is_set()
        return web.json_response({
            "status": "ok" if serving else "stopping", "role": "node", "segment": node.info.name,
            "owner_id": node.owner_id, "data_addr": node.data_addr, "segment_size": node.info.size,
        }, status=200 if serving else 503)

    async def metrics(request: web.Request) -> web.Response:
        # the scrape may wait on the master: keep it off the loop
        return await asyncio.to_thread(metrics_response, registry)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


class NodeAdmin:
    """Runs :func:`node_app` for a started ``SegmentHost`` on a thread of its own.

    ``start()`` returns the bound "host:port" (port 0 = free) and raises UserError when
    it cannot be bound; ``stop()`` shuts the server and the thread down (idempotent).
    """

    def __init__(self, node: SegmentHost, host: str, port: int):
        self.node, self.host, self.port = node, host, port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kvpool-node-admin", daemon=True)
        self.collector = NodeCollector(node)
        self.runner: web.AppRunner | None = None

    def start(self) -> str:
        self.thread.start()
        coro = start_site(node_app(self.node, self.collector), self.host, self.port, self.node.secret)
        try:
            self.runner, addr = asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)
        except BaseException:
            self.stop()
            raise
        return addr

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=5)
            self.runner = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()
        self.collector.close()
