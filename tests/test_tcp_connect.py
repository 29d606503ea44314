"""A TCP connect to a port nobody listens on, from this host, that the kernel joined to
itself (source port == destination port) is refused and leaves the port free."""

from __future__ import annotations

import socket

import pytest

from kvpool import tcp_connect
from kvpool.ports import free_port
from kvpool.rpc import MasterUnreachable, RpcChannel



@pytest.fixture
def self_connecting(monkeypatch):
    """Every create_connection made from the port it connects to: the kernel joins the
    socket to itself, as it does by chance for a client retrying a dead local port."""
    real = socket.create_connection

    def from_same_port(addr, timeout=None, source_address=None):
        return real(addr, timeout, source_address=("127.0.0.1", addr[1]))
    monkeypatch.setattr(socket, "create_connection", from_same_port)
    return monkeypatch


def _bind_without_reuse(port: int) -> None:
    """Bind the port as a server that does not set SO_REUSEADDR would: a TIME-WAIT
    socket on it makes this fail with EADDRINUSE."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_socket_connected_to_itself_is_refused_and_leaves_no_time_wait(self_connecting):
    port = free_port()
    with pytest.raises(ConnectionRefusedError):
        tcp_connect.connect(("127.0.0.1", port), 2.0)
    self_connecting.undo()
    _bind_without_reuse(port)


def test_the_kernel_really_joins_such_a_socket_to_itself(self_connecting):
    """The premise of the test above: without the check the connect succeeds, and the
    port is held after close (TIME-WAIT)."""
    port = free_port()
    sock = socket.create_connection(("127.0.0.1", port), 2.0)
    assert sock.getsockname() == sock.getpeername()
    sock.close()
    self_connecting.undo()
    with pytest.raises(OSError):
        _bind_without_reuse(port)


def test_a_master_channel_that_joined_itself_says_the_master_is_unreachable(self_connecting):
    chan = RpcChannel(f"127.0.0.1:{free_port()}", timeout_s=2.0, local=False)
    with pytest.raises(MasterUnreachable, match="refused"):
        chan.connect()
