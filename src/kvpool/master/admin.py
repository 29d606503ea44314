"""The master's admin HTTP app: health, Prometheus metrics, segments, keys, one key.

Everything runs on the master's event loop, the one that also runs the request handlers,
so reading ``MasterService`` state needs no lock and never sees a half-done change;
``/keys`` scans in slices (:mod:`kvpool.master.scans`) with requests in between, the
other endpoints cost O(segments) or O(1).
Inspection never grants a read lease and never changes eviction order.

Metrics (Prometheus text format; ``*_total`` are counters since the master started):

=========================================  ==============================================
``kvpool_master_objects``                  visible (COMPLETE) objects
``kvpool_master_used_bytes`` /             allocated / mounted bytes, all segments
``kvpool_master_capacity_bytes``
``kvpool_master_segment_used_bytes``,      per segment (labels segment, owner_id,
``kvpool_master_segment_capacity_bytes``   data_addr)
``kvpool_master_segments_withheld``,      segments taking no new buffers (nodes seen dead),
``_segments_lagging``                      placed last (nodes reading their index streams late)
``kvpool_master_segments``, ``_owners``,   mounted segments, live owners, puts between
``_in_flight_puts``, ``_zombie_buffers``,  PutStart and PutEnd, buffers (and bytes) of old
``_zombie_bytes``, ``_open_read_grants``   versions held for reads in flight or of abandoned
                                           puts, read grants not yet done or expired
``kvpool_master_open_alloc_leases``,       allocation leases neither returned nor expired,
``kvpool_master_leased_bytes``             their bytes not committed yet (not evictable)
``kvpool_master_requests_total{op}``       RPCs handled, by request type (PutStart, ...;
                                           BadRequest: a body that did not decode)
``kvpool_master_errors_total{op,code}``    non-OK results by ErrorCode name; a batch RPC
                                           counts one per failed item
``kvpool_master_evictions_total``,         objects / bytes evicted, eviction passes
``_evicted_bytes_total``,
``_eviction_passes_total``
``kvpool_master_lease_rejections_total``   removals refused with OBJECT_HAS_LEASE
``kvpool_master_events_total{event}``      every internal counter of the service
=========================================  ==============================================
"""

from __future__ import annotations

from collections import Counter

from aiohttp import web
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpool.errors import ErrorCode, code_name
from kvpool.http import error_response, metrics_response, start_site
from kvpool.master.scans import run_in_slices, visible_keys
from kvpool.master.server import MasterServer
from kvpool.protocol import MAX_KEY_BYTES

DEFAULT_KEY_LIMIT = 1000
MAX_KEY_LIMIT = 100_000


def reply_codes(reply) -> list[int]:
    """ErrorCode integers carried by a master reply: one, or one per batch item."""
    if hasattr(reply, "results"):  # BatchGetResp, BatchPutStartResp
        return [r.code for r in reply.results]
    if hasattr(reply, "codes"):  # CodesResp
        return list(reply.codes)
    return [reply.code] if hasattr(reply, "code") else []


class OpCounters:
    """Requests and non-OK results per request type, fed by the master's dispatch hook
    (:meth:`MasterServer.observe`)."""

    def __init__(self):
        self.requests: Counter[str] = Counter()
        self.errors: Counter[tuple[str, str]] = Counter()  # (op, ErrorCode name)

    @classmethod
    def instrument(cls, server: MasterServer) -> "OpCounters":
        """Counters that ``server`` updates after every request; call once, before serving."""
        ops = cls()
        server.observe(ops.count)
        return ops

    def count(self, op: str, reply) -> None:
        """Count one handled request and each non-OK code its reply carries."""
        self.requests[op] += 1
        for code in reply_codes(reply):
            if code != ErrorCode.OK:
                self.errors[(op, code_name(code))] += 1

    def rejections(self, code: ErrorCode) -> int:
        """How many results of any op carried ``code``."""
        return sum(n for (_, name), n in self.errors.items() if name == code.name)


class MasterCollector:
    """Prometheus collector reading the master's state at scrape time."""

    def __init__(self, service, ops: OpCounters):
        self.service, self.ops = service, ops

    def describe(self):
        return []  # no scrape at registration time

    def collect(self):
        s = self.service.stats()
        for name, doc, value in (
            ("objects", "visible (COMPLETE) objects", s.object_count),
            ("used_bytes", "allocated bytes over all segments", s.used_bytes),
            ("capacity_bytes", "mounted bytes over all segments", s.total_bytes),
            ("segments", "mounted segments", len(s.segments)),
            ("segments_withheld", "segments taking no new buffers: their nodes seen dead",
             sum(g.withheld for g in s.segments)),
            ("segments_lagging", "segments placed last: their nodes read their index streams late",
             sum(g.lagging for g in s.segments)),
            ("owners", "nodes and clients with mounted segments", s.owner_count),
            ("in_flight_puts", "objects between PutStart and PutEnd", s.in_flight_puts),
            ("zombie_buffers", "old versions' and abandoned puts' buffers held for reads in flight "
             "or the release timeout", s.zombie_buffers),
            ("zombie_bytes", "bytes of those buffers", s.zombie_bytes),
            ("open_read_grants", "read grants neither reported done (ReadDone) nor expired", s.open_grants),
            ("open_alloc_leases", "allocation leases neither returned nor expired", s.open_leases),
            ("leased_bytes", "allocated bytes of allocation leases not committed yet (not evictable)",
             s.leased_bytes),
        ):
            yield GaugeMetricFamily(f"kvpool_master_{name}", doc, value=value)
        labels = ["segment", "owner_id", "data_addr"]
        used = GaugeMetricFamily("kvpool_master_segment_used_bytes", "allocated bytes per segment", labels=labels)
        cap = GaugeMetricFamily("kvpool_master_segment_capacity_bytes", "size of each segment", labels=labels)
        for seg in s.segments:
            used.add_metric([seg.name, seg.owner_id, seg.data_addr], seg.used)
            cap.add_metric([seg.name, seg.owner_id, seg.data_addr], seg.size)
        yield used
        yield cap
        yield from self._counters(s.counters)

    def _counters(self, events: dict[str, int]):
        requests = CounterMetricFamily("kvpool_master_requests", "RPCs handled, by request type", labels=["op"])
        for op, n in sorted(self.ops.requests.items()):
            requests.add_metric([op], n)
        yield requests
        errors = CounterMetricFamily("kvpool_master_errors", "non-OK results by request type and ErrorCode "
                                     "(one per failed batch item)", labels=["op", "code"])
        for (op, code), n in sorted(self.ops.errors.items()):
            errors.add_metric([op, code], n)
        yield errors
        for name, event, doc in (
            ("evictions", "evicted_objects", "objects evicted"),
            ("evicted_bytes", "evicted_bytes", "value bytes evicted"),
            ("eviction_passes", "eviction_passes", "eviction passes run"),
        ):
            yield CounterMetricFamily(f"kvpool_master_{name}", doc, value=events.get(event, 0))
        yield CounterMetricFamily("kvpool_master_lease_rejections", "removals refused because of a read lease",
                                  value=self.ops.rejections(ErrorCode.OBJECT_HAS_LEASE))
        family = CounterMetricFamily("kvpool_master_events", "internal counters of the master", labels=["event"])
        for event, n in sorted(events.items()):
            family.add_metric([event], n)
        yield family


