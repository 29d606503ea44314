"""Checked page objects in the store, written and read in place (gather/scatter).

The engine adapters keep KV in memory they own (SGLang's host pool, LMCache's memory
objects). A page is stored as one object: kvpool's page header (``kvpool.cache.codec``)
followed by the page's bytes, which may lie in several separate regions of the engine's
memory (e.g. the K and the V region of one host-pool page). Writes send the header and
each region straight from where they lie (``Client.batch_put_parts``); reads copy the
header into a small buffer and each region straight into its place
(``Client.batch_read_ranges``), then check the header and the payload checksum there.
A page that fails its check is a miss, is counted, and is removed from the store so that
a writer can store it again.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence

from kvpool.cache.codec import HEADER_SIZE, PageFormatError, PageHeader, check_parts, encode_header
from kvpool.client import Client, ReadHandle
from kvpool.errors import ErrorCode, KVPoolError

log = logging.getLogger(__name__)

STORED = (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS)


class PageObjects:
    """Batch calls on checked page objects through one :class:`Client`.

    Every call takes per object its store key, the :class:`PageHeader` it must carry
    and its payload regions (buffers; writable ones for reads) in payload order.
    Every call answers per object, in order; a store that cannot answer at all
    (master down, RPC failure) gives all-False and a warning, never an exception.

    Attributes:
        rejects: Counter of pages refused on load, by PageFormatError reason
            ("checksum", "namespace", "length", ...).
    """

    def __init__(self, client: Client, replica_num: int = 1):
        self.client = client
        self.replica_num = replica_num
        self.rejects: collections.Counter[str] = collections.Counter()

    def exists(self, names: Sequence[str]) -> list[bool]:
        """Per object: present now (one RPC; the master grants a read lease)."""
        if not names:
            return []
        try:
            return self.client.batch_is_exist(list(names))
        except KVPoolError as exc:
            log.warning("kvpool: existence check of %d pages failed: %s", len(names), exc)
            return [False] * len(names)

    def write(self, names: Sequence[str], headers: Sequence[PageHeader],
              parts: Sequence[Sequence]) -> list[bool]:
        """Store each page as header + ``parts[i]`` joined. Per page: stored now, or
        already there (a page key fixes the bytes, so an existing object is this page)."""
        if not names:
            return []
        values = [[encode_header(h, p), *p] for h, p in zip(headers, parts, strict=True)]
        try:
            codes = self.client.batch_put_parts(list(names), values, self.replica_num)
        except KVPoolError as exc:
            log.warning("kvpool: writing %d pages failed: %s", len(names), exc)
            return [False] * len(names)
        return [c in STORED for c in codes]

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
        try:
            if handles is None:
                handles = self.client.batch_query(list(names))
            ok = [False] * len(names)
            live, ranges, held = self._plan(names, headers, parts, handles)
            codes = self.client.batch_read_ranges(held, ranges) if held else []
        except KVPoolError as exc:
            log.warning("kvpool: reading %d pages failed: %s", len(names), exc)
            return [False] * len(names)
        bad = []
        for (j, raw), got in zip(live, codes):
            if any(c < 0 for c in got):
                continue  # vanished, expired or failed in transfer: a plain miss
            try:
                check_parts(raw, parts[j], headers[j])
                ok[j] = True
            except PageFormatError as exc:
                self.rejects[exc.reason] += 1
                bad.append(names[j])
        self._drop(bad)
        return ok

    def _plan(self, names, headers, parts, handles):
        """(index, header buffer) and byte ranges of the pages to read; handles whose size
        cannot be this page are released and counted as "length" rejects."""
        live, ranges, held, wrong = [], [], [], []
        for j, h in enumerate(handles):
            if not isinstance(h, ReadHandle):
                continue
            if h.size != HEADER_SIZE + headers[j].payload_len:
                wrong.append(h)
                continue
            raw = bytearray(HEADER_SIZE)
            spans, offset = [(0, raw)], HEADER_SIZE
            for part in parts[j]:
                spans.append((offset, part))
                offset += memoryview(part).nbytes
            live.append((j, raw))
            ranges.append(spans)
            held.append(h)
        if wrong:
            self.client.release(wrong)
            self.rejects["length"] += len(wrong)
            self._drop([h.key for h in wrong])
        return live, ranges, held

    def _drop(self, names: list[str]) -> None:
        """Remove refused pages (best effort) so that the next writer stores them again."""
        if names:
            try:
                self.client.batch_remove(names, force=True)
            except KVPoolError as exc:
                log.warning("kvpool: removing %d refused pages failed: %s", len(names), exc)
