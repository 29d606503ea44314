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

from kvpool.cache.codec import PageFormatError, PageHeader, decode_page, encode_page
from kvpool.cache.keys import store_key
from kvpool.cache.l3 import L3Backend, present_prefix, read_objects_into
from kvpool.errors import InvalidParams

OBJECT_LAYOUTS = {"page": ("",), "kv": ("k", "v")}


@dataclasses.dataclass
class ReadResult:
    """Outcome of :meth:`PageStore.read`: ``good`` leading pages were copied; ``reason``
    says why the next one was not ("vanished", or a PageFormatError reason), or None."""

    good: int
    reason: str | None = None
    nbytes: int = 0


class PageStore:
    """Read and write whole pages of one namespace through an L3 backend.

    Args:
        backend: the L3 backend (exists/put/get by store key).
        ns_digest: the namespace digest (32 bytes) every header must carry.
        page_size: tokens per page.
        page_shape: shape of one page tensor; with ``object_layout="kv"`` dim 1 must be 2.
        dtype: torch dtype of a page.
        object_layout: "page" or "kv" (see module doc).
    """

    def __init__(self, backend: L3Backend, ns_digest: bytes, page_size: int,
                 page_shape: Sequence[int], dtype: torch.dtype, object_layout: str = "page"):
        if object_layout not in OBJECT_LAYOUTS:
            raise InvalidParams(f"object_layout must be one of {sorted(OBJECT_LAYOUTS)}")
        if object_layout == "kv" and (len(page_shape) < 2 or page_shape[1] != 2):
            raise InvalidParams("object_layout 'kv' needs a page shape with K/V at dim 1")
        self.backend = backend
        self.ns_digest = ns_digest
        self.page_size = page_size
        self.parts = OBJECT_LAYOUTS[object_layout]
        self.part_bytes = (int(np.prod(page_shape)) * torch.empty((), dtype=dtype).element_size()
                           // len(self.parts))

    def object_keys(self, key: bytes) -> list[str]:
        """Store keys of every object of page ``key``."""
        return [store_key(key, part) for part in self.parts]

    def present(self, keys: Sequence[bytes]) -> int:
        """How many leading pages of ``keys`` have every object in L3 now."""
        flags = self.backend.exists([k for key in keys for k in self.object_keys(key)])
        n = len(self.parts)
        return present_prefix([all(flags[i * n:(i + 1) * n]) for i in range(len(keys))])

    def missing(self, keys: Sequence[bytes]) -> list[bool]:
        """Per page: True when some object of it is absent from L3."""
        flags = self.backend.exists([k for key in keys for k in self.object_keys(key)])
        n = len(self.parts)
        return [not all(flags[i * n:(i + 1) * n]) for i in range(len(keys))]

    def write(self, keys: Sequence[bytes], indices: Sequence[int],
              pages: Sequence[torch.Tensor]) -> tuple[list[bool], int]:
        """Store pages (``pages[j]`` is page number ``indices[j]`` with key ``keys[j]``).

        Returns (per page: every object stored or already there, bytes written).
        """
        names, blobs = [], []
        for key, index, page in zip(keys, indices, pages, strict=True):
            for part, payload in zip(self.parts, self._split(page)):
                names.append(store_key(key, part))
                blobs.append(encode_page(self._header(key, part, index), payload))
        stored = self.backend.put(names, blobs) if names else []
        n = len(self.parts)
        ok = [all(stored[i * n:(i + 1) * n]) for i in range(len(keys))]
        return ok, sum(len(b) for b, s in zip(blobs, stored) if s)

    def read(self, keys: Sequence[bytes], first_index: int, out: torch.Tensor) -> ReadResult:
        """Read pages ``keys`` (page numbers from ``first_index``) into ``out[j]``.

        Stops at the first page with an object missing or failing its header check.
        """
        blobs = self.backend.get([k for key in keys for k in self.object_keys(key)])
        payloads, reason = self._check(["vanished" if b is None else b for b in blobs],
                                       keys, first_index)
        n = len(self.parts)
        good = len(payloads) // n
        for j in range(good):
            self._join(payloads[j * n:(j + 1) * n], out[j])
        return ReadResult(good, reason, good * n * self.part_bytes)

    def read_into(self, keys: Sequence[bytes], first_index: int, raw: np.ndarray) -> ReadResult:
        """Read pages ``keys`` straight into the rows ``raw[j]`` and check them there.

        For a backend with ``get_into`` and ``object_layout="page"`` only. ``raw``: writable
        uint8 ``[len(keys), HEADER_SIZE + part_bytes]``; after the call row j holds page j
        as stored, header then payload (no copy of the payload is made). Stops at the
        first page missing or failing its header check ("length": larger than its row).
        Raises InvalidParams for the "kv" layout.
        """
        if len(self.parts) != 1:
            raise InvalidParams("read_into needs object_layout 'page' (one object per page)")
        objects = read_objects_into(self.backend, [store_key(key) for key in keys], raw)
        payloads, reason = self._check(objects, keys, first_index)
        return ReadResult(len(payloads), reason, len(payloads) * self.part_bytes)

    def _check(self, objects: Sequence, keys: Sequence[bytes], first_index: int
               ) -> tuple[list[memoryview], str | None]:
        """Check objects (in :meth:`object_keys` order per page; each stored bytes, or a
        reason string it was not read) against the headers they must carry. Returns (the
        payload views of the leading objects that passed, why the next did not or None)."""
        payloads, n = [], len(self.parts)
        for i, obj in enumerate(objects):
            if isinstance(obj, str):
                return payloads, obj
            j, part = divmod(i, n)
            try:
                payloads.append(decode_page(obj, self._header(keys[j], self.parts[part],
                                                              first_index + j)))
            except PageFormatError as exc:
                return payloads, exc.reason
        return payloads, None

    def _header(self, key: bytes, part: str, index: int) -> PageHeader:
        """The header object ``part`` of page ``key`` (page number ``index``) carries."""
        return PageHeader(self.ns_digest, _object_digest(key, part), index, self.page_size,
                          self.part_bytes)

    def _split(self, page: torch.Tensor) -> list[np.ndarray]:
        if len(self.parts) == 1:
            return [_as_bytes(page)]
        return [_as_bytes(page.select(1, i)) for i in range(len(self.parts))]

    def _join(self, payloads: list[memoryview], dst: torch.Tensor) -> None:
        if len(payloads) == 1:
            _copy_into(payloads[0], dst)
            return
        for i, payload in enumerate(payloads):
            half = torch.empty_like(dst.select(1, i), device="cpu")
            _copy_into(payload, half)
            dst.select(1, i).copy_(half)


def _object_digest(key: bytes, part: str) -> bytes:
    """What an object's header binds it to: the page key, or SHA-256(key || "/" || part)."""
    return key if not part else hashlib.sha256(key + b"/" + part.encode()).digest()


def _as_bytes(page: torch.Tensor) -> np.ndarray:
    """The raw bytes of a tensor (any dtype or device) as a contiguous uint8 array."""
    return page.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()


def _copy_into(payload: memoryview, dst: torch.Tensor) -> None:
    """Copy raw bytes into the contiguous tensor ``dst`` (same byte count)."""
    src = np.frombuffer(payload, dtype=np.uint8)
    flat = dst.reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        np.copyto(flat.numpy(), src)
    else:
        flat.copy_(torch.from_numpy(src.copy()))
