"""Redis as an anchor: ``redis-server`` (Debian package) on a free 127.0.0.1 port, redis-py.

Started with persistence off (no RDB, no AOF), so it measures an in-memory key-value
store over one loopback TCP connection. Redis has no zero-copy API: its batch cells use
MSET of memoryviews and MGET followed by a copy into the destination buffers.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import numpy as np

from kvpool.bench.harness import Target, Unavailable, rss_bytes
from kvpool.child import stop_ladder
from kvpool.ports import free_port

INSTALL_HINT = "apt-get install -y redis-server; pip install redis"
_START_DEADLINE_S = 15.0
_DELETE_CHUNK = 512


class RedisTarget(Target):
    """A private ``redis-server`` and one redis-py connection to it."""

    name = "redis"
    apis = ("bytes", "batch")

    def open(self, cfg: dict) -> dict:
        binary = shutil.which(cfg.get("binary") or "redis-server")
        if binary is None:
            raise Unavailable(f"{cfg.get('binary') or 'redis-server'} not found ({INSTALL_HINT})")
        try:
            import redis
        except ImportError as exc:
            raise Unavailable(f"redis-py not installed ({INSTALL_HINT})") from exc
        port = free_port()
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
             "--appendonly", "no", "--protected-mode", "yes", "--loglevel", "warning",
             "--proto-max-bulk-len", "1gb"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.r = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + _START_DEADLINE_S
        while True:
            try:
                self.r.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise Unavailable("redis-server did not start") from None
                time.sleep(0.02)
        return {"version": self.r.info("server")["redis_version"], "port": port}

    def put_bytes(self, key: str, value: bytes) -> None:
        self.r.set(key, value)

    def get_bytes(self, key: str) -> bytes:
        value = self.r.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def batch_put_from(self, keys: list[str], bufs: list[np.ndarray]) -> None:
        self.r.mset({k: memoryview(b) for k, b in zip(keys, bufs)})

    def batch_get_into(self, keys: list[str], bufs: list[np.ndarray]) -> None:
        for key, value, buf in zip(keys, self.r.mget(keys), bufs):
            if value is None or len(value) != buf.nbytes:
                raise KeyError(key)
            buf[:] = np.frombuffer(value, dtype=np.uint8)

    def remove(self, keys: list[str]) -> None:
        for i in range(0, len(keys), _DELETE_CHUNK):
            self.r.delete(*keys[i:i + _DELETE_CHUNK])

    def stats(self) -> dict:
        return {"server_rss_bytes": rss_bytes(self.proc.pid)}

    def close(self) -> None:
        proc = getattr(self, "proc", None)
        if proc:
            stop_ladder(proc, 10)
