"""Pages in L3: page keys to store objects, headers on write, checks on read.

A page is stored as one object (``object_layout="page"``) or as several (``"kv"``: the K
half and the V half, split along dim 1 of the page shape, as an engine that keeps K and V
apart would store them). A page counts as present only when every object of it is (K17),
and each object's header binds it to its own part, so a K object cannot pass for a V one.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from kvpool.cache.codec import (HEADER_SIZE, LengthMismatch, PageFormatError, PageHeader,
                                TruncatedPage, check_header, decode_page, encode_header)
from kvpool.cache.keys import store_key
from kvpool.cache.l3 import L3Backend
from kvpool.cache.viewcopy import PageCopy
from kvpool.errors import ErrorCode, InvalidParams

OBJECT_LAYOUTS = {"page": ("",), "kv": ("k", "v")}


@dataclasses.dataclass
class ReadResult:
    """Outcome of :meth:`PageStore.read_into`: ``good`` leading pages landed and passed
    their check (``nbytes`` payload bytes); ``reason`` says why the next one did not
    ("vanished", "length", or a PageFormatError reason), or None."""

    good: int
    reason: str | None = None
    nbytes: int = 0


class PageStore:
    """Read and write whole pages of one namespace through an L3 backend.

    Args:
        backend: the L3 backend (exists/get_into/put by store key).
        ns_digest: the namespace digest (32 bytes) every header must carry.
        page_size: tokens per page.
        page_shape: shape of one page tensor; with ``object_layout="kv"`` dim 1 must be 2.
        dtype: torch dtype of a page.
        object_layout: "page" or "kv" (see module doc).
        part: store each page as the one object ``kvp/<hex>/<part>`` instead (the window
            page or state checkpoint of a hybrid model: ``kvpool.cache.hybrid``); its
            header binds it to that part, so it can never pass for a KV page.
    """

    def __init__(self, backend: L3Backend, ns_digest: bytes, page_size: int,
                 page_shape: Sequence[int], dtype: torch.dtype, object_layout: str = "page",
                 part: str = ""):
        if object_layout not in OBJECT_LAYOUTS:
            raise InvalidParams(f"object_layout must be one of {sorted(OBJECT_LAYOUTS)}")
        if object_layout == "kv" and (len(page_shape) < 2 or page_shape[1] != 2):
            raise InvalidParams("object_layout 'kv' needs a page shape with K/V at dim 1")
        self.backend = backend
        self.ns_digest = ns_digest
        self.page_size = page_size
        self.parts = (part,) if part else OBJECT_LAYOUTS[object_layout]
        self.part_bytes = (int(np.prod(page_shape)) * torch.empty((), dtype=dtype).element_size()
                           // len(self.parts))
        self.page_shape, self.dtype = tuple(page_shape), dtype

    def object_keys(self, key: bytes) -> list[str]:
        """Store keys of every object of page ``key``."""
        return [store_key(key, part) for part in self.parts]

    def present(self, keys: Sequence[bytes]) -> int:
        """How many leading pages of ``keys`` have every object in L3 now."""
        flags = self.backend.exists([k for key in keys for k in self.object_keys(key)])
        return _leading(_whole_pages(flags, len(self.parts)))

    def missing(self, keys: Sequence[bytes]) -> list[bool]:
        """Per page: True when some object of it is absent from L3."""
        flags = self.backend.exists([k for key in keys for k in self.object_keys(key)])
        return [not whole for whole in _whole_pages(flags, len(self.parts))]

    def write(self, keys: Sequence[bytes], indices: Sequence[int],
              pages: Sequence[torch.Tensor]) -> tuple[list[bool], int]:
        """Store pages (``pages[j]`` is page number ``indices[j]`` with key ``keys[j]``).
        With a backend that takes parts (``put_parts``), each object goes as its header
        and its payload from where it lies (for a contiguous host page, one copy: into
        the store; a "kv" half or a device page is made a contiguous host copy first);
        else as one joined blob.

        Returns (per page: every object stored or already there, bytes written).
        """
        names, objects = [], []
        for key, index, page in zip(keys, indices, pages, strict=True):
            for part, payload in zip(self.parts, self._split(page)):
                names.append(store_key(key, part))
                header = self._header(key, part, index)
                objects.append([encode_header(header, [payload]), payload])
        put_parts = getattr(self.backend, "put_parts", None)
        if not names:
            stored = []
        elif put_parts is not None:
            stored = put_parts(names, objects)
        else:
            stored = self.backend.put(names, [b"".join(o) for o in objects])
        return _whole_pages(stored, len(self.parts)), sum(HEADER_SIZE + self.part_bytes for s in stored if s)

    @property
    def row_bytes(self) -> int:
        """Bytes of one page's staging row: its objects, each header then payload."""
        return len(self.parts) * (HEADER_SIZE + self.part_bytes)

    def staging(self, n: int) -> np.ndarray:
        """New staging rows for :meth:`read_into` of ``n`` pages: uint8
        ``[n, objects per page, HEADER_SIZE + part_bytes]``."""
        return np.empty((n, len(self.parts), HEADER_SIZE + self.part_bytes), dtype=np.uint8)

    def read_into(self, keys: Sequence[bytes], first_index: int, raw: np.ndarray) -> ReadResult:
        """Read pages ``keys`` (page numbers from ``first_index``) straight into the rows
        of ``raw`` and check them there.

        ``raw``: writable uint8 ``[>= len(keys), objects per page, HEADER_SIZE +
        part_bytes]`` (:meth:`staging`); afterwards ``raw[j, p]`` holds object ``p`` of
        page ``j`` as stored, header then payload (no copy of the payload is made; read
        the pages with :meth:`pages`). Stops at the first page with an object missing
        ("vanished"), larger than its row ("length") or failing its header check.
        """
        n = len(self.parts)
        rows = [raw[j, p] for j in range(len(keys)) for p in range(n)]
        sizes = self.backend.get_into([k for key in keys for k in self.object_keys(key)], rows)
        for i, size in enumerate(sizes):
            j, part = divmod(i, n)
            if size < 0:
                return self.result(j, "length" if size == ErrorCode.BUFFER_OVERFLOW
                                    else "vanished")
            try:
                decode_page(memoryview(rows[i])[:size],
                            self._header(keys[j], self.parts[part], first_index + j))
            except PageFormatError as exc:
                return self.result(j, exc.reason)
        return self.result(len(keys), None)

    def open_pages(self, keys: Sequence[bytes]) -> "OpenPages | None":
        """Views of the leading pages of ``keys`` whose objects all sit in memory mapped
        in this process; None when the backend has no views (``open_views``, or it
        returned None: a client over TCP only). The run
        stops at the first page with an object that has no view (absent, or only over
        the network: read it and those after it through :meth:`read_into`). Nothing is
        checked yet (:meth:`copy_of` does, page by page). Close the result once its pages
        are copied. Raises what the backend's ``open_views`` raises
        (:data:`~kvpool.cache.l3.BACKEND_ERRORS`)."""
        open_views = getattr(self.backend, "open_views", None)
        if open_views is None:
            return None
        n = len(self.parts)
        opened = open_views([k for key in keys for k in self.object_keys(key)])
        if opened is None:
            return None
        pages = OpenPages(opened, n)
        for j in range(len(keys)):
            views = opened.views[j * n:(j + 1) * n]
            if any(v is None for v in views):
                break
            pages.views.append(views)
        return pages

    def copy_of(self, views: list[memoryview], key: bytes, index: int, page: torch.Tensor) -> PageCopy:
        """How to copy page ``key`` (page number ``index``; ``views``: its objects as
        stored, :meth:`open_pages`) into ``page`` (``page_shape``, this store's dtype,
        any strides, any device), once its headers are checked. Raises LengthMismatch
        (an object larger than a page), the header's PageFormatError, or TruncatedPage
        (shorter than its header says)."""
        checksums = [self._checked(v, key, part, index) for part, v in zip(self.parts, views)]
        payloads = [v[HEADER_SIZE:] for v in views]
        if len(self.parts) == 1:
            return PageCopy([page], [self._tensor(payloads[0], self.page_shape)], payloads, checksums)
        half = (self.page_shape[0], *self.page_shape[2:])
        return PageCopy([page.select(1, p) for p in range(len(self.parts))],
                        [self._tensor(v, half) for v in payloads], payloads, checksums)

    def _checked(self, view: memoryview, key: bytes, part: str, index: int) -> int:
        """The payload checksum the header of ``view`` (one object as stored) records.
        Raises LengthMismatch ("length": larger than a page), the header's
        PageFormatError, or TruncatedPage (shorter than its header says)."""
        if len(view) > HEADER_SIZE + self.part_bytes:
            raise LengthMismatch(f"object of {len(view)} bytes is larger than a page")
        checksum = check_header(view[:HEADER_SIZE], self._header(key, part, index))
        if len(view) < HEADER_SIZE + self.part_bytes:
            raise TruncatedPage(f"object of {len(view)} bytes is shorter than its header says")
        return checksum

    def _tensor(self, payload: memoryview, shape: tuple[int, ...]) -> torch.Tensor:
        # a store view is writable memory (torch would warn, once, about a read-only one);
        # the tensor is only ever read from
        return torch.frombuffer(payload, dtype=self.dtype).view(shape)

    def pages(self, raw: np.ndarray, n: int, page_shape: Sequence[int], dtype: torch.dtype
              ) -> torch.Tensor:
        """The first ``n`` pages of staging rows ``raw`` as a tensor ``[n, *page_shape]``
        of ``dtype``: a strided view of the payloads, no copy. With the "kv" layout the
        K and V objects are the two halves of dim 1 of the page shape."""
        payload = torch.from_numpy(raw[:n])[:, :, HEADER_SIZE:].view(dtype)
        if len(self.parts) == 1:
            return payload[:, 0].view(n, *page_shape)
        halves = payload.view(n, len(self.parts), page_shape[0], *page_shape[2:])
        return halves.transpose(1, 2)

    def result(self, good: int, reason: str | None) -> ReadResult:
        """The ReadResult of ``good`` leading pages and ``reason`` for the next one."""
        return ReadResult(good, reason, good * len(self.parts) * self.part_bytes)

    def _header(self, key: bytes, part: str, index: int) -> PageHeader:
        """The header object ``part`` of page ``key`` (page number ``index``) carries."""
        return PageHeader(self.ns_digest, object_digest(key, part), index, self.page_size,
                          self.part_bytes)

    def _split(self, page: torch.Tensor) -> list[np.ndarray]:
        if len(self.parts) == 1:
            return [_as_bytes(page)]
        return [_as_bytes(page.select(1, i)) for i in range(len(self.parts))]


