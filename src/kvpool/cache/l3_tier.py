"""The L3 tier of a prefix cache: what L3 holds, checked reads, backups and prefetch reads.

L3 is not in the radix tree: it is asked live. A load copies pages in memory mapped here
straight into place and hashes them after the copy (``viewcopy``); other reads land in
staging rows (kept and reused) and are checked there against their headers (``codec``).
A page that fails is never used: the read is cut at it and the reason counted. Backups write only the pages
L3 lacks, on a background thread with a bounded queue. Prefetches plan (how many pages
L3 holds) and read batch by batch on their own thread; the cache lands each batch in its
tree. A backend failure (:data:`kvpool.cache.l3.BACKEND_ERRORS`) is an ``l3_errors``
miss; any other exception (a bug, InvalidParams) propagates.

Metrics counted here (names in :mod:`kvpool.cache.metrics`): announced_tokens_l3,
hit_tokens_l3, lost_tokens_l3, pages_loaded_l3, bytes_loaded_l3, page_rejects(_<why>),
l3_vanished, l3_errors, pages_written_l3, bytes_written_l3, pages_dedup_l3,
backup_dropped, prefetch_pages_planned, prefetch_pages_landed, prefetch_<outcome>.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvpool.cache.l3 import BACKEND_ERRORS, L3Backend
from kvpool.cache.metrics import CacheMetrics
from kvpool.cache.namespace import Namespace
from kvpool.cache.pagestore import PageStore, ReadResult
from kvpool.cache.prefetch import PrefetchHandle
from kvpool.cache.viewcopy import CheckedCopier, chunk_pages
from kvpool.cache.worker import JobThread


@dataclasses.dataclass
class Backup:
    """One chain of pages to write to L3.

    Attributes:
        keys, indices: page keys and page numbers, root side first.
        gather: returns the pages, a CPU tensor ``[len(keys), *page_shape]`` (called on
            the backup thread; the cache keeps the pages locked until ``done``).
        done: called once with, per page, whether L3 holds it now.
    """

    keys: list[bytes]
    indices: list[int]
    gather: Callable[[], torch.Tensor]
    done: Callable[[list[bool]], None]


# bytes of staging rows one step of an L3 load reads, checks and copies on: well inside
# the last-level cache (32 MiB here), so the rows are still cached when copied on
LOAD_CHUNK_BYTES = 8 << 20

# loads that skip the view path after one whose first page had no view (a client on
# another host than the pages): one wasted grant query per this many loads at most
VIEW_RETRY_LOADS = 32

# land(handle, first, pages) -> pages the tree took, or None when the handle was cancelled
LandFn = Callable[[PrefetchHandle, int, torch.Tensor], "int | None"]


class _Staging:
    """Rows that L3 objects are read into, grown to the largest read and reused (fresh
    memory costs a page fault per 4 KiB on first touch, ~10 ms per 100 MB here)."""

    def __init__(self, store: PageStore):
        self.store = store
        self.lock = threading.Lock()  # the rows are shared: one read at a time
        self._raw = store.staging(0)

    def rows(self, n: int) -> np.ndarray:
        if self._raw.shape[0] < n:
            self._raw = None  # free the old rows first
            self._raw = self.store.staging(n)
        return self._raw


class L3Tier:
    """L3 of one namespace through one :class:`~kvpool.cache.l3.L3Backend`.

    Args:
        backend: the L3 backend (StoreBackend, DiskBackend).
        ns: the namespace (digest and object layout of every page).
        page_shape, dtype: one page tensor.
        metrics: the cache's counters (this tier counts its own names in them).
        page_size: tokens per page (for the token counters).
        async_backup: write backups on a background thread (else inside :meth:`backup`).
        backup_queue: backups that may wait; beyond, one is dropped and counted.
        prefetch_batch: pages per prefetch read.
        land: ``land(handle, first, pages)`` puts a prefetched batch into the cache's
            tree (``pages[i]`` is page ``first + i`` of the handle's tail); returns how
            many it took, or None when the handle was cancelled meanwhile.
        part: objects ``kvp/<hex>/<part>`` (one per page) instead of the namespace's
            object layout (see :class:`~kvpool.cache.pagestore.PageStore`).
    """

    def __init__(self, backend: L3Backend, ns: Namespace, page_shape: Sequence[int],
                 dtype: torch.dtype, metrics: CacheMetrics, async_backup: bool = True,
                 backup_queue: int = 256, prefetch_batch: int = 64,
                 land: LandFn | None = None, part: str = ""):
        self.backend = backend
        self.store = PageStore(backend, ns.digest(), ns.page_size, page_shape, dtype,
                               ns.object_layout, part)
        self.page_shape, self.dtype = tuple(page_shape), dtype
        self.page_size = ns.page_size
        self.metrics = metrics
        self.prefetch_batch = prefetch_batch
        self._load_rows = _Staging(self.store)
        self._chunk_pages = max(1, LOAD_CHUNK_BYTES // self.store.row_bytes)
        self._copier = CheckedCopier()
        self._skip_views = 0  # loads left that do not try views (see VIEW_RETRY_LOADS)
        self._copy_pages = chunk_pages(self.store.row_bytes)
        self._prefetch_rows = _Staging(self.store)
        self._backups = (JobThread("kvpool-backup", self._write, backup_queue)
                         if async_backup else None)
        self._prefetcher: JobThread | None = JobThread("kvpool-prefetch", self._prefetch, 64)
        self._land = land

    # -- presence and reads -----------------------------------------------------------
    def present(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` L3 holds whole now (0 when L3 cannot answer)."""
        try:
            return self.store.present(keys)
        except BACKEND_ERRORS:
            self.metrics.inc("l3_errors")
            return 0

    def read_into(self, keys: Sequence[bytes], first_index: int, out: torch.Tensor) -> int:
        """Read and check pages ``keys`` (page numbers from ``first_index``) into
        ``out[:len(keys)]`` (``[>= len(keys), *page_shape]``, this tier's dtype, any
        strides: e.g. a view of an engine's KV layout). Returns how many leading pages
        landed and passed their check; the rest of ``out`` is then undefined.

        Leading pages in memory mapped here (shared memory on this host) are copied once,
        straight into ``out``, and checked after the copy (:mod:`kvpool.cache.viewcopy`):
        the demo's 102 MB 31 -> ~15 ms. The rest go chunk by chunk of about
        :data:`LOAD_CHUNK_BYTES`: copied out of the store into staging rows, checked
        there and copied on into ``out`` while still in the CPU's cache.
        """
        with self._load_rows.lock:
            got, ended = self._read_viewed(keys, first_index, out)
            while not ended and got < len(keys):
                chunk = list(keys[got:got + self._chunk_pages])
                pages = self._read(chunk, first_index + got, self._load_rows)
                out[got:got + pages.shape[0]].copy_(pages)
                got += pages.shape[0]
                ended = pages.shape[0] < len(chunk)
        return got

    def _read_viewed(self, keys: Sequence[bytes], first_index: int, out: torch.Tensor
                     ) -> tuple[int, bool]:
        """Copy the leading pages of ``keys`` that have views (:meth:`PageStore.open_pages`)
        into ``out`` and check them; returns (pages that landed and passed, whether the
        read ends there: a page failed, or L3 could not answer). Only into host memory
        (a device ``out`` takes the staging path: one transfer per 8 MiB, not per page)."""
        if out.device.type != "cpu":
            return 0, False
        if self._skip_views > 0:
            self._skip_views -= 1
            return 0, False
        try:
            opened = self.store.open_pages(keys)
        except BACKEND_ERRORS:
            self.metrics.inc("l3_errors")
            return 0, True
        if opened is None:
            return 0, False
        if keys and not opened.views:  # the first page is not mapped here: its query wasted
            self._skip_views = VIEW_RETRY_LOADS
        try:
            good, reason = self._copier.copy(len(opened.views), lambda j: self.store.copy_of(
                opened.views[j], keys[j], first_index + j, out[j]), self._copy_pages)
        finally:
            kept = opened.close()
        if kept < len(opened.views) and kept <= good:
            # that page's segment was mounted again or its lease ran out: whatever its
            # check said, its bytes may have been another object's
            good, reason = kept, "stale"
        self._count(self.store.result(good, reason))
        return good, reason is not None

    def _read(self, keys: list[bytes], first_index: int, staging: _Staging) -> torch.Tensor:
        raw = staging.rows(len(keys))
        try:
            result = self.store.read_into(keys, first_index, raw)
        except BACKEND_ERRORS:
            self.metrics.inc("l3_errors")
            return torch.empty((0, *self.page_shape), dtype=self.dtype)
        self._count(result)
        return self.store.pages(raw, result.good, self.page_shape, self.dtype)

    def _count(self, result: ReadResult) -> None:
        """Count a read: its pages (verified: hits) and why the next page failed."""
        if result.reason == "vanished":
            self.metrics.inc("l3_vanished")
        elif result.reason is not None:
            self.metrics.inc("page_rejects")
            self.metrics.inc(f"page_rejects_{result.reason}")
        self.metrics.inc("pages_loaded_l3", result.good)
        self.metrics.inc("bytes_loaded_l3", result.nbytes)

    def reserve(self, pages: int) -> None:
        """Grow the rows loads land in to ``pages`` pages (at most one chunk,
        :data:`LOAD_CHUNK_BYTES`) and touch them now, off any request's path: a
        first read into fresh rows paid their page faults, and on the development VM
        stalls of up to 5 ms per 2 MiB page the host had not backed yet (the demo's first
        cross-instance load of 102 MB: 215-257 ms, 20 ms into touched rows)."""
        with self._load_rows.lock:
            self._load_rows.rows(min(pages, self._chunk_pages)).fill(0)

    def count_announced(self, pages: int) -> None:
        """Count pages a match found present (not read yet)."""
        self.metrics.inc("announced_tokens_l3", pages * self.page_size)

    def count_load(self, announced: int, got: int) -> None:
        """Count the L3 part of a match's first load: ``got`` of ``announced`` pages
        landed and passed their check (hits); the rest were lost (K21)."""
        if got:
            self.metrics.inc("hit_tokens_l3", got * self.page_size)
        if announced > got:
            self.metrics.inc("lost_tokens_l3", (announced - got) * self.page_size)

    # -- backups ----------------------------------------------------------------------
    def backup(self, job: Backup) -> None:
        """Queue ``job`` (or write it now without a backup thread); a full queue drops
        it, counted in ``backup_dropped`` (its pages are offered again later)."""
        if self._backups is None:
            self._write(job)
        elif not self._backups.submit(job):
            self.metrics.inc("backup_dropped", len(job.keys))
            job.done([False] * len(job.keys))

    @property
    def backup_queue_depth(self) -> int:
        """Backups queued or being written (0 without a backup thread, or closed)."""
        return self._backups.depth if self._backups is not None else 0

    def flush(self) -> None:
        """Wait until every backup queued so far is written."""
        if self._backups is not None:
            self._backups.join()

    def _write(self, job: Backup) -> None:
        """Write the pages of ``job`` that L3 lacks (on the backup thread)."""
        stored = [False] * len(job.keys)
        try:
            pages = job.gather()
            missing = self.store.missing(job.keys)
            todo = [j for j, miss in enumerate(missing) if miss]
            self.metrics.inc("pages_dedup_l3", len(job.keys) - len(todo))
            ok, nbytes = self.store.write([job.keys[j] for j in todo],
                                          [job.indices[j] for j in todo],
                                          [pages[j] for j in todo])
            stored = [not miss for miss in missing]
            for j, good in zip(todo, ok):
                stored[j] = good
            self.metrics.inc("pages_written_l3", sum(ok))
            self.metrics.inc("pages_refused_l3", len(ok) - sum(ok))
            self.metrics.inc("bytes_written_l3", nbytes)
        except BACKEND_ERRORS:
            self.metrics.inc("l3_errors")
        finally:
            job.done(stored)

    # -- prefetch ---------------------------------------------------------------------
    def prefetch(self, h: PrefetchHandle) -> bool:
        """Queue prefetch ``h``: plan, then read its pages batch by batch and hand each
        batch to ``land``. False when the queue is full or the tier is closed."""
        return self._prefetcher is not None and self._prefetcher.submit(h)

    def _prefetch(self, h: PrefetchHandle) -> None:
        """Plan, then read and land ``h``'s pages (on the prefetch thread)."""
        if not h.claim():
            return
        outcome = "failed"
        try:
            # per rank: the cross-rank minimum is taken by the match that uses these pages
            # (a collective from this thread could interleave with the engine thread's)
            planned = self.store.present(h.keys)
            self.metrics.inc("prefetch_pages_planned", planned)
            h.set_plan(planned)
            outcome = self._read_plan(h, planned)
        except BACKEND_ERRORS:
            self.metrics.inc("l3_errors")
        finally:
            if h.planned is None:
                h.set_plan(0)
            self.metrics.inc(f"prefetch_{outcome}")
            h.finish(outcome)

    def _read_plan(self, h: PrefetchHandle, planned: int) -> str:
        """Read the planned pages in batches and land them; returns the outcome."""
        while h.landed < planned:
            if h.cancelled():
                return "cancelled"
            lo, hi = h.landed, min(planned, h.landed + self.prefetch_batch)
            pages = self._read(h.keys[lo:hi], h.first_index + lo, self._prefetch_rows)
            added = self._land(h, lo, pages)
            if added is None:
                return "cancelled"
            self.metrics.inc("prefetch_pages_landed", added)
            if added < hi - lo:
                return "failed"
        return "complete"

    def close(self) -> None:
        """Finish queued backups and stop both threads."""
        for worker in (self._backups, self._prefetcher):
            if worker is not None:
                worker.close()
        self._backups = self._prefetcher = None
        self._copier.close()
