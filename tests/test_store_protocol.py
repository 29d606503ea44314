"""Wire format, 64-bit fields, the allocator, config precedence and the CLI surface."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import subprocess
import sys

import msgspec
import pytest

from kvpool import protocol as P
from kvpool.config import Option, add_options, resolve
from kvpool.errors import ErrorCode, KVPoolError, UserError
from kvpool.master.allocator import OffsetAllocator
from kvpool.rpc import RpcChannel
from proc_helpers import wait_for, wait_ready_file

BIG = [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**40 + 7, P.MAX_SEGMENT_BYTES]  # sizes past 32 bits, up to the limit


@pytest.mark.parametrize("n", BIG)
def test_every_size_and_offset_field_carries_64_bit_values(n):
    seg = P.SegmentInfo("s", "h", "shm", n, "127.0.0.1:1")
    desc = P.ReplicaDesc(seg, n, n)
    messages = [
        P.PutStart(P.PutItem("k", n)), P.PutEnd(P.PutToken("k", n)), P.MountSegment("o", seg),
        P.PutStartResp(0, n, [desc]), P.GetResp(0, n, n, [desc]), P.DataWrite(n, n),
        P.DataRead([n, n], [n, n]), P.DataResp(0, n), P.CountResp(0, n),
        P.StatsResp(n, n, n, [P.SegmentStats("s", "o", n, n, "a")], {"c": n}, leased_bytes=n),
        P.AllocLease("o", n), P.AllocLeaseResp(0, n, desc, n), P.PutCommit("o", n, [P.CommitItem("k", n, n)]),
        P.ReturnLease("o", [n]), P.BatchGetResp([seg], n, [P.GetItem(0, n, [(0, n)], n, n)]),
    ]
    for msg in messages:
        frame = P.encode_frame(msg)
        assert P.parse_header(frame[: P.HEADER.size]) == len(frame) - P.HEADER.size
        body = frame[P.HEADER.size:]
        decoder = {P.DataWrite: P.data_request_decoder, P.DataRead: P.data_request_decoder,
                   P.DataResp: P.data_reply_decoder}.get(type(msg))
        if decoder is None:
            decoder = P.request_decoder if type(msg) in P.Request.__args__ else P.reply_decoder
        assert decoder.decode(body) == msg


def test_decode_rejects_wrong_types_and_unknown_messages():
    with pytest.raises(msgspec.ValidationError):
        P.request_decoder.decode(msgspec.msgpack.encode(["PutStart", ["k", -1.5]]))
    with pytest.raises(msgspec.ValidationError):
        P.request_decoder.decode(msgspec.msgpack.encode(["Bogus"]))
    with pytest.raises(msgspec.ValidationError):  # a missing required field
        P.request_decoder.decode(msgspec.msgpack.encode(["PutEnd", []]))
    with pytest.raises(P.FrameError):
        P.parse_header(b"XXXX\x00\x00\x00\x00")
    with pytest.raises(P.FrameError):
        P.parse_header(P.HEADER.pack(P.MAGIC, P.MAX_FRAME + 1))


def test_a_batch_get_reply_naming_a_segment_it_lacks_is_refused_not_read():
    """A batch reply names each segment once and points at it by index: an index
    outside the list (a malformed or hostile reply) is an error, never another
    segment's bytes; a negative one does not even decode."""
    seg = P.SegmentInfo("s", "h", "shm", 1 << 20, "127.0.0.1:1")
    reply = P.BatchGetResp([seg], 1000, [P.GetItem(0, 10, [(0, 64)]), P.GetItem(0, 10, [(0, 0), (1, 64)])])
    assert reply.replicas(reply.results[0]) == [P.ReplicaDesc(seg, 64, 10)]
    with pytest.raises(KVPoolError, match="names segment 1 of 1"):
        reply.replicas(reply.results[1])
    body = P.encode_frame(P.BatchGetResp([seg], 1000, [P.GetItem(0, 10, [(0, 64)])]))[P.HEADER.size:]
    hostile = body.replace(msgspec.msgpack.encode([[0, 64]]), msgspec.msgpack.encode([[-1, 64]]))
    assert hostile != body
    with pytest.raises(msgspec.ValidationError):
        P.reply_decoder.decode(hostile)


def test_master_allocates_beyond_4_gib_on_a_large_segment(module_cluster):
    chan = RpcChannel(module_cluster.master_addr)
    seg = P.SegmentInfo("virtual-1TiB", "elsewhere", "none", 2**40, "127.0.0.1:9")
    assert chan.call(P.MountSegment("virtual-owner", seg)).code == ErrorCode.OK
    try:
        sizes = [5 * 2**30, 2**32 + 1, 3 * 2**31]
        tokens = []
        for i, size in enumerate(sizes):
            r = chan.call(P.PutStart(P.PutItem(f"huge/{i}", size, preferred_segment=seg.name)))
            assert r.code == ErrorCode.OK and r.replicas[0].length == size
            tokens.append(P.PutToken(f"huge/{i}", r.put_id))
        assert max(t.put_id for t in tokens) > 0
        assert chan.call(P.BatchPutEnd(tokens)).codes == [0, 0, 0]
        reply = chan.call(P.BatchGetReplicaList([t.key for t in tokens]))
        assert [g.size for g in reply.results] == sizes
        assert reply.replicas(reply.results[-1])[0].offset >= 2**32
        stats = chan.call(P.GetStats())
        assert sum(s.used for s in stats.segments if s.name == seg.name) >= sum(sizes)
    finally:
        assert chan.call(P.UnmountSegment("virtual-owner", seg.name)).code == ErrorCode.OK
        chan.close()