class OpenPages:
    """What :meth:`PageStore.open_pages` returns: ``views[j]``, the views of the objects
    of leading page ``j`` as stored (header, then payload). Close it once."""

    def __init__(self, opened, per_page: int):
        self._opened, self._per_page = opened, per_page
        self.views: list[list[memoryview]] = []

    def close(self) -> int:
        """Return the grants; how many leading pages may be kept (every object's
        segment still mounted as when viewed and its read lease not run out)."""
        kept = self._opened.close()[:len(self.views) * self._per_page]
        return _leading(_whole_pages(kept, self._per_page))


def _whole_pages(flags: Sequence[bool], per_page: int) -> list[bool]:
    """Per page: whether every one of its ``per_page`` objects' flags is set (K17)."""
    return [all(flags[i:i + per_page]) for i in range(0, len(flags), per_page)]


def _leading(whole: list[bool]) -> int:
    """How many leading entries of ``whole`` are True."""
    return whole.index(False) if False in whole else len(whole)


def object_digest(key: bytes, part: str) -> bytes:
    """What an object's header binds it to: the page key, or SHA-256(key || "/" || part)."""
    return key if not part else hashlib.sha256(key + b"/" + part.encode()).digest()


def _as_bytes(page: torch.Tensor) -> np.ndarray:
    """The raw bytes of a tensor (any dtype or device) as a contiguous uint8 array."""
    return page.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
