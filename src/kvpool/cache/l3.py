"""L3 backends: where pages outlive the process (the kvpool store, or a local disk).

Every backend has the same three batch calls, one result per key, in key order:

    exists(keys) -> list[bool]          # is the object there now
    put(keys, blobs) -> list[bool]      # True: stored, or was already there
    get(keys) -> list[bytes | None]     # None: not there (evicted, expired, failed)

and optionally, for loads without intermediate copies:

    get_into(keys, bufs) -> list[int]   # bytes written into bufs[i], or < 0: not read

Keys are store key strings (``keys.store_key``); blobs are encoded pages
(``codec.encode_page``), opaque to the backend. A backend may raise a
:class:`~kvpool.errors.KVPoolError` when it cannot answer at all; the cache then treats
the whole call as a miss. L3 is not tracked in the radix tree but asked live.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvpool.errors import ErrorCode


class L3Backend(Protocol):
    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def put(self, keys: Sequence[str], blobs: Sequence[bytes]) -> list[bool]: ...

    def get(self, keys: Sequence[str]) -> list[bytes | None]: ...


def present_prefix(flags: Sequence[bool]) -> int:
    """Length of the leading run of True in ``flags`` (the usable prefix of a chain)."""
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)


class StoreBackend:
    """L3 on the kvpool store through :class:`kvpool.client.Client`.

    ``put`` counts OBJECT_ALREADY_EXISTS as stored: a page key fixes the page's bytes,
    so an existing object under that key already is this page (and is still checked
    against its header on every load).
    """

    def __init__(self, client):
        self.client = client

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return list(self.client.batch_is_exist(list(keys))) if keys else []

    def put(self, keys: Sequence[str], blobs: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        codes = self.client.batch_put(list(keys), list(blobs))
        return [c in (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS) for c in codes]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return list(self.client.batch_get(list(keys))) if keys else []

    def get_into(self, keys: Sequence[str], bufs: Sequence) -> list[int]:
        """Copy each object straight into its writable buffer (one memcpy out of the
        shared-memory mapping, or one socket read into it); per key the bytes written
        or a negative ErrorCode (Client.batch_get_into)."""
        return list(self.client.batch_get_into(list(keys), list(bufs))) if keys else []


def read_objects_into(backend, names: Sequence[str], raw: np.ndarray) -> list[memoryview | str]:
    """Read stored objects ``names[j]`` straight into the rows ``raw[j]``.

    Args:
        backend: an L3 backend with ``get_into``.
        names: store keys, one object per row.
        raw: writable uint8 array ``[len(names), row_bytes]``.
    Returns: per object, a view of the bytes it occupies in its row (as stored: header,
    then payload; checked by the caller, e.g. PageStore), or why it was not read:
    "vanished" (gone, lease expired, transfer failed) or "length" (larger than its row).
    """
    sizes = backend.get_into(names, [raw[j] for j in range(len(names))])
    return [memoryview(raw[j])[:size] if size >= 0 else
            "length" if size == ErrorCode.BUFFER_OVERFLOW else "vanished"
            for j, size in enumerate(sizes)]
