"""A node under resource pressure keeps serving new clients, and a failed put says why.

Found while hunting a fresh TCP client's put that failed at the end of a long benchmark
("writing a replica failed", no cause): a node whose accept loop died on one failed
accept (out of file descriptors, a connection reset in the backlog) left every new
client hanging in the listen backlog until its timeout, while pooled connections kept
working. Failures now also carry their cause (errno, the node's reply code).
"""

from __future__ import annotations

import os
import resource
import socket

import numpy as np
import pytest

from kvpool.client import Client
from kvpool.config import parse_addr
from kvpool.errors import NoSpace, TransferFailed
from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.request import Op, TransferRequest, TransferStatus
from kvpool.transfer.tcp import TcpTransport
from proc_helpers import wait_for


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.cluster(segment_size="16MiB")
def test_node_keeps_accepting_after_running_out_of_file_descriptors(cluster):
    pid, addr = int(cluster.nodes[0]["pid"]), cluster.node_addrs[0]
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    limit = _open_fds(pid) + 4
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, hard))
    extra = []
    try:
        # more connections than the node has descriptors left: its accepts fail (EMFILE)
        extra = [socket.create_connection(parse_addr(addr), timeout=5) for _ in range(12)]
        wait_for(lambda: _open_fds(pid) >= limit, what="the node running out of descriptors", every_s=0.005)
    finally:
        for s in extra:
            s.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    with Client(cluster.master_addr, force_tcp=True, timeout_s=5.0) as c:
        c.put("after-emfile", b"x" * 4096)
        assert c.get("after-emfile") == b"x" * 4096


def test_a_failed_tcp_write_names_its_cause():
    """A write to a data port nobody listens on fails with the errno in its reasons."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again at once: nobody listens there
    from kvpool.protocol import SegmentInfo

    seg = SegmentInfo("gone", "other-host", "no-shm", 1 << 20, f"127.0.0.1:{port}")
    with TransferEngine([TcpTransport(timeout_s=2)], timeout_s=2) as eng:
        src = memoryview(bytearray(4096))
        result = eng.transfer([TransferRequest(Op.WRITE, src, 0, seg, 0, 4096)])
    assert result == [TransferStatus.FAILED]
    assert any("ECONNREFUSED" in r and f"127.0.0.1:{port}" in r for r in result.reasons), result.reasons


@pytest.mark.cluster(segment_size="16MiB")
def test_put_to_a_stopped_node_raises_transfer_failed_with_the_cause(cluster):
    """Until the master has seen the node die, the write fails and says why; from then on
    (milliseconds: its stream ended, its data port refuses) the master places nothing
    there, and with no other node the put is NoSpace saying so."""
    with Client(cluster.master_addr, force_tcp=True, timeout_s=3.0) as c:
        c.put("warm", np.ones(4096, np.uint8))  # a pooled connection to the node
        cluster.stop_node(0, kill=True)
        with pytest.raises((TransferFailed, NoSpace)) as info:
            c.put("after-kill", np.ones(4096, np.uint8))
    message = str(info.value)
    if isinstance(info.value, NoSpace):
        assert message.startswith("put 'after-kill': NO_AVAILABLE_HANDLE: no space for 4096 bytes: every "
                                  "segment's node was seen dead (1 segments"), message  # the cause first
    else:
        assert "writing a replica failed (FAILED: tcp 127.0.0.1:" in message, message
        assert "ECONNREFUSED" in message or "ConnectionError" in message or "ECONNRESET" in message, message


@pytest.mark.cluster(segment_size="16MiB")
def test_get_from_a_stopped_node_raises_transfer_failed_with_the_cause(cluster):
    with Client(cluster.master_addr, force_tcp=True, timeout_s=3.0) as c:
        c.put("before-kill", b"v" * 4096)
        handle = c.query("before-kill")
        cluster.stop_node(0, kill=True)
        with pytest.raises(TransferFailed) as info:
            c.read(handle)
    assert f"no replica could be read (tcp {cluster.node_addrs[0]}: " in str(info.value), str(info.value)


@pytest.mark.cluster(segment_size="16MiB", num_nodes=0)
def test_pooled_connection_to_a_node_restarted_on_its_port_is_replaced(cluster):
    """The pool's connection to the old node is dead: the next put reconnects."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster.start_node(extra_args=("--port", str(port)))
    with Client(cluster.master_addr, force_tcp=True) as c:
        c.put("before", b"x" * 4096)  # leaves a pooled connection to the first node
        cluster.stop_node(0)
        cluster.start_node(extra_args=("--port", str(port)))
        c.put("after", b"y" * 4096)
        assert c.get("after") == b"y" * 4096