def test_allocator_coalesces_and_returns_to_empty():
    alloc = OffsetAllocator(1 << 20, alignment=64)
    rng = random.Random(7)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            alloc.free(off, live.pop(off))
        else:
            size = rng.randint(1, 20000)
            off = alloc.allocate(size)
            if off is not None:
                assert all(off + alloc.rounded(size) <= o or o + alloc.rounded(s) <= off for o, s in live.items())
                live[off] = size
    for off, size in live.items():
        alloc.free(off, size)
    assert alloc.used == 0 and alloc.largest_free == 1 << 20
    with pytest.raises(AssertionError):
        alloc.free(0, 64)  # double free is caught where it happens


def test_config_precedence_flags_over_env_over_file(tmp_path, monkeypatch):
    opts = [Option("client-ttl", 10.0, float, "ttl"), Option("eviction-ratio", 0.05, float, "r"),
            Option("port", 50051, int, "p", env="MASTER_PORT")]
    parser = argparse.ArgumentParser()
    add_options(parser, opts)
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("client_ttl: 3\neviction-ratio: 0.2\nport: 1000\n")
    monkeypatch.setenv("KVPOOL_CLIENT_TTL", "4")
    monkeypatch.setenv("KVPOOL_MASTER_PORT", "2000")
    values = resolve(parser.parse_args(["--config", str(cfg), "--port", "3000"]), opts)
    assert values == {"client_ttl": 4.0, "eviction_ratio": 0.2, "port": 3000}
    cfg.write_text(json.dumps({"port": "x"}))
    monkeypatch.delenv("KVPOOL_MASTER_PORT")
    with pytest.raises(UserError, match="port"):
        resolve(parser.parse_args(["--config", str(cfg)]), opts)
    assert "KVPOOL_CLIENT_TTL" in parser.format_help() and "default: 10.0" in parser.format_help()


@pytest.mark.parametrize("command", ["master", "node", "serve"])
def test_cli_help_documents_defaults(command):
    r = subprocess.run([sys.executable, "-m", "kvpool", command, "--help"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0 and "default:" in r.stdout and "--config" in r.stdout


def test_bad_flag_value_is_a_clear_error_without_traceback():
    r = subprocess.run([sys.executable, "-m", "kvpool", "master", "--eviction-ratio", "7"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "eviction-ratio" in r.stderr and "Traceback" not in r.stderr


def test_serve_runs_master_and_node_until_ctrl_c(tmp_path):
    import os
    import signal

    from kvpool.client import Client

    ready = tmp_path / "serve.json"
    proc = subprocess.Popen([sys.executable, "-m", "kvpool", "serve", "--port", "0", "--segment-size",
                             "16MiB", "--ready-file", str(ready)], stdout=subprocess.PIPE, text=True)
    try:
        info = wait_ready_file(proc, ready)
        with Client(info["addr"]) as c:
            c.put("served", b"ok")
            assert c.get("served") == b"ok"
            shm = [f"/dev/shm/{s.name}" for s in c.stats().segments]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert "kvpool master:" in proc.stdout.read()
        assert not any(os.path.exists(p) for p in shm)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_master_killed_mid_request_is_not_said_to_run_another_release():
    """Found in a trial: a master killed while a request was on a new connection (the
    channel had reconnected) drew the hint "it may run another kvpool release", though
    the same master had answered this channel before. A fake master on a real socket
    answers one Ping, closes, and then closes the next request's connection mid-reply."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        for answer in (True, False):
            conn, _ = server.accept()
            with conn:
                P.recv_frame(conn)
                if answer:
                    conn.sendall(P.encode_frame(P.Resp(ErrorCode.OK)))
                else:
                    conn.sendall(P.encode_frame(P.Resp(ErrorCode.OK))[:5])  # killed mid-reply

    threading.Thread(target=serve, daemon=True).start()
    chan = RpcChannel(f"127.0.0.1:{port}", timeout_s=10, local=False)
    try:
        assert chan.call(P.Ping()).code == ErrorCode.OK
        # the first connection's close has arrived (over TCP a request sent before it
        # does would meet a reset): the next call takes a second connection
        wait_for(lambda: chan._hangup.poll(0), 10, "the first connection's close")
        with pytest.raises(KVPoolError) as cut:
            chan.call(P.PutStart(P.PutItem("k", 10)), idempotent=False)
        assert "mid-frame" in str(cut.value) and "another kvpool release" not in str(cut.value)
    finally:
        chan.close()
        server.close()


def test_a_call_interrupted_after_its_send_never_hands_its_reply_to_the_next_call():
    """Found in review: an exception other than an OSError (KeyboardInterrupt, one raised
    by a signal handler) leaving a call between its send and its reply left the reply
    on the connection, and the next call read it as its own (the next Ping got the first's;
    a GetReplicaList would get another key's replicas). A fake master on a real socket
    names its replies by connection; the connection is now closed and the next call asks
    anew on a second one."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve_one(conn, number: int) -> None:
        with conn:
            while True:
                try:
                    P.recv_frame(conn)
                except (OSError, P.FrameError):
                    return
                with contextlib.suppress(OSError):  # the first one's client has gone
                    conn.sendall(P.encode_frame(P.Resp(ErrorCode.OK, f"connection {number}")))

    def serve() -> None:
        for number in itertools.count(1):  # accepted in order, by this one thread
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve_one, args=(conn, number), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    chan = RpcChannel(f"127.0.0.1:{port}", timeout_s=10, local=False)

    class Interrupted(BaseException):
        pass

    def interrupt(*args) -> None:
        raise Interrupted()

    try:
        chan._replies.wait = interrupt  # after the send, before the reply is read
        with pytest.raises(Interrupted):
            chan.call(P.Ping())
        del chan._replies.wait
        assert chan.call(P.Ping()).message == "connection 2"  # not the first one's reply
    finally:
        chan.close()
        server.close()
