"""Same-host control connections: a master also listens on an abstract Unix socket
named after its TCP address, and clients and nodes on its host use it (kvpool.local_socket).
A client told to behave as if on another host (force_tcp), or with the Unix socket
turned off, uses TCP; a master whose name is taken refuses to start, saying so."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from kvpool import local_socket
from kvpool import protocol as P
from kvpool.client import Client
from kvpool.config import parse_addr
from kvpool.errors import RpcFailed
from kvpool.rpc import RpcChannel
from test_store_restart import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets")


def _family(client: Client) -> int:
    return client._channel()._sock.family


def test_a_client_on_the_masters_host_talks_over_its_unix_socket(module_cluster):
    with Client(module_cluster.master_addr) as c:
        assert _family(c) == socket.AF_UNIX
        c.put("uds-key", b"v" * 100)
        assert c.get("uds-key") == b"v" * 100
        c.remove("uds-key", force=True)


def test_force_tcp_reaches_the_master_over_tcp_as_another_host_would(module_cluster):
    with Client(module_cluster.master_addr, force_tcp=True) as c:
        assert _family(c) == socket.AF_INET
        c.put("tcp-key", b"w" * 100)
        assert c.get("tcp-key") == b"w" * 100
        c.remove("tcp-key", force=True)


def test_the_environment_can_turn_the_unix_socket_off(module_cluster, monkeypatch):
    monkeypatch.setenv("KVPOOL_LOCAL_SOCKET", "0")
    chan = RpcChannel(module_cluster.master_addr)
    chan.connect()
    try:
        assert chan._sock.family == socket.AF_INET
    finally:
        chan.close()


def test_names_of_a_loopback_address_include_the_wildcard_master_and_others_do_not():
    loop = local_socket.connect_names("localhost", 50051)
    assert "\0kvpool-master/127.0.0.1:50051" in loop
    assert loop[-2:] == ["\0kvpool-master/0.0.0.0:50051", "\0kvpool-master/[::]:50051"]
    # a master at 0.0.0.0 here is not the one a client of another address wants
    assert local_socket.connect_names("10.1.2.3", 50051) == ["\0kvpool-master/10.1.2.3:50051"]
    assert local_socket.connect_names("no-such-host.invalid", 50051) == []


def test_a_master_whose_unix_socket_name_is_taken_refuses_to_start():
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    squatter = socket.socket(socket.AF_UNIX)
    squatter.bind(local_socket.listen_name("127.0.0.1", port))
    squatter.listen()
    try:
        r = subprocess.run([sys.executable, "-m", "kvpool", "master", "--port", str(port)],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "KVPOOL_LOCAL_SOCKET": "1"})
    finally:
        squatter.close()
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"kvpool-master/127.0.0.1:{port}" in r.stderr and "taken by another process" in r.stderr


def test_the_node_polls_its_index_stream_and_a_restarted_master_gets_every_commit(cluster):
    """The node reads the index stream on a timer; what the master sent just before
    it died is still applied before the node mounts again (K18: nothing lost)."""
    with Client(cluster.master_addr) as c:
        keys = [f"idx-{i}" for i in range(300)]
        assert all(code == 0 for code in c.batch_put(keys, [b"x" * 64] * len(keys)))
        for key in keys[:50]:
            c.put(key + "-single", b"y" * 32)
    cluster.restart_master()
    with Client(cluster.master_addr) as c:
        wait_for(lambda: len(c.stats().segments) == 1, 20.0, "the node to mount again")
        assert all(c.batch_is_exist(keys))
        assert all(c.batch_is_exist([k + "-single" for k in keys[:50]]))
        assert c.get(keys[0]) == b"x" * 64


def test_the_master_address_parses_the_same_for_both_transports(module_cluster):
    host, port = parse_addr(module_cluster.master_addr)
    assert local_socket.listen_name(host, port) in local_socket.connect_names(host, port)


def test_a_quiet_index_stream_is_not_taken_for_a_dead_one():
    """receive_pending never waits: a stream silent for longer than the channel's
    timeout is still open (a node once re-mounted every 5 s of quiet, failing the
    writes of the old epoch); frames that came are returned; the end is seen, after
    the frames before it."""
    listener = socket.create_server(("127.0.0.1", 0))
    addr = "127.0.0.1:%d" % listener.getsockname()[1]
    chan = RpcChannel(addr, timeout_s=0.05, local=False)
    chan.connect()
    master, _ = listener.accept()
    try:
        started = time.monotonic()
        assert chan.receive_pending() == ([], False)
        assert time.monotonic() - started < 0.05  # answered at once, no wait for data
        time.sleep(0.1)  # quiet for twice the channel's timeout
        assert chan.receive_pending() == ([], False)
        update = P.IndexUpdate("seg", ["gone"], [])
        frame = P.encode_frame(update)
        master.sendall(frame + frame[:5])  # one whole frame and the start of the next
        assert chan.receive_pending() == ([update], False)
        master.sendall(frame[5:])
        master.close()
        assert chan.receive_pending() == ([update], True)
    finally:
        chan.close()
        listener.close()


@pytest.mark.parametrize("local", [True, False])
def test_a_master_that_never_answers_fails_the_call_after_the_channel_timeout(local):
    """The channel's timeout lives in the kernel (SO_RCVTIMEO, no poll per call): a
    master that takes a request and never answers still ends the call, with RpcFailed
    saying so, once the timeout has passed, over TCP and over the Unix socket. An
    idempotent request is not asked again there (one connection, one timeout): nothing
    has ever answered at that address, so it is no master that restarted."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(local_socket.listen_name("127.0.0.1", port))
    unix.listen()
    chan = RpcChannel(f"127.0.0.1:{port}", timeout_s=0.3, secret=b"", local=local)
    try:
        chan.connect()
        assert chan._sock.family == (socket.AF_UNIX if local else socket.AF_INET)
        assert chan._sock.gettimeout() is None  # blocking: the timeout is the kernel's
        started = time.monotonic()
        with pytest.raises(RpcFailed, match="no answer within 0.3 s") as silent:
            chan.call(P.Ping(), idempotent=False)
        assert 0.25 <= time.monotonic() - started < 5
        assert "took the connection and never answered" in str(silent.value)  # nothing ever answered
        with pytest.raises(RpcFailed, match="no answer within 0.3 s"):
            chan.call(P.Ping())  # idempotent
        accepted = unix if local else listener
        accepted.setblocking(False)
        assert len([accepted.accept()[0].close() for _ in range(2)]) == 2  # the two calls
        with pytest.raises(BlockingIOError):
            accepted.accept()  # and no third connection: the Ping was not asked again
    finally:
        chan.close()
        listener.close()
        unix.close()
