"""Hostile input and hostile clients (K22 what a connection may cost, K23 one request must
not stall the server, rogue field values): real master and node processes, raw sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import typing
import urllib.request

import msgspec
import proc_helpers
import msgspec.inspect as mi
import pytest

from kvpool import protocol as P
from kvpool.bench.fuzz import valid_value
from kvpool.client import Client
from kvpool.config import parse_addr
from kvpool.errors import ErrorCode, InvalidParams, RpcFailed
from kvpool.master.admin import start_master_admin
from kvpool.master.config import MasterConfig
from kvpool.master.server import MasterServer
from kvpool.master.service import MasterService
from kvpool.launch import Child, Cluster
from kvpool.node.data_server import DataServer
from kvpool.rpc import RpcChannel

STALLERS = 12  # the field recipe: 12 idle connections, each a header announcing MAX_FRAME


def _rss(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes (/proc/PID/status VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _stall(addr: str, header: bytes, body_part: bytes = b"") -> socket.socket:
    sock = socket.create_connection(parse_addr(addr), timeout=10)
    sock.sendall(header + body_part)
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    """True once the server has closed ``sock`` (EOF or reset), False while it is open."""
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def _wait_all_closed(socks, sample, timeout_s: float = 30.0) -> None:
    """Poll until the server closed every socket, calling ``sample()`` on each round."""
    deadline = time.monotonic() + timeout_s
    open_socks = list(socks)
    while open_socks:
        sample()
        assert time.monotonic() < deadline, f"{len(open_socks)} stalled connections still open"
        open_socks = [s for s in open_socks if not _closed_by_peer(s)]
        time.sleep(0.02)


@pytest.mark.cluster(segment_size="16MiB", extra_node_args=("--frame-timeout", "1"))
def test_k22_node_memory_is_bounded_by_the_bytes_a_connection_sent(cluster):
    """K22: headers announcing 64 MiB bodies cost the node what was sent, not what was
    announced; the node closes them after its frame timeout; other clients keep working."""
    pid, addr = int(cluster.nodes[0]["pid"]), cluster.node_addrs[0]
    header = P.HEADER.pack(P.MAGIC, P.MAX_FRAME)
    with Client(cluster.master_addr, force_tcp=True, timeout_s=5.0) as c:
        c.put("warm", b"w" * 4096)
        assert c.get("warm") == b"w" * 4096
        before = _rss(pid)
        socks = [_stall(addr, header, b"\x00" * 100) for _ in range(STALLERS)]
        peak = [before]
        try:
            c.put("during", b"d" * 65536)  # a well-behaved client is served meanwhile
            assert c.get("during") == b"d" * 65536
            _wait_all_closed(socks, lambda: peak.append(_rss(pid)))
        finally:
            for s in socks:
                s.close()
        grown = max(peak) - before
        assert grown < 32 << 20, f"node RSS grew {grown >> 20} MiB for {STALLERS} stalled headers"
        assert c.get("warm") == b"w" * 4096


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


@contextlib.contextmanager
def _socket_pairs(n: int):
    """``n`` connected socket pairs, closed on exit."""
    pairs = [socket.socketpair() for _ in range(n)]
    try:
        yield pairs
    finally:
        for pair in pairs:
            for sock in pair:
                sock.close()


def _wait_closed(socks, count: int, timeout_s: float = 10.0) -> list[socket.socket]:
    """Poll until the server closed ``count`` of ``socks``; returns those still open."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [s for s in socks if not _closed_by_peer(s)]
        if len(socks) - len(left) >= count:
            return left
        assert time.monotonic() < deadline, f"{len(socks) - len(left)} of {count} connections closed"
        time.sleep(0.02)


