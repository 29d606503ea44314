"""Remote transport: value bytes over TCP to the node that owns the segment.

Data-plane exchange (frames from :mod:`kvpool.protocol`)::

    write: DataWrite(offset, length) + payload  ->  DataResp(code)
    read:  DataRead(offsets, lengths)           ->  DataResp(code, total) + payload

Payloads go out with ``sendall`` on memoryviews and arrive with ``recv_into`` straight
into the destination, so no byte is touched by Python code. Each thread keeps its own
connection per node, so concurrent transfers never interleave on one socket.
"""

from __future__ import annotations

import socket
import threading

import msgspec

from kvpool import protocol as P
from kvpool.config import parse_addr
from kvpool.errors import ErrorCode, TransferFailed
from kvpool.protocol import ReplicaDesc


SOCKET_BUFFER = 4 << 20  # bytes; larger kernel buffers keep loopback/LAN transfers streaming


def tune_data_socket(sock: socket.socket) -> None:
    """No Nagle delay for the small reply frames; big send/receive buffers for payloads."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


class TcpTransport:
    """Blocking TCP transfers to nodes' data ports; one connection per (thread, node)."""

    def __init__(self, timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._all: list[socket.socket] = []
        self._lock = threading.Lock()

    def _conn(self, addr: str) -> socket.socket:
        conns = self._local.__dict__.setdefault("conns", {})
        sock = conns.get(addr)
        if sock is None:
            try:
                sock = socket.create_connection(parse_addr(addr), timeout=self.timeout_s)
            except OSError as exc:
                raise TransferFailed(f"cannot reach node {addr}: {exc}") from None
            tune_data_socket(sock)
            conns[addr] = sock
            with self._lock:
                self._all.append(sock)
        return sock

    def _drop(self, addr: str) -> None:
        sock = self._local.__dict__.get("conns", {}).pop(addr, None)
        if sock is not None:
            sock.close()

    def _reply(self, sock: socket.socket) -> P.DataResp:
        try:
            return P.data_reply_decoder.decode(P.recv_frame(sock))
        except msgspec.MsgspecError as exc:
            raise P.FrameError(f"bad data reply: {exc}") from None

    def write(self, desc: ReplicaDesc, src: memoryview) -> None:
        """Send ``src`` into the replica's buffer. Raises TransferFailed."""
        self.write_many([(desc, src)])

    def write_many(self, items: list[tuple[ReplicaDesc, memoryview]]) -> list[int]:
        """Pipelined writes (all sent, then all acks read). Returns one code per item;
        raises TransferFailed when a node cannot be reached or the stream breaks."""
        by_addr: dict[str, list[int]] = {}
        for i, (desc, _) in enumerate(items):
            by_addr.setdefault(desc.segment.data_addr, []).append(i)
        codes: list[int] = [ErrorCode.TRANSFER_FAIL] * len(items)
        for addr, idx in by_addr.items():
            sock = self._conn(addr)
            try:
                for i in idx:
                    desc, src = items[i]
                    sock.sendall(P.encode_frame(P.DataWrite(desc.offset, desc.length)))
                    sock.sendall(src)
                for i in idx:
                    codes[i] = self._reply(sock).code
            except (OSError, P.FrameError) as exc:
                self._drop(addr)
                raise TransferFailed(f"write to node {addr} failed: {exc}") from None
        return codes

    def read_into(self, desc: ReplicaDesc, dst: memoryview) -> None:
        """Receive the replica's bytes into ``dst[:desc.length]``. Raises TransferFailed."""
        self.read_many([(desc, dst)])

    def read_many(self, items: list[tuple[ReplicaDesc, memoryview]]) -> None:
        """One DataRead per node for all ``items``; each lands in its destination."""
        by_addr: dict[str, list[tuple[ReplicaDesc, memoryview]]] = {}
        for desc, dst in items:
            by_addr.setdefault(desc.segment.data_addr, []).append((desc, dst))
        for addr, group in by_addr.items():
            sock = self._conn(addr)
            req = P.DataRead([d.offset for d, _ in group], [d.length for d, _ in group])
            try:
                sock.sendall(P.encode_frame(req))
                reply = self._reply(sock)
                if reply.code != ErrorCode.OK:
                    raise TransferFailed(f"node {addr} refused read (code {reply.code})")
                for desc, dst in group:
                    P.recv_exact_into(sock, dst[: desc.length])
            except (OSError, P.FrameError) as exc:
                self._drop(addr)
                raise TransferFailed(f"read from node {addr} failed: {exc}") from None

    def close(self) -> None:
        with self._lock:
            socks, self._all = self._all, []
        for sock in socks:
            sock.close()
