"""Optional shared-secret authentication (kvpool.auth): master control port, node data
port and both admin HTTP servers refuse a peer that cannot prove the secret, before any
other message is read; peers with the secret work as usual."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from kvpool import auth
from kvpool import protocol as P
from kvpool.client import Client
from kvpool.config import parse_addr
from kvpool.errors import RpcFailed
from kvpool.launch import Cluster
from kvpool.rpc import RpcChannel
from kvpool.transfer.request import Cancel
from kvpool.transfer.tcp import TcpTransport

SECRET = "correct horse battery staple"


@pytest.fixture(scope="module")
def secured():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVPOOL_SECRET", SECRET)  # master, node (children) and clients here
        with Cluster(segment_size="16MiB", extra_master_args=("--http-port", "0", "--frame-timeout", "2"),
                     extra_node_args=("--http-port", "0", "--frame-timeout", "2")) as c:
            yield c


def test_clients_with_the_secret_work_over_shm_and_tcp(secured):
    for force_tcp in (False, True):
        with Client(secured.master_addr, force_tcp=force_tcp) as c:
            c.put(f"auth-{force_tcp}", b"v" * 10_000)
            assert c.get(f"auth-{force_tcp}") == b"v" * 10_000


@pytest.mark.parametrize("secret", [b"", b"wrong secret"])
def test_the_master_refuses_a_client_without_the_secret(secured, secret):
    chan = RpcChannel(secured.master_addr, timeout_s=5.0, secret=secret)
    with pytest.raises(RpcFailed, match="KVPOOL_SECRET") as refused:
        chan.call(P.Ping())
    chan.close()
    # a wrong secret is named as such, not as another protocol version
    assert ("answered its secret challenge" in str(refused.value)) == bool(secret), refused.value
    assert "another kvpool release" not in str(refused.value)


def test_a_client_with_a_secret_and_a_master_without_one_says_so(monkeypatch):
    monkeypatch.delenv("KVPOOL_SECRET", raising=False)
    with Cluster(segment_size="16MiB", num_nodes=0) as open_cluster:
        chan = RpcChannel(open_cluster.master_addr, timeout_s=0.5, secret=b"a secret")
        with pytest.raises(RpcFailed, match="no authentication challenge in time: .* runs without a secret"):
            chan.call(P.Ping())
        chan.close()


def test_a_channel_pointed_at_an_admin_http_port_says_so(secured):
    chan = RpcChannel(secured.master.info["http_addr"], timeout_s=5.0, secret=b"", local=False)
    with pytest.raises(RpcFailed, match="admin --http-port, not its --port"):
        chan.call(P.Ping())
    chan.close()


def test_a_raw_frame_before_the_answer_is_never_served(secured):
    """Bytes that are not the answer (a valid Ping frame) get the connection closed and
    no reply."""
    with socket.create_connection(parse_addr(secured.master_addr), timeout=10) as s:
        hello = s.recv(auth.CHALLENGE_BYTES, socket.MSG_WAITALL)
        assert hello.startswith(auth.CHALLENGE_MAGIC)
        s.sendall(P.encode_frame(P.Ping()) + b"\x00" * auth.ANSWER_BYTES)
        assert s.recv(1 << 16) == b""


def test_the_node_refuses_a_data_connection_without_the_secret(secured):
    with Client(secured.master_addr, force_tcp=True) as c:
        c.put("auth-data", b"d" * 4096)
        handle = c.query("auth-data")
        desc = handle.replicas[0]
        for secret in (b"", b"wrong secret"):
            bad = TcpTransport(timeout_s=5.0, secret=secret)
            got = bad.read_bytes(desc.segment, desc.offset, desc.length, deadline=_in(5), cancel=Cancel())
            bad.close()
            assert got is None
        good = TcpTransport(timeout_s=5.0)
        assert good.read_bytes(desc.segment, desc.offset, desc.length, deadline=_in(5)) == b"d" * 4096
        good.close()
        c.release([handle])


def _in(seconds: float) -> float:
    return time.monotonic() + seconds


@pytest.mark.parametrize("which", ["master", "node"])
def test_admin_http_needs_the_bearer_token(secured, which):
    info = secured.master.info if which == "master" else secured.nodes[0]
    url = f"http://{info['http_addr']}/health"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=10)
    assert refused.value.code == 401
    wrong = urllib.request.Request(url, headers={"Authorization": "Bearer " + "0" * 64})
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(wrong, timeout=10)
    token = auth.http_token(SECRET.encode())
    ok = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    assert json.load(urllib.request.urlopen(ok, timeout=10))["status"] == "ok"


def test_the_answer_depends_on_the_secret_and_the_nonce():
    _, nonce = auth.challenge()
    good = auth.answer(b"s", nonce)
    assert auth.verify(b"s", nonce, good)
    assert not auth.verify(b"t", nonce, good)
    assert not auth.verify(b"s", auth.challenge()[1], good)
    assert auth.http_token(b"s") != auth.answer(b"s", b"").hex()
