"""Processes that die or misbehave: dead writers, killed readers, garbage bytes, ports."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from kvpool import protocol as P
from kvpool.child import pause_process
from kvpool.client import Client
from kvpool.config import parse_addr
from kvpool.errors import ErrorCode, ObjectExists, ObjectNotFound, RpcFailed, TransferFailed
from kvpool.launch import Cluster
from kvpool.node.segment_host import FENCE_S
from kvpool.rpc import RpcChannel
from kvpool.transfer.epoch import NO_EPOCH
from proc_helpers import wait_for

DEAD_WRITER = """
import sys, time
from kvpool import protocol as P
from kvpool.rpc import RpcChannel
from kvpool.transfer.shm import ShmTransport
chan = RpcChannel(sys.argv[1])
reply = chan.call(P.PutStart(P.PutItem("victim", 1 << 20)))
desc = reply.replicas[0]
half = memoryview(b"H" * (desc.length // 2))
assert ShmTransport().write_from(desc.segment, desc.offset, half, time.monotonic() + 10)  # half written, then killed
print(reply.put_id, flush=True)
sys.stdin.read()
"""

LEASE_HOLDER = """
import sys
from kvpool.client import Client
c = Client(sys.argv[1])
c.query("held")  # takes a read lease, then the process is killed
print("leased", flush=True)
sys.stdin.read()
"""


def start_script(script: str, *args: str) -> tuple[subprocess.Popen, str]:
    """Run ``script`` in a child; returns it and the first line it prints."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdin.close()
    proc.stdout.close()


def _held(stats: P.StatsResp) -> int:
    """Allocated bytes but the unused space of open allocation leases (the client's)."""
    return stats.used_bytes - stats.leased_bytes


def test_k04_dead_writer_keeps_its_key_until_the_discard_timeout(cluster):
    """Over the wire, with the default 30 s discard timeout (the timeouts themselves are
    stepped through on a fake clock in test_master_clock.py)."""
    proc, _ = start_script(DEAD_WRITER, cluster.master_addr)
    kill(proc)
    with Client(cluster.master_addr) as c:
        with pytest.raises(ObjectNotFound):
            c.get("victim")
        assert not c.is_exist("victim")
        with pytest.raises(ObjectExists):  # the writer may still be alive: not yet
            c.put("victim", b"N" * 1000)


@pytest.mark.cluster(extra_master_args=["--put-start-discard-timeout", "1",
                                        "--put-start-release-timeout", "5"])
def test_k04_dead_writer_is_taken_over_and_its_space_freed(cluster):
    proc, put_id = start_script(DEAD_WRITER, cluster.master_addr)
    kill(proc)
    with Client(cluster.master_addr) as c:
        with pytest.raises(ObjectNotFound):
            c.get("victim")
        wait_for(lambda: _try_put(c, "victim", b"N" * 1000), what="takeover after discard timeout")
        assert c.get("victim") == b"N" * 1000
        assert _held(c.stats()) == (1 << 20) + 1024  # dead writer's buffer still held
        wait_for(lambda: _held(c.stats()) == 1024, what="release timeout frees the space")
        late = RpcChannel(cluster.master_addr).call(P.PutEnd(P.PutToken("victim", int(put_id))))
        assert late.code == ErrorCode.INVALID_WRITE
        assert c.get("victim") == b"N" * 1000


@pytest.mark.cluster(extra_master_args=["--put-start-release-timeout", "1"])
def test_k04_abandoned_put_is_released_without_takeover(cluster):
    proc, _ = start_script(DEAD_WRITER, cluster.master_addr)
    kill(proc)
    with Client(cluster.master_addr) as c:
        wait_for(lambda: c.stats().in_flight_puts == 0 and c.stats().used_bytes == 0,
                 what="abandoned put released")
        c.put("victim", b"ok")
        assert c.get("victim") == b"ok"


def _try_put(c: Client, key: str, value: bytes) -> bool:
    try:
        c.put(key, value)
        return True
    except ObjectExists:
        return False


@pytest.mark.cluster(lease_ttl_ms=1000)
def test_killed_reader_holding_a_lease_does_not_block_removal_for_long(cluster):
    with Client(cluster.master_addr) as c:
        c.put("held", b"x" * 100)
        proc, line = start_script(LEASE_HOLDER, cluster.master_addr)
        assert line == "leased"
        kill(proc)
        wait_for(lambda: _try_remove(c, "held"), what="lease of the dead reader to expire")
        assert not c.is_exist("held")


def _withheld(c: Client) -> set[str]:
    return {s.name for s in c.stats().segments if s.withheld}


@pytest.mark.cluster(num_nodes=2, extra_master_args=["--client-ttl", "120"])
def test_puts_after_a_node_is_killed_go_to_the_living_node_at_once(cluster):
    """A killed node's index stream closes at once; from then on no buffer is placed on
    its segment, although the master keeps it mounted (and its objects listed) until the
    owner's TTL (here 120 s) runs out. Before, a put that drew it failed over TCP for the
    whole TTL. Every put path: lease commits, a batch, PutStart (a client without
    allocation leases, where each put draws a segment anew, and a value too big for a
    lease)."""
    dead, alive = (n["segment"] for n in cluster.nodes)
    values = {f"k{i}": bytes([i]) * (64 << 10) for i in range(60)}
    keys = list(values)
    with Client(cluster.master_addr, force_tcp=True, timeout_s=5) as leased, \
            Client(cluster.master_addr, force_tcp=True, timeout_s=5, alloc_leases=False) as started, \
            _client_leasing_on(cluster.master_addr, dead) as shm:
        cluster.stop_node(0, kill=True)
        wait_for(lambda: _withheld(leased) == {dead}, what="the dead node's segment withheld")
        for key in keys[:10]:
            leased.put(key, values[key])
        assert leased.batch_put(keys[10:30], [values[k] for k in keys[10:30]]) == [0] * 20
        for key in keys[30:50]:
            started.put(key, values[key])
        started.put("large", b"L" * (40 << 20))
        for key in keys[50:]:  # into shared memory the dead node left: its lease is refused
            shm.put(key, values[key])
        for key in [*keys, "large"]:
            assert [r.segment.name for r in leased.query(key).replicas] == [alive]
        assert all(leased.get(k) == v for k, v in values.items())
        assert {s.name for s in leased.stats().segments} == {dead, alive}  # still mounted


@pytest.mark.cluster(num_nodes=1)
def test_a_put_to_a_stopped_node_waits_one_timeout_not_one_per_step(cluster):
    """A put whose write into its allocation lease hangs (the node SIGSTOPped: its port
    accepts, nothing answers) goes the PutStart way only in what is left of its one
    ``timeout_s``; before, that way got a timeout of its own and a put, or a batch put,
    returned after 2 x ``timeout_s``."""
    timeout_s = 2.0
    with Client(cluster.master_addr, force_tcp=True, timeout_s=timeout_s) as c:
        c.put("warm", b"w" * 4096)  # the client holds a lease on the node's segment now
        pid = int(cluster.nodes[0]["pid"])
        assert pause_process(pid)
        try:
            started = time.monotonic()
            with pytest.raises(TransferFailed):
                c.put("one", b"o" * 4096)
            took = time.monotonic() - started
            started = time.monotonic()
            codes = c.batch_put([f"b{i}" for i in range(8)], [b"b" * 4096] * 8)
            took_batch = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
        assert took < 1.5 * timeout_s, f"put: {took:.1f} s"
        assert ErrorCode.OK not in codes
        assert took_batch < 1.5 * timeout_s, f"batch put: {took_batch:.1f} s"


def test_a_put_to_a_stopped_master_says_the_master_did_not_answer(cluster):
    """A put whose AllocLease finds the master stopped (SIGSTOP) spends its one
    ``timeout_s`` there and raises RpcFailed, as the PutStart way did when it had time
    of its own: a caller (the vLLM connector) tells a master that does not answer from
    a failed write by it, not by a batch of TRANSFER_FAIL codes."""
    timeout_s = 2.0
    with Client(cluster.master_addr, timeout_s=timeout_s) as c:
        pid = cluster.master.proc.pid
        assert pause_process(pid)
        try:
            started = time.monotonic()
            with pytest.raises(RpcFailed):
                c.batch_put(["m1", "m2"], [b"m" * 4096] * 2)
            took = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
        assert took < 1.5 * timeout_s, f"batch put: {took:.1f} s"
        assert c.batch_put(["m1", "m2"], [b"m" * 4096] * 2) == [ErrorCode.OK] * 2  # and then it puts
        c.put("after", b"a" * 4096)  # the node answers again: puts work
        assert c.get("after") == b"a" * 4096


@pytest.mark.parametrize("batch", [False, True], ids=["put", "batch_put"])
def test_a_master_that_stops_after_the_write_costs_a_put_one_timeout(cluster, batch):
    """The PutStart way (a preferred segment: no allocation lease) with the master
    stopped (SIGSTOP) once the value is written: PutEnd waits only what is left of the
    put's one ``timeout_s`` and is not asked again after it; before, PutEnd waited a
    timeout, reconnected (a stopped master's socket still accepts) and waited another."""
    timeout_s = 2.0
    with Client(cluster.master_addr, timeout_s=timeout_s) as c:
        c.put("warm", b"w" * 4096)
        segment = c.query("warm").replicas[0].segment.name
        pid = cluster.master.proc.pid
        write_all = c._write_all

        def write_then_stop(*args, **kwargs):  # times the fault: between the write and PutEnd
            done = write_all(*args, **kwargs)
            assert pause_process(pid)
            return done

        c._write_all = write_then_stop
        started = time.monotonic()
        try:
            with pytest.raises(RpcFailed, match="no answer within"):
                if batch:
                    c.batch_put(["s1", "s2"], [b"s" * 4096] * 2, preferred_segment=segment)
                else:
                    c.put("s1", b"s" * 4096, preferred_segment=segment)
            took = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
        c._write_all = write_all
        assert took < 1.5 * timeout_s, f"took {took:.1f} s"
        c.put("after", b"a" * 4096, preferred_segment=segment)  # and the master serves on
        assert c.get("after") == b"a" * 4096


@pytest.mark.parametrize("batch", [False, True], ids=["put", "batch_put"])
def test_a_put_end_whose_reply_was_lost_is_resent_and_the_put_succeeds(cluster, batch):
    """The PutStart way with the connection broken after the master applied PutEnd and
    before its reply was read (injected at the channel's exchange: the reply is dropped
    and the socket closed). The channel resends PutEnd on a new connection; the master
    answers OK for the put it committed. Before, the resend found no put in flight: a
    put wrote its value again and raised ObjectAlreadyExists, a batch item read
    INVALID_WRITE, though each was stored."""
    keys = ["lost1", "lost2"] if batch else ["lost1"]
    values = [bytes([65 + i]) * 4096 for i in range(len(keys))]
    with Client(cluster.master_addr, alloc_leases=False) as c:
        chan = c._channel()
        exchange, dropped = chan._exchange, []

        def drop_the_first_commit_reply(frame, kind, *rest):
            reply = exchange(frame, kind, *rest)
            if kind in (P.PutEnd, P.BatchPutEnd) and not dropped:
                dropped.append(reply)
                raise ConnectionResetError("the reply was lost (injected)")
            return reply

        chan._exchange = drop_the_first_commit_reply
        if batch:
            assert c.batch_put(keys, values) == [ErrorCode.OK] * 2
        else:
            assert c.put(keys[0], values[0]) == 1
        assert len(dropped) == 1, "the fault was not injected"
        assert [c.get(k) for k in keys] == values
        assert c.stats().in_flight_puts == 0


def test_a_stopped_master_costs_a_read_one_timeout_and_then_serves_again(cluster):
    """Idempotent requests (a get's grant, exist, remove) to a master that took the
    connection and answers nothing (SIGSTOP) fail with RpcFailed after one
    ``timeout_s``; before, each reconnected to the still-accepting socket and waited a
    second timeout (a vLLM scheduler's lookup stalled 2 x ``timeout_s``)."""
    timeout_s = 1.0
    with Client(cluster.master_addr, timeout_s=timeout_s) as c:
        c.put("k", b"v" * 4096)
        pid = cluster.master.proc.pid
        took = {}
        assert pause_process(pid)
        try:
            for name, call in (("get", lambda: c.get("k")), ("is_exist", lambda: c.is_exist("k")),
                               ("batch_is_exist", lambda: c.batch_is_exist(["k"]))):
                started = time.monotonic()
                with pytest.raises(RpcFailed, match="no answer within 1 s"):
                    call()
                took[name] = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
        assert all(t < 1.5 * timeout_s for t in took.values()), took
        assert c.get("k") == b"v" * 4096  # the next call reconnects


@contextlib.contextmanager
def _client_leasing_on(master_addr: str, segment: str):
    """A same-host (shared memory) client whose allocation lease is on ``segment``: new
    clients each take a lease on a random segment until one lands there."""
    for attempt in range(32):
        c = Client(master_addr)
        c.put(f"probe{attempt}", b"p" * 4096)
        if [r.segment.name for r in c.query(f"probe{attempt}").replicas] == [segment]:
            break
        c.close()
    else:
        pytest.fail(f"no lease on {segment} in 32 clients")
    with c:
        yield c


def test_a_node_that_only_breaks_its_stream_is_not_withheld_a_gone_one_is(cluster):
    """The master withholds a segment whose stream ended only when its data port no longer
    takes connections: a node that breaks its stream to mount again (its data port still
    listening) keeps receiving buffers."""
    listening = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    gone_addr = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()  # nothing listens there any more: connections are refused
    alive = P.SegmentInfo("alive", "h", "", 1 << 20, f"127.0.0.1:{listening.getsockname()[1]}")
    for info in (alive, P.SegmentInfo("gone", "h", "", 1 << 20, gone_addr)):
        chan = RpcChannel(cluster.master_addr)
        assert chan.call(P.MountSegment(f"owner-{info.name}", info, True)).code == ErrorCode.OK
        chan.close()  # the index stream ends
        if info is alive:
            listening.settimeout(10)
            listening.accept()[0].close()  # the master's check reached the data port
    with Client(cluster.master_addr) as c:
        wait_for(lambda: _withheld(c) == {"gone"}, what="the gone node's segment withheld")
    listening.close()


def _try_remove(c: Client, key: str) -> bool:
    return c.batch_remove([key])[0] == ErrorCode.OK


def _raw(addr: str) -> socket.socket:
    return socket.create_connection(parse_addr(addr), timeout=5)


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True


def test_master_survives_garbage_on_its_socket(module_cluster):
    addr = module_cluster.master_addr
    with _raw(addr) as s:  # bad magic: connection closed
        s.sendall(os.urandom(64))
        assert _closed(s)
    with _raw(addr) as s:  # oversized frame: closed
        s.sendall(P.HEADER.pack(P.MAGIC, P.MAX_FRAME + 1))
        assert _closed(s)
    with _raw(addr) as s:  # good frame, garbage body: error reply, connection kept
        s.sendall(P.HEADER.pack(P.MAGIC, 5) + b"\xc1\xff\x00\x01\x02")
        assert isinstance(P.reply_decoder.decode(P.recv_frame(s)), P.ErrorResp)
        body = msgspec.msgpack.encode(["NoSuchMessage", 1])  # unknown tag
        s.sendall(P.HEADER.pack(P.MAGIC, len(body)) + body)
        assert P.reply_decoder.decode(P.recv_frame(s)).code == ErrorCode.INVALID_PARAMS
        body = msgspec.msgpack.encode(["PutStart", ["k", "not-a-size"]])  # wrong field type
        s.sendall(P.HEADER.pack(P.MAGIC, len(body)) + body)
        assert isinstance(P.reply_decoder.decode(P.recv_frame(s)), P.ErrorResp)
        s.sendall(P.encode_frame(P.Ping()))
        assert P.reply_decoder.decode(P.recv_frame(s)).code == ErrorCode.OK
    with _raw(addr) as s:  # cut off mid-frame
        s.sendall(P.HEADER.pack(P.MAGIC, 100) + b"abc")
    with Client(addr) as c:
        c.put("after-garbage", b"fine")
        assert c.get("after-garbage") == b"fine"
        c.remove("after-garbage", force=True)


def test_node_validates_offsets_and_survives_garbage(module_cluster):
    addr = module_cluster.node_addrs[0]
    size = 64 << 20
    with _raw(addr) as s:  # out-of-bounds read: error reply, connection kept
        s.sendall(P.encode_frame(P.DataRead([size - 10, P.MAX_SEGMENT_BYTES], [20, 1])))
        assert P.data_reply_decoder.decode(P.recv_frame(s)).code == ErrorCode.INVALID_PARAMS
        s.sendall(P.encode_frame(P.DataRead([size], [1])))
        assert P.data_reply_decoder.decode(P.recv_frame(s)).code == ErrorCode.INVALID_PARAMS
        s.sendall(P.encode_frame(P.DataRead([0], [8])))
        reply = P.data_reply_decoder.decode(P.recv_frame(s))
        assert reply.code == ErrorCode.OK and len(s.recv(8, socket.MSG_WAITALL)) == 8
    with _raw(addr) as s:  # out-of-bounds write: refused and closed (payload unskippable)
        s.sendall(P.encode_frame(P.DataWrite(size, 2**40)))
        assert P.data_reply_decoder.decode(P.recv_frame(s)).code == ErrorCode.INVALID_PARAMS
        assert _closed(s)
    with _raw(addr) as s:
        s.sendall(os.urandom(100))
        assert _closed(s)
    with Client(module_cluster.master_addr, force_tcp=True) as c:
        c.put("after-node-garbage", b"fine")
        assert c.get("after-node-garbage") == b"fine"
        c.remove("after-node-garbage", force=True)


def test_k08_two_nodes_without_port_get_distinct_ports_and_identities():
    with Cluster(segment_size="16MiB", num_nodes=2) as c:
        a, b = c.nodes
        assert a["addr"] != b["addr"]
        assert a["segment"] != b["segment"] and a["owner_id"] != b["owner_id"]
        assert a["shm_name"] != b["shm_name"]


def test_k08_explicit_port_in_use_is_a_clear_error(module_cluster):
    port = parse_addr(module_cluster.master_addr)[1]
    for cmd in (["master", "--port", str(port)],
                ["node", "--master", module_cluster.master_addr, "--port", str(port), "--segment-size", "1MiB"]):
        r = subprocess.run([sys.executable, "-m", "kvpool", *cmd], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2
        assert "already in use" in r.stderr and "Traceback" not in r.stderr


def test_node_with_unreachable_master_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "kvpool", "node", "--master", f"127.0.0.1:{free}",
                        "--segment-size", "1MiB", "--master-wait", "1"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "trying again for up to 1 s" in r.stderr  # said once, then given up after --master-wait
    assert r.stderr.strip().splitlines()[-1].startswith("kvpool node: error: cannot reach master at")
    assert "Traceback" not in r.stderr


def test_a_node_waiting_for_its_master_stops_on_sigterm_before_the_wait_ends():
    """The node's stop signal is recorded and its master wait looks for it: SIGTERM
    ends a 300 s --master-wait at once, exit 0, no traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    node = subprocess.Popen([sys.executable, "-m", "kvpool", "node", "--master", f"127.0.0.1:{free}",
                             "--segment-size", "1MiB", "--master-wait", "300"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert "trying again for up to 300 s" in node.stderr.readline()  # its first line
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=60) == 0
        assert "Traceback" not in node.stderr.read()
    finally:
        node.kill()
        node.wait()


def test_nothing_left_in_dev_shm_after_graceful_and_killed_nodes():
    with Cluster(segment_size="8MiB", num_nodes=2) as c:
        names = [n["shm_name"] for n in c.nodes]
        assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
        c.stop_node(0, kill=True)  # the resource tracker unlinks a killed node's segment
    wait_for(lambda: not any(os.path.exists(f"/dev/shm/{n}") for n in names), what="shm unlinked")


def test_a_host_frozen_past_the_client_ttl_keeps_its_objects():
    """A master stopped longer than --client-ttl (a frozen VM, a debugger, a swap storm)
    found its nodes silent when it ran again, although they could not have answered
    either: it unmounted them all, and a node re-mounting after a TTL drop is not
    restored from its index, so every object was lost (a new-user trial: 0 of 200 keys
    left). The time the master did not run no longer counts against a node. Here the
    whole host freezes (node and master stopped), and the master resumes first."""
    ttl_s = 2.0
    with Cluster(segment_size="16MiB", extra_master_args=["--client-ttl", str(ttl_s)]) as cluster:
        with Client(cluster.master_addr, timeout_s=10) as client:
            values = {f"p{i}": bytes([i + 1]) * 4096 for i in range(20)}
            for key, value in values.items():
                client.put(key, value)
            master, node = cluster.master.proc.pid, cluster.node_children[0].proc.pid
            assert pause_process(node) and pause_process(master)
            try:
                time.sleep(1.5 * ttl_s)  # the freeze itself is the fault: nothing to wait on
                os.kill(master, signal.SIGCONT)
                # its first tick after the freeze either excuses it or times the node out
                counters = wait_for(lambda: (lambda c: c if c["stalls_excused"] or c["owners_expired"] else None)(
                    collections.Counter(client.stats().counters)), 10, "the master's first tick after the freeze")
            finally:
                os.kill(node, signal.SIGCONT)
            assert counters["owners_expired"] == 0 and counters["stalls_excused"] == 1, counters
            assert {k: client.get(k) for k in values} == values


@pytest.mark.parametrize("local", (True, False), ids=("unix-socket", "tcp"))
def test_a_master_under_another_name_is_not_another_leader(cluster, local):
    """Found in a trial: a master list naming one master twice ("127.0.0.1:P" and
    "localhost:P") made a late reply's leader probe find "another" leader, itself, and
    the request was sent again to the same master, again and again (a slow scan ran 8
    times, then failed). The probe now compares the socket it reaches with the
    connected one."""
    port = parse_addr(cluster.master_addr)[1]
    chan = RpcChannel(f"{cluster.master_addr},localhost:{port}", 5.0, b"", local=local)
    try:
        chan.call(P.Ping())
        assert chan.addr == cluster.master_addr
        assert chan.leader_elsewhere(2.0) is None
    finally:
        chan.close()


def test_a_segment_host_stopped_while_it_mounts_again_ends_its_index_thread_first(monkeypatch):
    """Seen once in CI as a thread's ValueError ("operation forbidden on released
    memoryview object"): a client's in-process segment stopped while its index thread
    was mounting again (fencing the old mount, waiting for a same-host writer) released
    the epoch word under that thread. Now the fence gives up once the host stops, and
    stop() waits for the thread before it unmaps the segment."""
    failures = []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    with Cluster(segment_size="8MiB", num_nodes=0) as cluster:
        own = Client(cluster.master_addr, global_segment_size=1 << 20)
        host = own.segment
        fd = os.open(os.path.join("/dev/shm", host.shm.name), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # a same-host writer of the current mount, holding on
            host._stream.shutdown()  # the stream ends: the index thread fences and mounts again
            wait_for(lambda: host._remounting and host.word.read() == NO_EPOCH, 10,
                     "the index thread to wait for the writer")
            index_thread = next(t for t in threading.enumerate() if t.name == "kvpool-index")
            started = time.monotonic()
            own.close()
            assert time.monotonic() - started < FENCE_S  # the fence gave up: stop did not wait it out
            assert not index_thread.is_alive()
        finally:
            os.close(fd)
    assert failures == []