def _remaining_ms(deadline: float, now: float) -> int:
    return max(0, int((deadline - now) * 1000))


def _replica_json(r, addrs: dict[str, str], status: str) -> dict:
    return {"segment": r.segment, "offset": r.offset, "length": r.length,
            "data_addr": addrs.get(r.segment, ""), "status": status}


def object_json(obj, addrs: dict[str, str], now: float) -> dict:
    """JSON view of one master object record (COMPLETE replicas and any pending put)."""
    pending = obj.pending
    return {
        "key": obj.key,
        "visible": obj.visible,
        "size": obj.size,
        "replicas": [_replica_json(r, addrs, "COMPLETE") for r in obj.replicas],
        "pending_put": None if pending is None else {
            "put_id": pending.put_id, "size": pending.size, "age_s": round(now - pending.started, 3),
            "replicas": [_replica_json(r, addrs, "PROCESSING") for r in pending.replicas],
        },
        "lease_remaining_ms": _remaining_ms(obj.lease_deadline, now),
        "hard_pin": obj.hard_pin,
        "soft_pin_remaining_ms": _remaining_ms(obj.soft_pin_deadline, now),
    }


class MasterAdmin:
    """Route handlers over one ``MasterServer`` (its ``service`` is the metadata)."""

    def __init__(self, server: MasterServer):
        self.service = server.service
        self.started = self.service.clock()
        self.ops = OpCounters.instrument(server)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(MasterCollector(self.service, self.ops))
        ProcessCollector(registry=self.registry)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/segments", self.segments)
        app.router.add_get("/query_key", self.query_key)
        app.router.add_get("/keys", self.keys)
        return app

    async def health(self, request: web.Request) -> web.Response:
        s = self.service.stats()
        return web.json_response({
            "status": "ok", "role": "master", "uptime_s": round(self.service.clock() - self.started, 3),
            "objects": s.object_count, "segments": len(s.segments), "owners": s.owner_count,
        })

    async def metrics(self, request: web.Request) -> web.Response:
        return metrics_response(self.registry)

    async def segments(self, request: web.Request) -> web.Response:
        s = self.service.stats()
        segs = [{"name": g.name, "owner_id": g.owner_id, "size": g.size, "used": g.used,
                 "free": g.size - g.used, "data_addr": g.data_addr, "withheld": g.withheld,
                 "lagging": g.lagging} for g in s.segments]
        return web.json_response({"segments": segs, "used_bytes": s.used_bytes, "total_bytes": s.total_bytes})

    async def query_key(self, request: web.Request) -> web.Response:
        key = request.query.get("key")
        if not key or len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
            return error_response(400, f"give ?key= (1..{MAX_KEY_BYTES} UTF-8 bytes)", ErrorCode.INVALID_PARAMS)
        obj = self.service.lookup(key)
        if obj is None:
            return error_response(404, f"no object {key!r}", ErrorCode.OBJECT_NOT_FOUND)
        addrs = {g.name: g.data_addr for g in self.service.stats().segments}
        return web.json_response(object_json(obj, addrs, self.service.clock()))

    async def keys(self, request: web.Request) -> web.Response:
        prefix = request.query.get("prefix", "")
        try:
            limit = int(request.query.get("limit", DEFAULT_KEY_LIMIT))
        except ValueError:
            limit = -1
        if not 1 <= limit <= MAX_KEY_LIMIT:
            return error_response(400, f"limit must be an integer in 1..{MAX_KEY_LIMIT}", ErrorCode.INVALID_PARAMS)
        first, count = await run_in_slices(visible_keys(self.service, prefix, limit))
        return web.json_response({"keys": first, "count": count, "truncated": count > limit})


async def start_master_admin(server: MasterServer, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Serve the admin app for ``server`` on host:port (0 = free) on the running loop
    (with the server's secret, a bearer token is required: :func:`kvpool.http.start_site`).

    Returns (runner, "host:port"). Raises UserError when the port cannot be bound.
    """
    return await start_site(MasterAdmin(server).app(), host, port, server.secret)
