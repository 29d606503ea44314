"""Physical limits of this machine, measured in the same run as kvpool.

- ``MemcpyTarget``: numpy copy of a value into a preallocated buffer: the ceiling of any
  same-host path that must copy the bytes once (kvpool's shared-memory path copies once).
  Sources and destinations cycle over the cell's working set, as the stores' cells do.
- ``TcpStreamTarget``: one TCP loopback stream, ``sendall`` from resident buffers of
  random bytes in a sender process (:func:`resident_sources`) and ``recv_into``
  preallocated buffers here (both cycling over the working set): the ceiling of a
  one-connection TCP path.
- ``TcpRoundTripTarget``: the same connection, one value per request: this process
  asks (one byte), the sender answers with the value. A single get at its barest
  (blocking sockets, no lookup), where a stream keeps the wire busy across values.
"""

from __future__ import annotations

import functools
import socket
import struct
import subprocess
import sys
import time

import numpy as np

from kvpool.bench.harness import (
    CellResult, CellSpec, Target, pool_count, result_from, timed_loop,
)
from kvpool.child import wait_or_kill

_HEADER = struct.Struct("<QQQQ")  # (messages, bytes each, source buffers, asked); 0 messages ends
_READY = b"!"  # the sender's sources are made: the measured messages follow
_ASSUMED_GBPS = 3.0  # only to size a stream so that it lasts about ``budget_s``


class MemcpyTarget(Target):
    """numpy ``copyto`` of ``size`` bytes into a preallocated destination."""

    name = "memcpy"
    apis = ("copy",)

    def copy(self, spec: CellSpec) -> CellResult:
        pool = pool_count(spec.size, 1, spec.working_set)
        src = resident_sources(spec.size, pool)
        dst = [np.zeros(spec.size, dtype=np.uint8) for _ in range(pool)]
        for d, s in zip(dst, src):  # fault the pages in before the clock starts
            np.copyto(d, s)
        pairs = [functools.partial(np.copyto, d, s) for d, s in zip(dst, src)]
        lat, elapsed = timed_loop([pairs[i % pool] for i in range(spec.max_ops)], spec)
        return result_from(lat, elapsed, spec)


def resident_sources(size: int, pool: int) -> list[np.ndarray]:
    """``pool`` distinct buffers of ``size`` random bytes, every page resident, as the
    stores' values are (:mod:`kvpool.bench.harness`). Not ``bytes(size)``: CPython
    allocates that with calloc, whose large blocks are fresh mappings of the kernel's
    shared zero page, so a sender reading them reads one 4 KiB page from the cache
    (64 x bytes(1 MiB) kept 14 MB resident here); a loopback stream from such sources
    moved 3.7-4.0 GB/s on the 2-core VM of docs/bench.md, against 2.6-2.7 from
    resident data. Arrays of uint8 (the memcpy column copies them, the stream's sender
    sends them)."""
    rng = np.random.default_rng(1)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(pool)]


def stream_sender(port: int) -> None:
    """Sender process: connect to 127.0.0.1:port and send what each header asks for,
    cycling over as many source buffers as the receiver cycles destinations; when the
    header says "asked", each message waits for a one-byte request. Before the first
    message of each header it sends one :data:`_READY` byte, once its sources exist."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payloads: dict[int, list[np.ndarray]] = {}
    head = bytearray(_HEADER.size)
    while True:
        view = memoryview(head)
        while view:
            got = sock.recv_into(view)
            if not got:
                return
            view = view[got:]
        count, size, pool, asked = _HEADER.unpack(head)
        if count == 0:
            return
        if len(payloads.get(size, ())) != pool:
            payloads[size] = resident_sources(size, pool)
        sources = payloads[size]
        sock.sendall(_READY)  # the receiver's clock starts now, not while sources were made
        for i in range(count):
            if asked and not sock.recv(1):
                return
            sock.sendall(sources[i % pool])


class TcpStreamTarget(Target):
    """One loopback TCP stream from a sender process; this process receives.

    Per-message "latency" is the gap between successive message completions in the
    stream (a throughput figure, not a round trip).
    """

    name = "tcp-stream"
    apis = ("copy",)
    asked = False  # each message waits for a request (TcpRoundTripTarget)

    def open(self, cfg: dict) -> dict:
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(30)
        port = listener.getsockname()[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-c",
             f"from kvpool.bench.systems.limits import stream_sender; stream_sender({port})"])
        try:
            self.sock, _ = listener.accept()
        finally:
            listener.close()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a request goes at once
        self.sock.settimeout(120)
        return {"port": port}

    def copy(self, spec: CellSpec) -> CellResult:
        count = int(spec.budget_s * _ASSUMED_GBPS * 1e9 / spec.size)
        count = max(spec.min_ops, min(spec.max_ops, count))
        pool = pool_count(spec.size, 1, spec.working_set)
        bufs = [memoryview(bytearray(spec.size)) for _ in range(pool)]  # zero-filled: resident
        self.sock.sendall(_HEADER.pack(count, spec.size, pool, self.asked))
        if self.sock.recv(1) != _READY:
            raise ConnectionError("the sender closed the stream before its first message")
        lat: list[int] = []
        clock = time.perf_counter_ns
        start = last = clock()
        for i in range(count):
            if self.asked:
                self.sock.sendall(b"?")
            view = bufs[i % pool]
            while view:
                got = self.sock.recv_into(view)
                if not got:
                    raise ConnectionError("sender closed the stream")
                view = view[got:]
            now = clock()
            lat.append(now - last)
            last = now
        return result_from(lat, (clock() - start) / 1e9, spec)

    def close(self) -> None:
        try:
            self.sock.sendall(_HEADER.pack(0, 0, 0, 0))
            self.sock.close()
        except (OSError, AttributeError):
            pass
        if getattr(self, "proc", None):
            wait_or_kill(self.proc, 10)  # the sender exits after the empty header


class TcpRoundTripTarget(TcpStreamTarget):
    """One value per request over one loopback TCP connection: a one-byte request from
    this process, the value back from the sender process (received as by
    :class:`TcpStreamTarget`). A message's "latency" is its round trip. The shape of a
    single get over one connection with nothing else in it: the sender starts only when
    asked, so the copies of one value do not overlap those of the next as in a stream.
    Not a ceiling: both sides block in recv (a wake-up each way), where kvpool polls."""

    name = "tcp-rr"
    asked = True
