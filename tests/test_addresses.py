"""K24 address forms: one parser and formatter (kvpool.config.parse_addr / format_addr)
for every flag and API, and a whole cluster over IPv6 loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import kvpool
from kvpool.client import Client
from kvpool.config import format_addr, parse_addr, parse_host
from kvpool.errors import UserError
from kvpool.launch import Cluster
from kvpool.mooncake import MooncakeDistributedStore

MIB = 1 << 20

PARSED = [
    ("127.0.0.1:50051", None, ("127.0.0.1", 50051)),
    ("node-3.rack2:7000", None, ("node-3.rack2", 7000)),
    ("[::1]:50051", None, ("::1", 50051)),
    ("[2001:db8::7]:1", None, ("2001:db8::7", 1)),
    ("[fe80::1%eth0]:9", None, ("fe80::1%eth0", 9)),
    ("::1", 50051, ("::1", 50051)),
    ("[::1]", 50051, ("::1", 50051)),
    ("2001:db8::7", 80, ("2001:db8::7", 80)),
    ("10.0.0.2", 50051, ("10.0.0.2", 50051)),
    ("localhost", 0, ("localhost", 0)),
    (":50051", None, ("127.0.0.1", 50051)),
]
MALFORMED = ["::1", "[::1", "[::1]x", "[::1]:", "[10.0.0.1]:5", "::zz:1", "a b:1", "host:99999",
             "host:-1", "host:http", "[]:5", "host"]


@pytest.mark.parametrize("text,default,expected", PARSED)
def test_k24_every_address_form_parses_and_prints_back(text, default, expected):
    assert parse_addr(text, default_port=default) == expected
    printed = format_addr(*expected)
    assert parse_addr(printed) == expected  # printed in a form that reads back
    assert printed.startswith("[") == (":" in expected[0])  # brackets exactly for IPv6


@pytest.mark.parametrize("text", MALFORMED)
def test_k24_a_malformed_address_is_refused_naming_it(text):
    with pytest.raises(UserError, match="address|host"):
        parse_addr(text)


def test_hosts_take_no_port():
    assert [parse_host(h) for h in ("::1", "[::1]", "10.0.0.1", "localhost")] == ["::1", "::1", "10.0.0.1", "localhost"]
    for bad in ("localhost:1", "[::1]:2", "", "a b"):
        with pytest.raises(UserError):
            parse_host(bad)


@pytest.mark.parametrize("argv", [
    ["node", "--master", "[::1"], ["node", "--master", "::1:zz"], ["master", "--host", "[::1]:5"],
    ["serve", "--host", "a b"],
])
def test_the_cli_refuses_a_malformed_address_in_one_line(argv):
    env = {**os.environ, "PYTHONPATH": str(Path(kvpool.__file__).parents[1])}  # this checkout's kvpool
    done = subprocess.run([sys.executable, "-m", "kvpool", *argv, "--port", "0"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and ("address" in done.stderr or "host" in done.stderr), done.stderr


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_k24_a_whole_cluster_over_ipv6_loopback():
    """Master and node listen on ::1 (`--host ::1`, `--master [::1]:port`); clients put
    and get over shared memory and over TCP; the Mooncake facade takes local_hostname
    ::1 and master_server_addr [::1]:port and names itself in the same form."""
    with Cluster(segment_size="16MiB", host="::1", extra_master_args=("--http-port", "0")) as c:
        assert c.master_addr.startswith("[::1]:") and c.node_addrs[0].startswith("[::1]:")
        assert c.master.info["http_addr"].startswith("[::1]:")
        for force_tcp in (False, True):
            with Client(c.master_addr, force_tcp=force_tcp, timeout_s=10.0) as client:
                key, value = f"v6-{force_tcp}", bytes(range(256)) * 4096
                client.put(key, value)
                assert client.get(key) == value
        store = MooncakeDistributedStore()
        assert store.setup("::1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", c.master_addr) == 0
        try:
            assert store.get_hostname().startswith("[::1]:")
            assert store.put("facade-v6", b"f" * 1000) == 0
            assert store.get("facade-v6") == b"f" * 1000
            assert store.get("v6-True") == bytes(range(256)) * 4096
        finally:
            store.close()


def test_free_ports_lie_below_the_ephemeral_range_are_bindable_and_not_repeated():
    """Found in CI: a port the kernel picked (bind to 0) for a vLLM server's metrics was
    taken by another process's outgoing connection in the 20 s before the server bound
    it, and the engine failed to start. free_port gives ports below the kernel's
    ephemeral range, which no connect() is handed, each once per process."""
    from kvpool.ports import PORT_FLOOR, _ephemeral_low, free_port

    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(PORT_FLOOR <= p < _ephemeral_low() for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # still free: nothing holds it
