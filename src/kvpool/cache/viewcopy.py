"""Page copies on two threads; out of mapped store memory, each page checked after its copy.

The same copier moves L1 pages (the cache's own memory: no checksum) into a caller's
layout; what follows is about store pages.

An L3 page in a segment mapped in this process (shared memory on this host) is copied
straight from the segment into its destination (an engine's strided KV layout, a tree
slot), with no staging copy, and then its payload is hashed where it was read from,
while those bytes are still in the CPU's cache, and compared with the checksum its
header records. What keeps a copied page sound is, first, the read grant: the master
neither evicts nor reuses a granted object's bytes, and a segment mounted again (a
master restart) shows in the grant's epoch when the views are closed, after the hash;
second, the hash after the copy: a stray write into the bytes before or during the copy
is still there when they are hashed, so the page fails (only a write undone again
before the hash would pass; hashing first and copying after would let any write in
between pass).

Two threads (the caller and one helper) take chunks of pages in turn: ``torch``
copies and ``xxhash`` (4.x, for a buffer) both release the interpreter lock, so the
two threads copy and hash side by side and only the Python that prepares a chunk
(header checks, views) is serial. The load is bound by memory bandwidth: here two
threads hash 2 x 500 MB in 18.5 ms against 41 ms on one, and the demo's load takes
~12.6 ms with the hash left out against ~14.5 ms with it. Measured here with the
demo's load (138 pages of 737 KB into the reference engine's KV layout, memcpy of the
same bytes 9.5 ms): through staging rows (copy, check, copy on) 31 ms; copied
straight, one thread 17-19 ms; two threads 13 ms plus the grant query (docs/cache.md, "L3 loads").
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kvpool.cache.codec import PageFormatError, payload_checksum

# bytes of pages one thread copies before it hashes them: well inside the last-level
# cache (32 MiB here) with two threads at work; 2-4 MiB measured best (8 MiB: +15%)
COPY_CHUNK_BYTES = 4 << 20


def chunk_pages(page_bytes: int) -> int:
    """Pages of ``page_bytes`` bytes each that one thread copies, then hashes, at a time
    (:data:`COPY_CHUNK_BYTES` of them, at least one)."""
    return max(1, COPY_CHUNK_BYTES // max(1, page_bytes))


class PageCopy:
    """One page to copy and check: ``dsts[i].copy_(srcs[i])`` for each of its objects,
    then ``xxh3_64(payloads[i]) == checksums[i]``.

    Attributes:
        dsts, srcs: tensors of equal shapes (srcs over the payload views, any dtype).
        payloads: the payload bytes the sources are views of (one per object); empty
            for a plain copy of memory this process owns (an L1 slot): nothing to check.
        checksums: the payload checksums the objects' headers record.
    """

    __slots__ = ("dsts", "srcs", "payloads", "checksums")

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor],
                 payloads: Sequence[memoryview], checksums: Sequence[int]):
        self.dsts, self.srcs = dsts, srcs
        self.payloads, self.checksums = payloads, checksums

    def good(self) -> bool:
        """Whether every payload hashes to its recorded checksum (after the copy)."""
        return all(payload_checksum([p]) == c for p, c in zip(self.payloads, self.checksums))


class CheckedCopier:
    """Copies and checks pages on the calling thread and one helper thread (started at
    the first use, stopped by :meth:`close`; after it, copies run on the calling thread
    alone). One copy at a time per copier."""

    def __init__(self):
        self._helper: ThreadPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()

    def copy(self, count: int, prepare: Callable[[int], PageCopy], chunk_pages: int
             ) -> tuple[int, str | None]:
        """Copy pages ``0..count-1`` in order, ``chunk_pages`` at a time per thread:
        ``prepare(j)`` says how to copy page ``j`` (it checks the page's header, and
        raises PageFormatError when the page is unusable); each chunk's sources are
        hashed right after its copies.

        Returns (how many leading pages were copied and passed their checks, why the
        next one did not: its PageFormatError reason, "checksum", or None when all
        passed). Pages after the first that failed may be copied or not. Raises what a
        copy or ``prepare`` raised (a shape or dtype mismatch: a bug), once both
        threads have stopped.
        """
        failed: list[tuple[int, str]] = []  # (page, why) of pages that failed

        def chunk(pages: range) -> None:
            try:
                _copy_chunk(pages, prepare, failed)
            except BaseException:
                failed.append((pages[0], "error"))  # the other thread stops too
                raise

        # every chunk claimed is finished, so every page before a failure is done
        self._on_two_threads(count, chunk_pages, chunk, lambda: bool(failed))
        return min(failed, default=(count, None))

    def copy_each(self, count: int, prepare: Callable[[int], PageCopy], chunk_pages: int
                  ) -> list[int]:
        """Copy and check every page ``0..count-1``, ``chunk_pages`` at a time per thread,
        as :meth:`copy` does, but without stopping at a failure: for pages that do not
        form one prefix (a step's blocks of several requests). ``prepare(j)`` must not
        raise for a page it cannot copy (check headers first). Returns the pages whose
        checksum failed, ascending. Raises what a copy or ``prepare`` raised, once both
        threads have stopped."""
        bad: list[int] = []
        raised = threading.Event()

        def chunk(pages: range) -> None:
            try:
                ready = [prepare(j) for j in pages]
                _copy(ready)
                bad.extend(j for j, page in zip(pages, ready) if not page.good())
            except BaseException:
                raised.set()  # the other thread stops too
                raise

        self._on_two_threads(count, chunk_pages, chunk, raised.is_set)
        return sorted(bad)

    def _on_two_threads(self, count: int, chunk_pages: int, chunk: Callable[[range], None],
                        stop: Callable[[], bool]) -> None:
        """Run ``chunk(pages)`` over ``0..count-1`` in chunks of ``chunk_pages``, claimed
        in order by the calling thread and the helper until none is left or ``stop()``;
        raises what a chunk raised once both threads have stopped."""
        chunks = [range(lo, min(count, lo + chunk_pages)) for lo in range(0, count, chunk_pages)]
        claims = itertools.count()  # next() on a count is atomic under the interpreter lock

        def work() -> None:
            # preparing a chunk (Python) overlaps the other thread's copy (no lock)
            while not stop():
                k = next(claims)
                if k >= len(chunks):
                    return
                chunk(chunks[k])

        # the helper copies as the caller would: inference and grad mode are per thread
        # (an engine's KV made under torch.inference_mode takes writes only in that mode)
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

        def helper_work() -> None:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                work()

        with self._lock:
            helper = self._start() if len(chunks) > 1 else None
            other = helper.submit(helper_work) if helper is not None else None
            try:
                work()
            finally:
                if other is not None:
                    other.result()

    def _start(self) -> ThreadPoolExecutor | None:
        if self._helper is None and not self._closed:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="kvpool-copy")
        return self._helper

    def close(self) -> None:
        """Stop the helper thread; later copies run on the calling thread alone."""
        with self._lock:
            self._closed = True
            if self._helper is not None:
                self._helper.shutdown(wait=True)
                self._helper = None


def _copy_chunk(pages: range, prepare: Callable[[int], PageCopy], failed: list) -> None:
    """Prepare, copy, then hash ``pages``; appends (page, why) to ``failed`` for the
    first page of them that failed."""
    ready = []
    for j in pages:
        try:
            ready.append(prepare(j))
        except PageFormatError as exc:
            failed.append((j, exc.reason))
            break
    _copy(ready)
    bad = next((i for i, p in enumerate(ready) if not p.good()), None)
    if bad is not None:
        failed.append((pages[0] + bad, "checksum"))


def _copy(ready: list[PageCopy]) -> None:
    """Every copy of ``ready``, in one call (``torch`` releases the interpreter lock)."""
    if ready:
        torch._foreach_copy_([d for p in ready for d in p.dsts], [s for p in ready for s in p.srcs])