@pytest.mark.cluster(segment_size="16MiB", extra_node_args=("--max-connections", "4", "--frame-timeout", "1"))
def test_k22_a_node_serves_at_most_max_connections_and_closes_the_longest_idle(cluster):
    """Found in review: the data port ran a thread per connection with no cap, so idle
    connections (allowed between frames) cost the node a thread each without end. Now
    a fifth connection closes the longest idle one; a well-behaved client whose pooled
    connection was closed retries on a new one and is served."""
    pid, addr = int(cluster.nodes[0]["pid"]), cluster.node_addrs[0]
    with Client(cluster.master_addr, force_tcp=True, timeout_s=5.0) as c:
        c.put("warm", b"w" * 4096)
        before = _threads(pid)  # the client's pooled connection(s) included
        idle = [socket.create_connection(parse_addr(addr), timeout=10) for _ in range(20)]
        try:
            left = _wait_closed(idle, 16)  # the client's pooled connection went first, then these
            assert len(left) == 4
            proc_helpers.wait_for(lambda: _threads(pid) <= before + 4, 10, "the closed connections' threads to end")
            assert c.get("warm") == b"w" * 4096  # its pooled connection was closed: a new one
            c.put("after", b"a" * 65536)
            assert c.get("after") == b"a" * 65536
        finally:
            for sock in idle:
                sock.close()


def test_a_node_under_a_low_open_file_limit_fits_its_connection_cap_to_it(tmp_path):
    """Found in review: with a soft open-file limit of 1024 (common) the default cap of
    1024 connections was never reached: accept() failed with EMFILE and no idle connection
    was closed to make room. Now the node raises its soft limit as far as the hard limit
    allows and fits the cap under it, saying so; here the hard limit is 100."""
    with Cluster(segment_size="16MiB", num_nodes=0) as cluster:
        node = Child("node", ["--master", cluster.master_addr, "--port", "0", "--segment-size", "16MiB"],
                     tmp_path, tmp_path, "node", prefix=("prlimit", "--nofile=100:100"))
        idle: list[socket.socket] = []
        try:
            addr = node.wait_ready(30)["addr"]
            with Client(cluster.master_addr, force_tcp=True, timeout_s=5.0) as c:
                c.put("warm", b"w" * 4096)
                idle = [socket.create_connection(parse_addr(addr), timeout=10) for _ in range(60)]
                _wait_closed(idle, 60 - 36)  # the client's pooled connections went first
                assert c.get("warm") == b"w" * 4096
            assert "serving at most 36 data connections, not 1024" in node.log_path.read_text()
        finally:
            for sock in idle:
                sock.close()
            node.stop()


def test_a_full_data_port_closes_a_new_connection_when_every_one_is_inside_a_request():
    """The policy behind the cap, on one DataServer and real socket pairs: the longest
    idle connection makes room; none idle, the new one is refused (counted as full)."""
    with socket.socket() as listener, _socket_pairs(4) as pairs:
        server = DataServer(listener, memoryview(bytearray(4096)), max_connections=2)
        (a, pa), (b, pb), (c, pc), (d, pd) = pairs
        assert server._make_room(a) and server._make_room(b)
        server._mark(a, idle=False)
        server._mark(b, idle=False)
        assert not server._make_room(c)  # both inside a request
        server._mark(b, idle=True)
        assert server._make_room(c)  # b was idle: closed for c
        pb.settimeout(5)
        assert pb.recv(1) == b""
        server._mark(b, idle=False)  # b's thread, late: stays forgotten
        assert server._make_room(d)  # c is idle now: closed for d; a still in its request
        pc.settimeout(5)
        assert pc.recv(1) == b""
        assert server.counters.snapshot()["errors"] == {"idle_closed": 2}


def test_a_full_data_port_closes_connections_owing_the_secret_before_authenticated_ones():
    """Found in review: a connection still owing the --secret challenge's answer counted
    like any other, so a flood of connections without the secret closed the idle pooled
    connections of authenticated clients. Now those owing the answer go first, the
    oldest first; an authenticated idle one only when none is left."""
    with socket.socket() as listener, _socket_pairs(4) as pairs:
        server = DataServer(listener, memoryview(bytearray(4096)), secret=b"s", max_connections=2)
        (a, pa), (b, pb), (c, pc), (d, pd) = pairs
        assert server._make_room(a)
        server._mark(a, idle=True)  # a answered the challenge and waits, idle the longest
        assert server._make_room(b)  # b owes its answer
        assert server._make_room(c)  # full: b goes, not a
        pb.settimeout(5)
        assert pb.recv(1) == b""
        server._mark(c, idle=True)  # c answered: both idle, a the longest
        assert server._make_room(d)
        pa.settimeout(5)
        assert pa.recv(1) == b""
        assert server.counters.snapshot()["errors"] == {"idle_closed": 2}


