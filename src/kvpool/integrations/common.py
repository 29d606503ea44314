"""Glue shared by engine integrations: page keys from an engine's own block hashes, and
staging rows that hold stored pages (kvpool's page header + payload) for batch I/O.

An engine that already names its KV blocks by a chained hash (vLLM's block hashes,
SGLang's page hashes) keeps those names; kvpool binds each to a namespace with
``page_key = SHA-256(namespace digest || engine hash)`` so that blocks of another model,
dtype, layout, rank, tenant salt or LoRA adapter never share a store key (K13). Every
stored page carries kvpool's 128-byte header (:mod:`kvpool.cache.codec`), checked on
load: a page that does not match is a load error, never used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from kvpool.cache.codec import HEADER_SIZE, PageFormatError, PageHeader, decode_page, seal_page
from kvpool.cache.keys import store_key


def engine_page_key(ns_digest: bytes, engine_hash: bytes) -> bytes:
    """32-byte page key of an engine block hash inside a namespace (SHA-256)."""
    return hashlib.sha256(ns_digest + bytes(engine_hash)).digest()


def engine_store_keys(ns_digest: bytes, engine_hashes: Sequence[bytes]) -> list[str]:
    """Store object names (``"kvp/<hex>"``) of engine block hashes in a namespace."""
    return [store_key(engine_page_key(ns_digest, h)) for h in engine_hashes]


class PageRows:
    """``n`` stored pages side by side in one host buffer, for a batch put or get.

    Row ``i`` is ``HEADER_SIZE`` header bytes then the payload: a C-contiguous tensor
    of ``page_shape`` in ``dtype`` (:meth:`payload`, all rows at once: shape
    ``[n, *page_shape]``). Writers gather into the payload and :meth:`seal` the headers;
    readers fill whole rows (:meth:`rows`) and :meth:`check` them. ``staging``: a
    ``[>= n, row_bytes]`` uint8 tensor to use instead of a new buffer (a worker keeps
    one, touched once, because faulting in ~100 MB of fresh pages per step costs more
    than the copy itself).
    """

    def __init__(self, n: int, page_shape: Sequence[int], dtype: torch.dtype,
                 staging: torch.Tensor | None = None):
        self.page_shape = tuple(page_shape)
        self.dtype = dtype
        self.payload_len = int(torch.Size(self.page_shape).numel()) * dtype.itemsize
        self.row_bytes = HEADER_SIZE + self.payload_len
        if staging is not None and staging.shape[0] >= n and staging.shape[1] == self.row_bytes:
            self.buf = staging[:n]  # reuse: its pages are mapped already (no page faults)
        else:
            self.buf = torch.empty((n, self.row_bytes), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.buf.shape[0]

    def payload(self) -> torch.Tensor:
        """The payloads as one tensor ``[n, *page_shape]`` (a view: writes land in rows)."""
        return self.buf[:, HEADER_SIZE:].view(self.dtype).view(len(self), *self.page_shape)

    def rows(self) -> list[memoryview]:
        """One writable byte view per row (for ``batch_put_from`` / ``batch_get_into``)."""
        flat = memoryview(self.buf.numpy()).cast("B")
        return [flat[i * self.row_bytes:(i + 1) * self.row_bytes] for i in range(len(self))]

    def header(self, ns_digest: bytes, page_key: bytes, index: int, tokens: int) -> PageHeader:
        return PageHeader(ns_digest, page_key, index, tokens, self.payload_len)

    def seal(self, i: int, header: PageHeader) -> None:
        """Write row ``i``'s header (checksum over the payload already in place)."""
        seal_page(self.buf[i].numpy(), header)

    def check(self, i: int, header: PageHeader, nbytes: int) -> str:
        """"" when row ``i`` (``nbytes`` read into it, < 0 = not read) is the page
        ``header`` describes, else the reason it must not be used ("missing",
        "truncated", "checksum", "namespace", ...)."""
        if nbytes < 0:
            return "missing"
        if nbytes != self.row_bytes:
            return "length"
        try:
            decode_page(self.buf[i].numpy(), header)
        except PageFormatError as exc:
            return exc.reason
        return ""
