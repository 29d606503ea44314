"""The parts ``kvpool bench master`` drives a real master with: the master process, simulated
nodes and a metadata-only client, all over the master's real port and protocol.

A simulated node (:class:`SimNodes`) mounts segments as a node does (``MountSegment``
with ``index``, so the master streams its index changes to the mount connection, which
is read and thrown away), heartbeats at the interval the master asks for, and has no
memory behind its segments: nothing ever reads or writes their bytes. The client
(:class:`MetaClient`) sends the control-plane half of each operation, the master's
whole share of it: BatchPutStart + BatchPutEnd for a put, BatchExistKey, and
BatchGetReplicaList followed by ReadDone (as :class:`kvpool.client.Client` does) for a get.
"""

from __future__ import annotations

import os
import selectors
import shutil
import socket
import tempfile
import threading
from pathlib import Path

from kvpool import protocol as P
from kvpool.config import parse_addr
from kvpool.errors import ErrorCode
from kvpool.launch import Child, LaunchError
from kvpool.rpc import RpcChannel

OK = ErrorCode.OK


def proc_rss(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes (Linux ``/proc/PID/status`` VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise LaunchError(f"no VmRSS for process {pid}")


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds used by process ``pid`` (``/proc/PID/stat`` fields 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class MasterProcess:
    """``kvpool master --port 0`` as a child process (its log in ``log_dir``), as a context
    manager; ``addr``, ``pid``, :meth:`rss` and :meth:`cpu_s`. Raises LaunchError."""

    def __init__(self, log_dir: str, tag: str, extra_args: tuple[str, ...] = ()):
        self._work = tempfile.mkdtemp(prefix="kvpool-bench-master-")  # its ready file only
        self.child = Child("master", ["--port", "0", *extra_args], Path(self._work), Path(log_dir), tag)
        try:
            info = self.child.wait_ready(60.0)
        except BaseException:
            self.close()
            raise
        self.addr, self.pid = info["addr"], info["pid"]

    def rss(self) -> int:
        return proc_rss(self.pid)

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid)

    def close(self) -> None:
        self.child.stop()
        shutil.rmtree(self._work, ignore_errors=True)  # one was left per master started

    def __enter__(self) -> "MasterProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SimNodes:
    """``count`` simulated nodes, one segment of ``segment_size`` bytes each, mounted on
    the master at ``addr``; their index streams are drained and their heartbeats sent
    by two background threads until :meth:`close`. ``heartbeats`` / ``refused`` count
    heartbeats answered OK / refused (a refused one means the master dropped a node)."""

    def __init__(self, addr: str, count: int, segment_size: int, tag: str = "sim"):
        self.addr = addr
        self.owners = [f"{tag}-node-{i}" for i in range(count)]
        self.names = [f"{tag}-seg-{i}" for i in range(count)]
        self.heartbeats = 0
        self.refused = 0
        self._sel = selectors.DefaultSelector()
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        interval_ms = 0
        try:
            for owner, name in zip(self.owners, self.names):
                interval_ms = self._mount(owner, P.SegmentInfo(name, f"host-{owner}", "", segment_size,
                                                              "127.0.0.1:1"))
        except BaseException:
            self.close()
            raise
        self.interval_s = interval_ms / 1000
        self._threads = [threading.Thread(target=self._drain, daemon=True),
                         threading.Thread(target=self._beat, daemon=True)]
        for t in self._threads:
            t.start()

    def _mount(self, owner: str, info: P.SegmentInfo) -> int:
        sock = socket.create_connection(parse_addr(self.addr), timeout=30)
        self._socks.append(sock)
        sock.sendall(P.encode_frame(P.MountSegment(owner, info, True)))
        reply = P.reply_decoder.decode(P.recv_frame(sock))
        if not isinstance(reply, P.MountResp) or reply.code != OK:
            raise LaunchError(f"simulated node {owner}: mount refused: {reply}")
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ)
        return reply.heartbeat_interval_ms

    def _drain(self) -> None:
        """Read and drop the master's index updates (a node would apply them)."""
        while not self._stop.is_set():
            for key, _ in self._sel.select(0.1):
                try:
                    if not key.fileobj.recv(1 << 20):
                        self._sel.unregister(key.fileobj)
                except BlockingIOError:
                    pass
                except OSError:
                    self._sel.unregister(key.fileobj)

    def _beat(self) -> None:
        """Every node's heartbeat once per interval, pipelined on one connection (the
        nodes are independent: none waits for another's reply)."""
        sock = self.connect()
        try:
            while not self._stop.wait(self.interval_s):
                self.heartbeat_round(sock)
        finally:
            sock.close()

    def connect(self) -> socket.socket:
        """A new control connection to the master (for :meth:`heartbeat_round`)."""
        sock = socket.create_connection(parse_addr(self.addr), timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def heartbeat_round(self, sock: socket.socket) -> int:
        """One heartbeat from every node, all sent before the replies are read; returns
        how many were sent."""
        sock.sendall(b"".join(P.encode_frame(P.Heartbeat(owner)) for owner in self.owners))
        for _ in self.owners:
            if P.reply_decoder.decode(P.recv_frame(sock)).code == OK:
                self.heartbeats += 1
            else:
                self.refused += 1
        return len(self.owners)

    def close(self) -> None:
        self._stop.set()
        for t in getattr(self, "_threads", ()):
            t.join(timeout=30)
        self._sel.close()
        for sock in self._socks:
            sock.close()


class MetaClient:
    """The master's share of puts, exists and gets of ``value_size``-byte values, in
    batches, over one connection. Each call returns how many keys succeeded."""

    def __init__(self, addr: str, value_size: int):
        self.channel = RpcChannel(addr, timeout_s=60)
        self.value_size = value_size

    def put(self, keys: list[str]) -> int:
        start = self.channel.call(P.BatchPutStart([P.PutItem(k, self.value_size) for k in keys]),
                                  idempotent=False)
        tokens = [P.PutToken(k, r.put_id) for k, r in zip(keys, start.results) if r.code == OK]
        if not tokens:
            return 0
        end = self.channel.call(P.BatchPutEnd(tokens), idempotent=False)
        return sum(c == OK for c in end.codes)

    def exist(self, keys: list[str]) -> int:
        return sum(c == OK for c in self.channel.call(P.BatchExistKey(keys)).codes)

    def get(self, keys: list[str]) -> int:
        results = self.channel.call(P.BatchGetReplicaList(keys)).results
        grants = [r.grant_id for r in results if r.code == OK]
        if grants:
            self.channel.notify(P.ReadDone(grants))  # the bytes would be read here
        return len(grants)

    def stats(self) -> P.StatsResp:
        return self.channel.call(P.GetStats())

    def close(self) -> None:
        self.channel.close()