def test_a_full_data_port_never_closes_a_connection_whose_request_waits_unread():
    """Found in review: a connection was marked busy only once its thread had read a
    request header, so one whose request had just arrived could be closed as idle and
    its client's retry could meet the same fate. Now one with bytes waiting is skipped."""
    with socket.socket() as listener, _socket_pairs(3) as pairs:
        server = DataServer(listener, memoryview(bytearray(4096)), max_connections=2)
        (a, pa), (b, pb), (c, pc) = pairs
        assert server._make_room(a) and server._make_room(b)  # both idle, a the longest
        pa.sendall(b"x")  # a's next request has arrived, unread
        assert server._make_room(c)  # b goes instead
        pb.settimeout(5)
        assert pb.recv(1) == b""
        assert a.recv(1, socket.MSG_PEEK) == b"x"  # a is open, its byte unread


@pytest.mark.cluster(segment_size="16MiB", extra_master_args=("--frame-timeout", "1"))
def test_k22_master_closes_a_connection_stalled_mid_frame(cluster):
    """K22 on the control port: a frame whose body never comes is closed after the frame
    timeout, at no memory cost, while other clients' requests are answered."""
    pid = int(cluster.master.info["pid"])
    header = P.HEADER.pack(P.MAGIC, P.MAX_FRAME)
    before = _rss(pid)
    socks = [_stall(cluster.master_addr, header, b"\x91") for _ in range(STALLERS)]
    peak = [before]
    try:
        with Client(cluster.master_addr, timeout_s=5.0) as c:
            assert c.ping() >= 0
            c.put("m", b"m" * 1024)
            assert c.get("m") == b"m" * 1024
        _wait_all_closed(socks, lambda: peak.append(_rss(pid)))
    finally:
        for s in socks:
            s.close()
    assert max(peak) - before < 32 << 20


class Pinger:
    """A well-behaved client pinging the master from a thread of its own: ``rtts`` are
    its round trips (s), each stamped with when it ended."""

    def __init__(self, master_addr: str):
        self.rpc = RpcChannel(master_addr, timeout_s=30.0)
        self.rpc.connect()
        self.done = threading.Event()
        self.rtts: list[tuple[float, float]] = []  # (end time, round trip)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.is_set():
            start = time.monotonic()
            assert self.rpc.call(P.Ping()).code == ErrorCode.OK
            end = time.monotonic()
            self.rtts.append((end, end - start))

    def __enter__(self) -> "Pinger":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.rtts:  # pinging before the test's request goes out
            assert time.monotonic() < deadline, "no ping answered"
            time.sleep(0.001)
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(30)
        self.rpc.close()

    def answered_between(self, start: float, end: float) -> int:
        return sum(start < t < end for t, _ in self.rtts)

    def worst(self) -> float:
        return max(rtt for _, rtt in self.rtts)


@pytest.mark.cluster(segment_size="16MiB")
def test_k23_a_pathological_regex_does_not_stall_other_clients(cluster):
    """K23: RemoveByRegex('^(a+)+$') over a 26-character key held the loop 2.5 s with a
    backtracking engine; with RE2 other clients' pings stay quick and the answer is the
    same as ``re.search`` gives."""
    with Client(cluster.master_addr, timeout_s=30.0) as c:
        c.put("a" * 25 + "b", b"x")
        c.put("aaaa", b"y")
        with Pinger(cluster.master_addr) as pinger:
            assert c.remove_by_regex("^(a+)+$") == 1  # "aaaa" matches, the 26-character key does not
        assert pinger.worst() < 1.0, f"a ping waited {pinger.worst():.2f} s behind the regex"
        assert c.is_exist("a" * 25 + "b") and not c.is_exist("aaaa")
        with pytest.raises(InvalidParams):
            c.remove_by_regex(r"(a)\1")  # a backreference: no linear-time engine matches it


