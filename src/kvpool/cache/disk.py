"""L3 on a local directory: one file per stored object, bounded by a byte budget.

Files are written to a temporary name in the same directory and renamed into place
(``os.replace`` is atomic on POSIX), so a reader never sees half a page and a crash
leaves at most a temporary file, removed at the next start. The directory survives
restarts: at start the backend lists it and rebuilds its LRU order from file mtimes;
a read refreshes the mtime. Over ``max_bytes``, least recently used files are deleted.
The LRU bookkeeping is per process: one process should own a directory at a time
(another one's files still read correctly, they are only not counted).
"""

from __future__ import annotations

import hashlib
import os
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvpool.errors import ErrorCode, InvalidParams

_TMP_PREFIX = ".tmp-"


class DiskBackend:
    """Pages as files under ``path`` (an :class:`~kvpool.cache.l3.L3Backend`).

    Raises OSError when the directory cannot be read or written as a whole (the cache
    counts it as an L3 error); a file that vanished is OBJECT_NOT_FOUND, not an error.

    Args:
        path: directory (created if missing).
        max_bytes: budget for the sum of file sizes (> 0); beyond it LRU files go.
    """

    def __init__(self, path: str | os.PathLike, max_bytes: int):
        if max_bytes <= 0:
            raise InvalidParams(f"disk budget must be > 0 bytes, got {max_bytes}")
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.used_bytes = 0
        self.evictions = 0
        self._lru: OrderedDict[Path, int] = OrderedDict()  # file -> size, oldest first
        self._lock = threading.Lock()  # the cache's writer and prefetch threads share us
        self._scan()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [self._file(k).is_file() for k in keys]

    def put(self, keys: Sequence[str], blobs: Sequence[bytes]) -> list[bool]:
        return [self._put_one(k, b) for k, b in zip(keys, blobs, strict=True)]

    def get_into(self, keys: Sequence[str], bufs: Sequence) -> list[int]:
        """Read each file into its writable buffer; per key the bytes read, or
        OBJECT_NOT_FOUND / BUFFER_OVERFLOW (file larger than the buffer)."""
        return [self._read_into(k, b) for k, b in zip(keys, bufs, strict=True)]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Whole files as bytes, None when absent (for tools and tests; the cache reads
        through :meth:`get_into`)."""
        return [self._get_one(k) for k in keys]

    def _file(self, key: str) -> Path:
        if not key:
            raise InvalidParams("empty key")
        shard = hashlib.blake2b(key.encode(), digest_size=1).hexdigest()
        return self.root / shard / urllib.parse.quote(key, safe="")

    def _put_one(self, key: str, blob: bytes) -> bool:
        path = self._file(key)
        if path.is_file():
            self._used(path, path.stat().st_size)
            return True
        if len(blob) > self.max_bytes:
            return False
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{_TMP_PREFIX}{os.getpid()}-{path.name}")
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
        self._used(path, len(blob))
        self._shrink()
        return True

    def _get_one(self, key: str) -> bytes | None:
        path = self._file(key)
        try:
            data = path.read_bytes()
            os.utime(path)
        except FileNotFoundError:
            self._forget(path)
            return None
        self._used(path, len(data))
        return data

    def _read_into(self, key: str, buf) -> int:
        path = self._file(key)
        view = memoryview(buf).cast("B")
        try:
            with open(path, "rb", buffering=0) as f:  # one read(2) into the row
                size = os.fstat(f.fileno()).st_size
                if size > view.nbytes:
                    return int(ErrorCode.BUFFER_OVERFLOW)
                n = f.readinto(view[:size])
            os.utime(path)
        except FileNotFoundError:
            self._forget(path)
            return int(ErrorCode.OBJECT_NOT_FOUND)
        self._used(path, size)
        return n

    def _used(self, path: Path, size: int) -> None:
        """Count ``path`` (once) and make it the most recently used."""
        with self._lock:
            if path not in self._lru:
                self._lru[path] = size
                self.used_bytes += size
            self._lru.move_to_end(path)

    def _forget(self, path: Path) -> None:
        with self._lock:
            size = self._lru.pop(path, None)
            if size is not None:
                self.used_bytes -= size

    def _shrink(self) -> None:
        """Delete least recently used files until the budget holds."""
        while True:
            with self._lock:
                if self.used_bytes <= self.max_bytes or not self._lru:
                    return
                path, size = self._lru.popitem(last=False)
                self.used_bytes -= size
                self.evictions += 1
            path.unlink(missing_ok=True)

    def _scan(self) -> None:
        found = []
        for shard in self.root.iterdir():
            if not shard.is_dir():
                continue
            for entry in os.scandir(shard):
                if entry.name.startswith(_TMP_PREFIX):
                    os.unlink(entry.path)  # left by a writer that died mid-page
                    continue
                st = entry.stat()
                found.append((st.st_mtime_ns, Path(entry.path), st.st_size))
        for _, path, size in sorted(found):
            self._used(path, size)
        self._shrink()
