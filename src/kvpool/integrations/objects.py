"""Checked page objects of the engine integrations: store keys from an engine's own
block hashes, staging rows for batch I/O, and pages written and read in place.

Keys: an engine that already names its KV blocks by a chained hash (vLLM's block
hashes) keeps those names; kvpool binds each to a namespace with
``page_key = SHA-256(namespace digest || engine hash)`` so that blocks of another model,
dtype, layout, rank, tenant salt or LoRA adapter never share a store key (K13).

Every stored page is one object: kvpool's 128-byte page header
(:mod:`kvpool.cache.codec`) followed by the page's bytes, checked on load; a page that
does not match is a load error (a miss), never used. Two ways to move them:

- :class:`PageRows`: ``n`` whole pages side by side in one host buffer, for
  ``batch_put_from`` / ``batch_get_into`` (vLLM's connector gathers blocks into them).
- :class:`PageObjects`: pages whose bytes lie in several regions of memory the engine
  owns (SGLang's host pool, LMCache's memory objects). Writes send the header and each
  region straight from where they lie (``Client.batch_put_parts``); reads copy the
  header into a small buffer and each region straight into its place
  (``Client.batch_read_ranges``), then check the header and the payload checksum there.
  A page that fails its check is counted and removed from the store so that a writer
  can store it again. A page whose regions are not the size its header gives is the
  caller's mismatch: not written, not read, and the stored page is left alone.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from kvpool.cache.codec import (HEADER_SIZE, PageFormatError, PageHeader, check_parts,
                                check_stored_size, decode_page, encode_header, seal_page)
from kvpool.cache.keys import store_key
from kvpool.client import Client, ReadHandle
from kvpool.errors import ErrorCode, KVPoolError, RpcFailed, code_name

log = logging.getLogger(__name__)

STORED = (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS)
T = TypeVar("T")


def engine_page_key(ns_digest: bytes, engine_hash: bytes) -> bytes:
    """32-byte page key of an engine block hash inside a namespace (SHA-256)."""
    return hashlib.sha256(ns_digest + bytes(engine_hash)).digest()


def engine_store_keys(ns_digest: bytes, engine_hashes: Sequence[bytes]) -> list[str]:
    """Store object names (``"kvp/<hex>"``) of engine block hashes in a namespace."""
    return [store_key(engine_page_key(ns_digest, h)) for h in engine_hashes]


def unread_reason(code: int) -> str:
    """Why a page was not read, from the negative ErrorCode its query or read gave, as a
    metric label: "missing" (OBJECT_NOT_FOUND: evicted, never stored), else the code's
    name in lower case ("transfer_fail": a node that did not answer, "lease_expired",
    "replica_is_not_ready", ...), so a hung node is not counted as an eviction."""
    return "missing" if code == ErrorCode.OBJECT_NOT_FOUND else code_name(code).lower()


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
            return unread_reason(nbytes)
        if nbytes != self.row_bytes:
            return "length"
        try:
            decode_page(self.buf[i].numpy(), header)
        except PageFormatError as exc:
            return exc.reason
        return ""


class PageObjects:
    """Batch calls on checked page objects through one :class:`Client`.

    Every call takes per object its store key, the :class:`PageHeader` it must carry
    and its payload regions (buffers; writable ones for reads) in payload order.
    Every call answers per object, in order; a store that cannot answer at all
    (master down, RPC failure) gives all-False and a warning, never an exception.
    Once the master has not answered (RpcFailed, after the client's ``timeout_s``),
    calls answer all-False at once for ``retry_s`` seconds (said once per outage, and
    again when it answers): the engine's prefetch and backup threads would otherwise
    wait ``timeout_s`` in every call to a master that is stopped.

    Attributes:
        rejects: Counter of pages refused on load, by PageFormatError reason
            ("checksum", "namespace", "length", ...).
    """

    def __init__(self, client: Client, replica_num: int = 1, retry_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.client = client
        self.replica_num = replica_num
        self.retry_s, self.clock = retry_s, clock
        self.rejects: collections.Counter[str] = collections.Counter()
        self._down_since: float | None = None  # when the master last failed to answer
        self._next_try = 0.0
        self._lock = threading.Lock()  # the engine's prefetch and backup threads call at once

    def _guarded(self, what: str, call: Callable[[], T], gated: bool = True) -> T | None:
        """``call()``, or None when it failed or (``gated``) the master is known to be
        down. When ``retry_s`` is up, one call asks the master again while the others
        go on skipping, so an outage costs every thread at most one wait; once a call
        finds the master answering, calls go through again at once."""
        started = self.clock()
        with self._lock:
            if gated and started < self._next_try:
                return None
            if gated and self._down_since is not None:
                self._next_try = started + self.retry_s  # this call probes the master
        try:
            result = call()
        except RpcFailed as exc:
            with self._lock:
                first = self._down_since is None
                if first:
                    self._down_since = self.clock()
                self._next_try = self.clock() + self.retry_s
            if first:
                log.warning("kvpool: %s failed, the master did not answer (%s); loads and "
                            "saves are skipped until it does (asked again every %.0f s)",
                            what, exc, self.retry_s)
            return None
        except KVPoolError as exc:
            log.warning("kvpool: %s failed: %s", what, exc)
            return None
        with self._lock:  # a call begun before the outage proves nothing about its end
            recovered = self._down_since is not None and started >= self._down_since
            if recovered:  # the master answers: no call waits out the probe's retry_s
                self._down_since, self._next_try = None, 0.0
        if recovered:
            log.info("kvpool: the master answers again; loading and saving pages resumes")
        return result

    def query(self, names: Sequence[str], what: str) -> list | None:
        """:meth:`Client.batch_query` of ``names`` (read handles, locked pages), or None
        when it failed or the master is known to be down (``what`` names it in the log)."""
        return self._guarded(what, lambda: self.client.batch_query(list(names)))

    def exists(self, names: Sequence[str]) -> list[bool]:
        """Per object: present now (one RPC; the master grants a read lease)."""
        if not names:
            return []
        found = self._guarded(f"existence check of {len(names)} pages",
                              lambda: self.client.batch_is_exist(list(names)))
        return [False] * len(names) if found is None else found

    def write(self, names: Sequence[str], headers: Sequence[PageHeader],
              parts: Sequence[Sequence]) -> list[bool]:
        """Store each page as header + ``parts[i]`` joined. Per page: stored now, or
        already there (a page key fixes the bytes, so an existing object is this page);
        False for a page whose parts are not its header's length (warned)."""
        ok = [False] * len(names)
        todo = self._fitting(names, headers, parts, "storing")
        if not todo:
            return ok
        values = [[encode_header(headers[j], parts[j]), *parts[j]] for j in todo]
        codes = self._guarded(f"writing {len(todo)} pages", lambda: self.client.batch_put_parts(
            [names[j] for j in todo], values, self.replica_num))
        for j, c in zip(todo, codes or []):
            ok[j] = c in STORED
        return ok

    def read(self, names: Sequence[str], headers: Sequence[PageHeader],
             parts: Sequence[Sequence], handles: Sequence | None = None) -> list[bool]:
        """Copy each page's payload into its writable ``parts`` and check it there.

        ``handles``: read handles from :meth:`Client.batch_query` taken earlier (a lookup
        that locked the pages), one per name, or None to query now. Per page: True when
        its bytes are in place and passed the header check. On False the regions'
        content is undefined (partly written or unchecked): the caller must not use it.
        """
        if not names:
            return []
        ok = [False] * len(names)

        def transfer():
            live, ranges, held = self._plan(names, headers, parts,
                                            self.client.batch_query(list(names)) if handles is None else handles)
            return live, self.client.batch_read_ranges(held, ranges) if held else []

        # handles given: their grants go to the nodes, the master is not asked
        done = self._guarded(f"reading {len(names)} pages", transfer, gated=handles is None)
        if done is None:
            return ok
        live, codes = done
        bad = []
        for (j, raw, size), got in zip(live, codes):
            if any(c < 0 for c in got):
                continue  # vanished, expired or failed in transfer: a plain miss
            try:
                if size == HEADER_SIZE + headers[j].payload_len:
                    check_parts(raw, parts[j], headers[j])
                    ok[j] = True
                else:  # only its header was read: a sound page of another size stays
                    check_stored_size(raw, size, headers[j])
                    log.warning("kvpool: page %s is stored with %d bytes, this reader expects "
                                "%d: a miss", names[j], size, HEADER_SIZE + headers[j].payload_len)
            except PageFormatError as exc:
                self.rejects[exc.reason] += 1
                bad.append(names[j])
        self._drop(bad)
        return ok

    def _plan(self, names, headers, parts, handles):
        """(index, header buffer, stored size) and byte ranges of the pages to read. Of an
        object whose size is not this page's only the header is read: whether the object
        is bad or merely another size is for its own header to tell. Pages whose regions
        cannot take them (the caller's mismatch) are not read and their handles released."""
        fit = set(self._fitting(names, headers, parts, "loading"))
        live, ranges, held, unread = [], [], [], []
        for j, h in enumerate(handles):
            if not isinstance(h, ReadHandle):
                continue
            if j not in fit:
                unread.append(h)
                continue
            raw = bytearray(min(h.size, HEADER_SIZE))  # shorter: a truncated page
            spans, offset = [(0, raw)], HEADER_SIZE
            if h.size == HEADER_SIZE + headers[j].payload_len:
                for part in parts[j]:
                    spans.append((offset, part))
                    offset += memoryview(part).nbytes
            live.append((j, raw, h.size))
            ranges.append(spans)
            held.append(h)
        if unread:
            self.client.release(unread)
        return live, ranges, held

    @staticmethod
    def _fitting(names, headers, parts, what: str) -> list[int]:
        """Indices of the pages whose regions add up to their header's payload length.
        The others are warned about: the caller's buffers are the wrong size, which says
        nothing about the stored page (other ranks and engines still use it)."""
        fit = []
        for j, (h, p) in enumerate(zip(headers, parts, strict=True)):
            n = sum(memoryview(x).nbytes for x in p)
            if n == h.payload_len:
                fit.append(j)
            else:
                log.warning("kvpool: not %s page %s: the caller's buffers hold %d bytes, the "
                            "page has %d", what, names[j], n, h.payload_len)
        return fit

    def _drop(self, names: list[str]) -> None:
        """Remove refused pages (best effort) so that the next writer stores them again."""
        if names:
            try:
                self.client.batch_remove(names, force=True)
            except KVPoolError as exc:
                log.warning("kvpool: removing %d refused pages failed: %s", len(names), exc)