@contextlib.contextmanager
def _served_in_thread(svc: MasterService):
    """A real MasterServer (and its admin app) over ``svc`` on a loop in a thread of its
    own; yields (master "host:port", admin "host:port"), then shuts both down."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = MasterServer(svc, "127.0.0.1", 0)

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    async def shutdown():
        await server.close()
        await runner.cleanup()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    addr = on_loop(server.start())
    runner, admin = on_loop(start_master_admin(server, "127.0.0.1", 0))
    try:
        yield addr, admin
    finally:
        on_loop(shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _timed(fn):
    start = time.monotonic()
    result = fn()
    return result, start, time.monotonic()


def test_k23_scans_over_every_object_let_other_requests_in():
    """K23: /keys, RemoveByRegex and RemoveAll over a large pool run in slices: pings on
    another connection are answered while each scan is still running."""
    objects = 60_000
    svc = MasterService(MasterConfig())
    assert svc.mount("o", P.SegmentInfo("s", "h", "shm", 1 << 30, "127.0.0.1:1")).code == ErrorCode.OK
    for i in range(objects):
        put = svc.put_start(P.PutItem(f"k{i:06d}", 64))
        assert svc.put_end(P.PutToken(f"k{i:06d}", put.put_id)).code == ErrorCode.OK
    with _served_in_thread(svc) as (addr, admin):
        rpc = RpcChannel(addr, timeout_s=60.0)
        rpc.connect()
        with Pinger(addr) as pinger:
            url = f"http://{admin}/keys?prefix=k0&limit=5"
            body, start, end = _timed(lambda: json.load(urllib.request.urlopen(url, timeout=60)))
            assert body["keys"] == [f"k{i:06d}" for i in range(5)] and body["count"] == 60_000
            keys_pings = pinger.answered_between(start, end)
            reply, start, end = _timed(lambda: rpc.call(P.RemoveByRegex("^k0[0-2]")))
            assert reply.count == 30_000
            regex_pings = pinger.answered_between(start, end)
            reply, start, end = _timed(lambda: rpc.call(P.RemoveAll()))
            assert reply.count == 30_000
            all_pings = pinger.answered_between(start, end)
        rpc.close()
        # one scan of 30k..60k objects is 30..60 slices; a scan that holds the loop lets in
        # only the pings already on their way when it began (1..3 measured); the pinger
        # shares this process's interpreter lock with the server, so on a loaded machine
        # fewer of the slices' openings are taken (14..29 seen idle)
        # /keys (counting) and RemoveAll (of the 30k left) can end within a ping interval or
        # two on an idle machine (seen: 1), so their windows say nothing either way; the
        # RemoveByRegex scan, an RE2 match over all 60k keys, is long enough to decide
        # (21..30 seen with slices)
        assert regex_pings >= 4, (keys_pings, regex_pings, all_pings)
        assert svc.object_count == 0


# ---------------------------------------------------------------- field limits (rogue values)


def _out_of_range(t, path: str):
    """(path, value) pairs just outside each bound of ``t`` and of what it contains.
    Raises AssertionError for an int, str or list without bounds (every request field
    is bounded, so no value can overflow a later reply)."""
    if isinstance(t, mi.IntType):
        assert t.ge is not None and t.le is not None, f"{path}: an int without bounds"
        yield path, t.le + 1
        yield path, t.ge - 1
    elif isinstance(t, mi.StrType):
        assert t.max_length is not None, f"{path}: a str without max_length"
        yield path, "x" * (t.max_length + 1)
    elif isinstance(t, mi.ListType):
        assert t.max_length is not None, f"{path}: a list without max_length"
        yield path, [valid_value(t.item_type)] * (t.max_length + 1)
        for sub, bad in _out_of_range(t.item_type, path + "[0]"):
            yield sub, ("item", bad)
    elif isinstance(t, mi.StructType):
        offset = t.tag is not None
        for i, f in enumerate(t.fields):
            for sub, bad in _out_of_range(f.type, f"{path}.{f.name}"):
                yield sub, ("field", i + offset, bad)
    else:
        assert isinstance(t, mi.BoolType), f"{path}: unexpected type {t}"


def _variants(msg_type):
    """(valid message, [(field path, out-of-range message)]) as plain msgpack values."""
    info = mi.type_info(msg_type)
    valid = valid_value(info)
    return valid, [(path, _replace(valid, info, bad)) for path, bad in _out_of_range(info, msg_type.__name__)]


def _replace(valid, t, bad):
    """``valid`` (a value of type info ``t``) with one value replaced as ``bad`` says."""
    if not isinstance(bad, tuple):
        return bad
    if bad[0] == "item":
        return [_replace(valid_value(t.item_type), t.item_type, bad[1])]
    _, index, inner = bad
    field = t.fields[index - (t.tag is not None)]
    out = list(valid)
    out[index] = _replace(out[index], field.type, inner)
    return out


REQUESTS = typing.get_args(P.Request)
DATA_REQUESTS = typing.get_args(P.DataRequest)


@pytest.mark.parametrize("msg_type", REQUESTS + DATA_REQUESTS, ids=lambda t: t.__name__)
def test_every_field_of_every_request_is_bounded_at_decode_time(msg_type):
    """Rogue values: one field just past its documented limit (protocol.py) is refused
    by the decoder, while the same message within the limits decodes."""
    decoder = P.data_request_decoder if msg_type in DATA_REQUESTS else P.request_decoder
    valid, cases = _variants(msg_type)
    assert isinstance(decoder.decode(msgspec.msgpack.encode(valid)), msg_type)
    for path, bad in cases:
        with pytest.raises(msgspec.ValidationError):
            decoder.decode(msgspec.msgpack.encode(bad))
            pytest.fail(f"{path} out of range was accepted")


@pytest.mark.cluster(segment_size="16MiB")
def test_out_of_range_requests_are_refused_on_the_wire_and_servers_keep_serving(cluster):
    """Every request type with each field out of range, sent raw: the master answers
    ErrorResp(INVALID_PARAMS) on the same connection, the node closes that data
    connection only; a well-behaved client is served throughout."""
    with Client(cluster.master_addr, force_tcp=True, timeout_s=10.0) as c, \
            socket.create_connection(parse_addr(cluster.master_addr), timeout=10) as raw:
        c.put("good", b"g" * 1000)
        for msg_type in REQUESTS:
            for path, bad in _variants(msg_type)[1]:
                raw.sendall(_frame(bad))
                reply = P.reply_decoder.decode(P.recv_frame(raw))
                assert isinstance(reply, P.ErrorResp) and reply.code == ErrorCode.INVALID_PARAMS, path
        for msg_type in DATA_REQUESTS:
            for path, bad in _variants(msg_type)[1]:
                with socket.create_connection(parse_addr(cluster.node_addrs[0]), timeout=10) as data:
                    data.sendall(_frame(bad))
                    assert data.recv(1) == b"", f"{path}: the node kept the connection"
        assert c.get("good") == b"g" * 1000
        assert c.stats().object_count == 1


def _frame(value) -> bytes:
    body = msgspec.msgpack.encode(value)
    return P.HEADER.pack(P.MAGIC, len(body)) + body


@pytest.mark.cluster(segment_size="16MiB")
def test_a_rogue_mount_cannot_break_stats_for_everyone(cluster):
    """A MountSegment of 2**64-1 bytes is refused; segments at the size limit fill the
    master up to MAX_SEGMENTS and no further; GetStats stays encodable throughout."""
    rpc = RpcChannel(cluster.master_addr, timeout_s=30.0)
    with pytest.raises(RpcFailed) as refused:
        rpc.call(P.MountSegment("rogue", P.SegmentInfo("huge", "h", "shm", 2**64 - 1, "127.0.0.1:1")))
    assert refused.value.code == ErrorCode.INVALID_PARAMS
    mounted = len(rpc.call(P.GetStats()).segments)
    for i in range(P.MAX_SEGMENTS - mounted):
        seg = P.SegmentInfo(f"big{i}", "h", "shm", P.MAX_SEGMENT_BYTES, "127.0.0.1:1")
        assert rpc.call(P.MountSegment("rogue", seg)).code == ErrorCode.OK
    extra = P.SegmentInfo("one-too-many", "h", "shm", P.MAX_SEGMENT_BYTES, "127.0.0.1:1")
    assert rpc.call(P.MountSegment("rogue", extra)).code == ErrorCode.INVALID_PARAMS
    stats = rpc.call(P.GetStats())
    assert len(stats.segments) == P.MAX_SEGMENTS and stats.total_bytes < 2**63
    with Client(cluster.master_addr, timeout_s=10.0) as c:
        assert c.stats().total_bytes == stats.total_bytes
    rpc.close()
