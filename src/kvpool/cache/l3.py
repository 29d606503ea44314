"""L3 backends: where pages outlive the process (the kvpool store, or a local disk).

Every backend implements :class:`L3Backend`: three batch calls, one result per key, in
key order. Keys are store key strings (``keys.store_key``); objects are encoded pages
(``codec.encode_page``), opaque to the backend and checked by the reader. L3 is not
tracked in the radix tree but asked live (:class:`kvpool.cache.l3_tier.L3Tier`).

A backend raises only what its medium can really do to a call as a whole
(:data:`BACKEND_ERRORS`): the cache counts it (``l3_errors``) and treats the call as a
miss. Anything else (InvalidParams for a malformed key or buffer list) is a bug of the
caller and propagates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpool.errors import (ErrorCode, LeaseExpired, NoSpace, ObjectNotFound, ObjectNotReady,
                           RpcFailed, TransferFailed)

# What an L3 call may raise when the medium fails (store: a lost read lease, a failed
# transfer, an unreachable master or node, no space, a put still in flight; disk: OSError)
BACKEND_ERRORS = (ObjectNotFound, LeaseExpired, TransferFailed, RpcFailed, NoSpace,
                  ObjectNotReady, OSError)


class L3Backend(Protocol):
    """The one interface the cache reads and writes L3 through.

    ``exists(keys) -> list[bool]``: per key, whether the object is readable now.

    ``get_into(keys, bufs) -> list[int]``: copy object ``keys[i]`` into the writable
    byte buffer ``bufs[i]`` (e.g. a uint8 numpy row of ``HEADER_SIZE + payload`` bytes);
    per key the bytes written, or a negative ErrorCode: OBJECT_NOT_FOUND (absent,
    evicted), BUFFER_OVERFLOW (larger than its buffer), LEASE_EXPIRED / TRANSFER_FAIL
    (gone while read). The bytes beyond the written count are left as they were.

    ``put(keys, blobs) -> list[bool]``: store ``blobs[i]`` under ``keys[i]``; per key
    True when the object is stored now or already was (a page key fixes the page's
    bytes, so an object already there under the key is this page), False when refused
    (no space, too large, transfer failed).

    Each call raises one of :data:`BACKEND_ERRORS` when the medium cannot answer at
    all, and InvalidParams for a malformed call (empty key, buffer count mismatch).

    Optional, for a medium mapped in this process: ``open_views(keys) -> ObjectViews``
    (see :meth:`StoreBackend.open_views`); the cache then copies such objects once,
    straight out of the medium, instead of reading them into staging rows first. And
    ``put_parts(keys, parts) -> list[bool]``: :meth:`put` of objects given as parts
    (header, payload), written without joining them first.
    """

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def get_into(self, keys: Sequence[str], bufs: Sequence) -> list[int]: ...

    def put(self, keys: Sequence[str], blobs: Sequence[bytes]) -> list[bool]: ...


class StoreBackend:
    """L3 on the kvpool store through :class:`kvpool.client.Client` (an :class:`L3Backend`).

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

    def put_parts(self, keys: Sequence[str], parts: Sequence[Sequence]) -> list[bool]:
        """:meth:`put` of objects given as parts (``parts[i]``: C-contiguous buffers,
        e.g. a page header and the page's payload), each written straight from where it
        lies into the store (``Client.batch_put_parts``: nothing joined in memory)."""
        if not keys:
            return []
        codes = self.client.batch_put_parts(list(keys), [list(p) for p in parts])
        return [c in (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS) for c in codes]

    def get_into(self, keys: Sequence[str], bufs: Sequence) -> list[int]:
        """Copy each object straight into its writable buffer (one memcpy out of the
        shared-memory mapping, or one socket read into it); per key the bytes written
        or a negative ErrorCode (Client.batch_get_into)."""
        return list(self.client.batch_get_into(list(keys), list(bufs))) if keys else []

    def open_views(self, keys: Sequence[str]) -> "ObjectViews | None":
        """Zero-copy views of the objects ``keys`` that sit in a segment mapped in this
        process (shared memory on this host, or a segment this process hosts), under a
        read grant each: the master neither evicts nor reuses their bytes until the
        views are closed. One grant query for all keys; objects that are absent or only
        reachable over the network get no view (their grants are returned at once).
        None, with no query, for a client that moves every byte over TCP (``force_tcp``).
        Raises one of :data:`BACKEND_ERRORS` when the master cannot answer.
        """
        if getattr(self.client, "force_tcp", False):
            return None
        handles = self.client.batch_query(list(keys)) if keys else []
        held = [i for i, h in enumerate(handles) if not isinstance(h, int)]  # else an ErrorCode
        try:
            opened = self.client.open_views([handles[i] for i in held])
        except BaseException:
            self.client.release([handles[i] for i in held])
            raise
        self.client.release([handles[i] for i, v in zip(held, opened.views) if v is None])
        views: list = [None] * len(handles)
        for i, v in zip(held, opened.views):
            views[i] = v
        return ObjectViews(views, held, opened)

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Whole objects as bytes, None when absent (for tools and tests; the cache reads
        through :meth:`get_into`)."""
        return list(self.client.batch_get(list(keys))) if keys else []


class ObjectViews:
    """What :meth:`StoreBackend.open_views` hands out: ``views[i]`` is a memoryview of
    object ``keys[i]`` (its whole stored bytes) or None. The bytes are the store's
    memory, not a snapshot (and writable: only ever read them): the reader checks what
    it copied out (page header and checksum) and then calls :meth:`close` once."""

    def __init__(self, views: list, held: list[int], opened):
        self.views = views
        self._held = held  # positions of the keys granted, in the order ``opened`` has them
        self._opened = opened

    def close(self) -> list[bool]:
        """Per key: True when the bytes copied out of its view may be kept (it had a
        view, its segment was not mounted again meanwhile, its read lease had not run
        out); returns the grants. Idempotent after the first call (then all False)."""
        kept = [False] * len(self.views)
        for i, ok in zip(self._held, self._opened.close()):
            kept[i] = ok
        self._held = []
        self.views = [None] * len(self.views)
        return kept
