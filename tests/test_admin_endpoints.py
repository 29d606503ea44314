"""Admin HTTP endpoints of a real master and node (``--http-port 0``), over real HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.client import Client
from kvpool.errors import ObjectHasLease
from kvpool.launch import Cluster
from proc_helpers import poll_until

MIB = 1 << 20
SEGMENT = 16 * MIB
LEASE_MS = 1500  # short, so buffers of force-removed leased objects come back soon


@pytest.fixture(scope="module")
def admin_cluster():
    with Cluster(segment_size=SEGMENT, lease_ttl_ms=LEASE_MS, extra_master_args=["--http-port", "0"],
                 extra_node_args=["--http-port", "0"]) as c:
        yield c


@pytest.fixture
def kv(admin_cluster):
    """A client on an empty cluster: no objects, no buffers held by leases; every put
    through PutStart/PutEnd (no allocation lease: the byte counts below are objects')."""
    with Client(admin_cluster.master_addr, alloc_leases=False) as c:
        c.remove_all(force=True)
        poll_until(lambda: not c.stats().zombie_buffers, 10 * LEASE_MS / 1000, 0.05)
        assert c.stats().used_bytes == 0
        yield c
        c.remove_all(force=True)


def fetch(addr: str, path: str) -> tuple[int, str, str]:
    """(HTTP status, content type, body text) of GET http://addr/path."""
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def get_json(addr: str, path: str) -> tuple[int, dict]:
    status, ctype, body = fetch(addr, path)
    assert ctype.startswith("application/json")
    return status, json.loads(body)


def metrics(addr: str) -> dict[tuple[str, tuple], float]:
    """Parsed Prometheus samples: {(sample name, sorted label items): value}."""
    status, ctype, body = fetch(addr, "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def master_http(c: Cluster) -> str:
    return c.master.info["http_addr"]


def node_http(c: Cluster) -> str:
    return c.nodes[0]["http_addr"]


def test_ready_files_carry_http_addresses(admin_cluster):
    for addr in (master_http(admin_cluster), node_http(admin_cluster)):
        assert addr.startswith("127.0.0.1:") and int(addr.rsplit(":", 1)[1]) > 0


def test_master_health(admin_cluster, kv):
    kv.put("h", b"x")
    status, body = get_json(master_http(admin_cluster), "/health")
    assert status == 200
    assert (body["status"], body["role"], body["objects"], body["segments"]) == ("ok", "master", 1, 1)


def test_master_metrics_track_objects_bytes_and_segments(admin_cluster, kv):
    seg = admin_cluster.nodes[0]["segment"]
    before = metrics(master_http(admin_cluster))
    for i in range(3):
        kv.put(f"m/{i}", b"v" * 1000)
    after = metrics(master_http(admin_cluster))
    assert value(after, "kvpool_master_objects") == 3
    labels = {"segment": seg, "owner_id": admin_cluster.nodes[0]["owner_id"], "data_addr": admin_cluster.node_addrs[0]}
    assert value(after, "kvpool_master_segment_capacity_bytes", **labels) == SEGMENT
    assert value(after, "kvpool_master_segment_used_bytes", **labels) == 3 * 1024  # 1000 rounded to 64 B
    assert value(after, "kvpool_master_used_bytes") == 3 * 1024
    assert value(after, "kvpool_master_capacity_bytes") == SEGMENT
    grew = value(after, "kvpool_master_requests_total", op="PutStart") - value(before, "kvpool_master_requests_total",
                                                                                op="PutStart")
    assert grew == 3
    kv.remove_all(force=True)
    assert value(metrics(master_http(admin_cluster)), "kvpool_master_used_bytes") == 0  # K07


def test_master_metrics_count_errors_and_lease_rejections(admin_cluster, kv):
    m0 = metrics(master_http(admin_cluster))
    assert not kv.is_exist("missing")
    kv.put("leased", b"v")
    kv.get("leased")
    with pytest.raises(ObjectHasLease):
        kv.remove("leased")
    assert kv.batch_remove(["leased", "missing"]) != []
    m1 = metrics(master_http(admin_cluster))

    def grew(name, **labels):
        return value(m1, name, **labels) - value(m0, name, **labels)

    assert grew("kvpool_master_errors_total", op="ExistKey", code="OBJECT_NOT_FOUND") == 1
    assert grew("kvpool_master_errors_total", op="Remove", code="OBJECT_HAS_LEASE") == 1
    assert grew("kvpool_master_errors_total", op="BatchRemove", code="OBJECT_HAS_LEASE") == 1
    assert grew("kvpool_master_errors_total", op="BatchRemove", code="OBJECT_NOT_FOUND") == 1
    assert grew("kvpool_master_lease_rejections_total") == 2


def test_master_metrics_count_evictions(admin_cluster, kv):
    """Filling the segment past its size makes the master evict; the counters show it."""
    before = value(metrics(master_http(admin_cluster)), "kvpool_master_evictions_total")
    chunk = b"e" * MIB
    for i in range(24):  # 24 MiB into a 16 MiB segment: puts past full evict older objects
        kv.put(f"ev/{i}", chunk)
    def evicted():
        now = metrics(master_http(admin_cluster))
        return now if value(now, "kvpool_master_evictions_total") > before else None

    after = poll_until(evicted, 10, 0.05) or metrics(master_http(admin_cluster))
    assert value(after, "kvpool_master_evictions_total") > before
    assert value(after, "kvpool_master_evicted_bytes_total") >= MIB
    assert value(after, "kvpool_master_events_total", event="evicted_objects") == value(
        after, "kvpool_master_evictions_total")


def test_master_metrics_count_allocation_leases(admin_cluster, kv):
    with Client(admin_cluster.master_addr) as c:
        c.put("lease/0", b"v" * 1000)
        after = metrics(master_http(admin_cluster))
        assert value(after, "kvpool_master_open_alloc_leases") == 1
        leased = value(after, "kvpool_master_leased_bytes")
        assert leased > 0 and value(after, "kvpool_master_used_bytes") == leased + 1024
        assert value(after, "kvpool_master_requests_total", op="AllocLease") >= 1
        assert value(after, "kvpool_master_requests_total", op="PutCommit") >= 1
    closed = metrics(master_http(admin_cluster))  # close() returned the lease
    assert value(closed, "kvpool_master_open_alloc_leases") == 0 and value(closed, "kvpool_master_leased_bytes") == 0
    assert value(closed, "kvpool_master_used_bytes") == 1024


def test_segments_endpoint(admin_cluster, kv):
    kv.put("s", b"v" * 100)
    status, body = get_json(master_http(admin_cluster), "/segments")
    assert status == 200
    [seg] = body["segments"]
    assert seg["name"] == admin_cluster.nodes[0]["segment"]
    assert (seg["size"], seg["used"], seg["free"]) == (SEGMENT, 128, SEGMENT - 128)
    assert seg["data_addr"] == admin_cluster.node_addrs[0]
    assert (seg["withheld"], seg["lagging"]) == (False, False)  # a live node keeping up with its stream
    assert (body["used_bytes"], body["total_bytes"]) == (128, SEGMENT)
    scraped = metrics(master_http(admin_cluster))
    assert value(scraped, "kvpool_master_segments_withheld") == value(scraped, "kvpool_master_segments_lagging") == 0


def test_query_key_endpoint(admin_cluster, kv):
    kv.put("q/1", b"v" * 11)
    status, body = get_json(master_http(admin_cluster), "/query_key?key=q/1")
    assert status == 200
    assert (body["key"], body["size"], body["visible"], body["pending_put"]) == ("q/1", 11, True, None)
    [rep] = body["replicas"]
    assert (rep["status"], rep["length"], rep["data_addr"]) == ("COMPLETE", 11, admin_cluster.node_addrs[0])
    assert body["lease_remaining_ms"] == 0  # puts grant no lease, and inspection grants none
    kv.get("q/1")
    assert get_json(master_http(admin_cluster), "/query_key?key=q/1")[1]["lease_remaining_ms"] > 0


@pytest.mark.parametrize("path,status,code", [
    ("/query_key?key=nope", 404, -704),
    ("/query_key", 400, -600),
    ("/query_key?key=" + "x" * 5000, 400, -600),
    ("/keys?limit=0", 400, -600),
    ("/keys?limit=many", 400, -600),
])
def test_admin_errors_are_clear(admin_cluster, path, status, code):
    got, body = get_json(master_http(admin_cluster), path)
    assert (got, body["code"]) == (status, code) and body["error"]


def test_unknown_paths_and_methods_get_json_errors_naming_the_paths(admin_cluster):
    for addr, path in ((master_http(admin_cluster), "/query_key"), (node_http(admin_cluster), "/health")):
        status, body = get_json(addr, "/nope")
        assert status == 404 and "GET /nope" in body["error"] and path in body["error"]
        req = urllib.request.Request(f"http://{addr}/health", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 405 and err.value.headers["Content-Type"].startswith("application/json")
        assert "GET" in err.value.headers["Allow"]
        assert "POST /health" in json.loads(err.value.read())["error"]


def test_keys_endpoint(admin_cluster, kv):
    for key in ("p/a", "p/b", "p/c", "other"):
        kv.put(key, b"v")
    assert get_json(master_http(admin_cluster), "/keys?prefix=p/")[1] == {
        "keys": ["p/a", "p/b", "p/c"], "count": 3, "truncated": False}
    assert get_json(master_http(admin_cluster), "/keys?prefix=p/&limit=2")[1] == {
        "keys": ["p/a", "p/b"], "count": 3, "truncated": True}
    assert get_json(master_http(admin_cluster), "/keys")[1]["count"] == 4


def test_node_health_and_metrics(admin_cluster, kv):
    info = admin_cluster.nodes[0]
    status, body = get_json(node_http(admin_cluster), "/health")
    assert status == 200
    assert (body["status"], body["segment"], body["owner_id"], body["segment_size"]) == (
        "ok", info["segment"], info["owner_id"], SEGMENT)
    kv.put("n", b"v" * 64)
    samples = metrics(node_http(admin_cluster))
    labels = {"segment": info["segment"], "owner_id": info["owner_id"], "data_addr": info["addr"]}
    assert value(samples, "kvpool_node_segment_capacity_bytes", **labels) == SEGMENT
    assert value(samples, "kvpool_node_segment_used_bytes", **labels) == 64
    assert value(samples, "kvpool_node_master_reachable") == 1
    assert value(samples, "kvpool_node_serving") == 1
    assert value(samples, "process_resident_memory_bytes") > 0


def test_admin_is_off_unless_asked(module_cluster):
    assert module_cluster.master.info["http_addr"] is None
    assert module_cluster.nodes[0]["http_addr"] is None


def test_busy_http_port_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "kvpool", "master", "--port", "0", "--http-port", str(port)],
                              capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert f"admin HTTP port {port}" in proc.stderr and "already in use" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_node_metrics_count_data_plane_requests_bytes_and_errors(admin_cluster):
    """Reads, writes and their bytes over TCP, and a refused request, show on the node's
    /metrics (counted by the data server itself, no master call)."""
    node = node_http(admin_cluster)
    before = metrics(node)
    with Client(admin_cluster.master_addr, force_tcp=True) as c:
        c.put("dp", b"d" * 5000)
        assert c.get("dp") == b"d" * 5000
        c.remove("dp", force=True)
    host, port = admin_cluster.node_addrs[0].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        from kvpool import protocol as P

        raw.sendall(P.encode_frame(P.DataRead([SEGMENT], [16])))  # outside the segment
        assert P.data_reply_decoder.decode(P.recv_frame(raw)).code == -600
    after = metrics(node)

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("kvpool_node_data_requests_total", op="write") >= 1
    assert grew("kvpool_node_data_requests_total", op="read") >= 1
    assert grew("kvpool_node_data_bytes_total", op="write") >= 5000
    assert grew("kvpool_node_data_bytes_total", op="read") >= 5000
    assert grew("kvpool_node_data_errors_total", kind="refused") == 1
    assert grew("kvpool_node_data_connections_total") >= 2
    assert ("kvpool_node_data_polled_total", ()) in after  # requests the busy poll caught (any number)


def test_master_counts_every_op_through_its_dispatch_hook(admin_cluster, kv):
    """Requests that do not decode are counted too (op BadRequest), next to real ops."""
    from kvpool import protocol as P

    host, port = admin_cluster.master_addr.split(":")
    before = metrics(master_http(admin_cluster))
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(P.HEADER.pack(P.MAGIC, 3) + b"\xc1\xc1\xc1")  # not msgpack
        assert P.reply_decoder.decode(P.recv_frame(raw)).code == -600
    kv.ping()
    after = metrics(master_http(admin_cluster))
    for op, code in (("BadRequest", "INVALID_PARAMS"),):
        assert value(after, "kvpool_master_errors_total", op=op, code=code) - value(
            before, "kvpool_master_errors_total", op=op, code=code) == 1
    assert value(after, "kvpool_master_requests_total", op="Ping") > value(
        before, "kvpool_master_requests_total", op="Ping")
