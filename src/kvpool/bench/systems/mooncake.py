"""Mooncake Store as an anchor (``pip install mooncake-transfer-engine-non-cuda``).

The worker starts its own ``mooncake_master`` (shipped in the wheel) on free 127.0.0.1
ports, with peer-to-peer handshake metadata (``P2PHANDSHAKE``, no metadata server), and
stops it at the end. Two layouts, both over Mooncake's TCP transport:

- ``in_process``: the measuring client contributes the segment itself (Mooncake copies
  locally, no network).
- ``cross_process``: a second process contributes the segment; the measuring client has
  ``global_segment_size=0``, so every byte crosses a loopback TCP connection.

Zero-copy and batch cells use buffers registered with ``register_buffer``; the API is
``put_from`` / ``get_into`` / ``batch_put_from`` / ``batch_get_into`` (pointer, size).
Mooncake's transfer engine listens on the wildcard address; the controller therefore runs
this worker in a private network namespace when the machine allows it.
"""

from __future__ import annotations

import importlib
import os
import shutil
import socket
import subprocess
import sys
import time
from importlib import metadata

import numpy as np

from kvpool.bench.harness import Target, Unavailable, rss_bytes
from kvpool.child import stop_ladder
from kvpool.ports import free_port

INSTALL_HINT = "pip install mooncake-transfer-engine-non-cuda; apt-get install -y libibverbs1"
_START_DEADLINE_S = 30.0
_NOT_FOUND = -704  # Mooncake ErrorCode OBJECT_NOT_FOUND


def master_binary() -> str | None:
    """Path of ``mooncake_master`` (on PATH, or inside the installed package)."""
    found = shutil.which("mooncake_master")
    if found:
        return found
    try:
        import mooncake
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    return path if os.access(path, os.X_OK) else None


def _wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + _START_DEADLINE_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise Unavailable(f"{what} did not start (rc={proc.poll()})") from None
            time.sleep(0.05)


def _new_store(master_addr: str, segment_size: int, local_buffer_size: int):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment_size, local_buffer_size,
                     "tcp", "", master_addr)
    if rc != 0:
        raise Unavailable(f"MooncakeDistributedStore.setup returned {rc}")
    return store


def segment_holder(master_addr: str, segment_size: int) -> None:
    """Process that only contributes a segment; prints ``ready`` and serves until stdin closes."""
    store = _new_store(master_addr, segment_size, 16 << 20)
    print("ready", flush=True)
    sys.stdin.read()
    store.close()


class MooncakeTarget(Target):
    """A ``MooncakeDistributedStore`` client with its own master (and segment holder)."""

    name = "mooncake"

    def open(self, cfg: dict) -> dict:
        try:  # an absent package or library (libibverbs) fails here, not mid-run
            importlib.import_module("mooncake.store")
        except ImportError as exc:
            raise Unavailable(f"mooncake not installed ({INSTALL_HINT}): {exc}") from exc
        binary = shutil.which(cfg["master_binary"]) if cfg.get("master_binary") else master_binary()
        if binary is None:
            raise Unavailable(f"{cfg.get('master_binary') or 'mooncake_master'} not found "
                              f"({INSTALL_HINT})")
        self.children: list[subprocess.Popen] = []
        segment = int(cfg.get("segment_size", 1 << 30))
        port = free_port()
        master = subprocess.Popen(
            [binary, "-rpc_address=127.0.0.1", f"-rpc_port={port}",
             "-metrics_host=127.0.0.1", f"-metrics_port={free_port()}",
             "-enable_http_metadata_server=false", "-rpc_thread_num=4"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.children.append(master)
        _wait_port(port, master, "mooncake_master")
        addr = f"127.0.0.1:{port}"
        layout = cfg.get("layout", "cross_process")
        if layout == "cross_process":
            self._start_holder(addr, segment)
            segment = 0
        self.store = _new_store(addr, segment, int(cfg.get("local_buffer_size", 256 << 20)))
        self.registered: set[int] = set()
        return {"version": metadata.version("mooncake-transfer-engine-non-cuda"), "layout": layout,
                "master": addr}

    def _start_holder(self, addr: str, segment: int) -> None:
        holder = subprocess.Popen(
            [sys.executable, "-c", "from kvpool.bench.systems.mooncake import segment_holder;"
             f" segment_holder({addr!r}, {segment})"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.children.append(holder)
        line = holder.stdout.readline()  # the holder exits (EOF) if setup fails
        if line.strip() != "ready":
            raise Unavailable(f"segment holder failed to start (rc={holder.poll()})")

    def register(self, buf: np.ndarray) -> None:
        ptr = buf.ctypes.data
        if ptr not in self.registered:
            _check(self.store.register_buffer(ptr, buf.nbytes), "register_buffer")
            self.registered.add(ptr)

    def unregister(self, buf: np.ndarray) -> None:
        ptr = buf.ctypes.data
        if ptr in self.registered:
            _check(self.store.unregister_buffer(ptr), "unregister_buffer")
            self.registered.discard(ptr)

    def put_bytes(self, key: str, value: bytes) -> None:
        _check(self.store.put(key, value), "put")

    def get_bytes(self, key: str) -> bytes:
        value = self.store.get(key)
        if not value:
            raise KeyError(key)
        return value

    def put_from(self, key: str, buf: np.ndarray) -> None:
        _check(self.store.put_from(key, buf.ctypes.data, buf.nbytes), "put_from")

    def get_into(self, key: str, buf: np.ndarray) -> int:
        n = self.store.get_into(key, buf.ctypes.data, buf.nbytes)
        return _check(n, "get_into")

    def batch_put_from(self, keys: list[str], bufs: list[np.ndarray]) -> None:
        rcs = self.store.batch_put_from(keys, [b.ctypes.data for b in bufs],
                                        [b.nbytes for b in bufs])
        for rc in rcs:
            _check(rc, "batch_put_from")

    def batch_get_into(self, keys: list[str], bufs: list[np.ndarray]) -> None:
        got = self.store.batch_get_into(keys, [b.ctypes.data for b in bufs],
                                        [b.nbytes for b in bufs])
        for n in got:
            _check(n, "batch_get_into")

    def remove(self, keys: list[str]) -> None:
        for rc in self.store.batch_remove(keys, True):
            if rc != _NOT_FOUND:
                _check(rc, "batch_remove")

    def stats(self) -> dict:
        return {f"{'master' if i == 0 else 'segment_holder'}_rss_bytes": rss_bytes(p.pid)
                for i, p in enumerate(self.children) if p.poll() is None}

    def close(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            store.close()
        for proc in reversed(getattr(self, "children", [])):
            # the holder closes its store and exits on EOF; the master is terminated
            stop_ladder(proc, 5, close_stdin=True)


def _check(rc: int, what: str) -> int:
    if rc < 0:
        raise RuntimeError(f"mooncake {what} returned {rc}")
    return rc
