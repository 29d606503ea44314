"""Loads of stored pages straight from a same-host segment into vLLM's paged KV.

A stored page holds one block of every layer (``[L, 2, H, B, D]`` after its header).
When it sits in a segment mapped in this process, :class:`ViewLoader` copies each layer's
part from the segment into vLLM's block with no staging copy. A load of every layer
before the forward pass goes through the prefix cache's copier
(:class:`~kvpool.cache.viewcopy.CheckedCopier`): the calling thread and a helper take
chunks of pages, and each chunk's segment bytes are hashed right after its copy, while
still in the CPU's cache; every page gets its own verdict, since a step's blocks belong
to several requests. A layered load (:class:`LayeredLoad`) copies layer by layer on the
loader's own thread, then checks. Measured here (SmolLM2, 69 blocks of 1.47 MB, a fresh
vLLM process): reading into staging, checking, then scattering took 40-64 ms; vLLM's
bundled ExampleConnector loads the same blocks in 26 ms.

The checksum is over the segment's bytes, which cannot change under the read lease
(the master neither evicts nor reuses a leased object's bytes); a master restart that
re-mounted the segment meanwhile shows as a changed mount epoch when the views close,
and fails every page of that segment.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from kvpool.cache.codec import HEADER_SIZE, payload_checksum
from kvpool.cache.viewcopy import CheckedCopier, PageCopy, chunk_pages
from kvpool.transfer.shm import MADV_POPULATE_WRITE


def prefault(tensors) -> int:
    """Fault in the pages of CPU ``tensors``' storages for writing, keeping their
    content (MADV_POPULATE_WRITE); returns the bytes populated (0 where the kernel lacks
    the advice or the tensors are not in host memory).

    Why: a fresh engine's KV cache is untouched memory, and the first load into it paid
    a page fault per 4 KiB: 102 MB of blocks took 36-43 ms to copy into a fresh cache,
    12 ms into a touched one (measured here). Run at registration, on a thread, so that
    no request waits for it; it makes the cache resident (what serving does anyway).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    done, seen = 0, set()
    for t in tensors:
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if start in seen or not nbytes:
            continue
        seen.add(start)
        first = start // page * page
        length = -(-(start + nbytes - first) // page) * page
        if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), MADV_POPULATE_WRITE):
            return done  # not supported (or not anonymous memory): leave it to faults
        done += nbytes
    return done


class ViewLoader:
    """Copies viewed pages into vLLM's block views (one per worker; a thread for layered
    loads and the copier's helper for whole ones)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load")  # layered loads
        self._copier = CheckedCopier()  # whole loads

    def load(self, views: dict[str, torch.Tensor], index: dict[str, int], opened,
             items: list, page_shape: tuple[int, ...], dtype: torch.dtype) -> dict[int, str]:
        """Copy and check the pages ``items`` name; returns {vLLM block id: reason} of
        those that must not be used ("checksum", "stale"). Closes ``opened``.

        Args:
            views: layer name -> block view ``[num_blocks, 2, H, B, D]`` of vLLM's cache.
            index: layer name -> position of that layer in a stored page.
            opened: the client's :class:`~kvpool.client.get.ValueViews` of the pages.
            items: (vLLM block id, position in ``opened``, payload checksum its header
                records) per page whose view exists and whose header checked.
            page_shape, dtype: shape ``[L, 2, H, B, D]`` and dtype of a page's payload.
        """
        bad: dict[int, str] = {}
        try:
            layers = [(view, index[name]) for name, view in views.items()]

            def prepare(j: int) -> PageCopy:
                block, pos, stored = items[j]
                payload = opened.views[pos][HEADER_SIZE:]
                page = torch.frombuffer(payload, dtype=dtype).view(page_shape)
                return PageCopy([view[block] for view, _ in layers], [page[layer] for _, layer in layers],
                                [payload], [stored])

            chunk = chunk_pages(math.prod(page_shape) * dtype.itemsize)
            bad.update((items[j][0], "checksum") for j in self._copier.copy_each(len(items), prepare, chunk))
        finally:
            _close_views(opened, items, bad)
        return bad

    def start(self, views: dict[str, torch.Tensor], index: dict[str, int], opened, items: list,
              page_shape: tuple[int, ...], dtype: torch.dtype) -> "LayeredLoad":
        """Start copying ``items`` (as in :meth:`load`) layer by layer on the loader's
        thread, so that the forward pass can run layer ``i`` once layer ``i`` landed."""
        job = LayeredLoad(views, index, opened, items, page_shape, dtype)
        self._pool.submit(job.run)
        return job

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._copier.close()



def _close_views(opened, items: list, bad: dict[int, str]) -> None:
    """Close the views of a load; a page whose segment was mounted again meanwhile (its
    epoch moved: its bytes may be another's) is "stale" in ``bad``."""
    kept = opened.close()
    for block, pos, _ in items:
        if not kept[pos]:
            bad.setdefault(block, "stale")


class LayeredLoad:
    """One step's viewed pages, copied into vLLM's blocks one layer at a time (in the
    order of ``views``, the model's), then checked against their checksums.

    vLLM waits for layer ``i`` (``wait_for_layer_load``) just before its attention, so
    the copy of later layers overlaps the forward pass of earlier ones. A block whose
    checksum fails, or any block of a layer the forward pass did not wait for (it may
    have read it before it landed), is reported as a load error after the step, and
    vLLM recomputes it, as it does for a synchronous load's failures.
    """

    WAIT_S = 60.0  # a layer the thread has not copied by then is read as it is, then failed

    def __init__(self, views, index, opened, items, page_shape, dtype):
        self.views, self.index, self.opened, self.items = views, index, opened, items
        self.page_shape, self.dtype = page_shape, dtype
        self.ready = [threading.Event() for _ in views]
        self.waited = [False] * len(views)
        self._done = threading.Event()
        self._bad: dict[int, str] = {}
        # the loader thread copies in the caller's modes (per thread; an engine's KV made
        # under torch.inference_mode takes writes only in that mode)
        self._modes = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def run(self) -> None:
        """Copy every layer, then check every page (the loader thread's job)."""
        with torch.inference_mode(self._modes[0]), torch.set_grad_enabled(self._modes[1]):
            self._run()

    def _run(self) -> None:
        blocks = [block for block, _, _ in self.items]
        try:
            payloads = [self.opened.views[pos][HEADER_SIZE:] for _, pos, _ in self.items]
            pages = [torch.frombuffer(p, dtype=self.dtype).view(self.page_shape) for p in payloads]
            for name, view in self.views.items():
                layer = self.index[name]
                torch._foreach_copy_([view[b] for b in blocks], [page[layer] for page in pages])
                self.ready[layer].set()
            for (block, _, stored), payload in zip(self.items, payloads):
                if payload_checksum([payload]) != stored:
                    self._bad[block] = "checksum"
        except Exception:  # noqa: BLE001 - a failed copy is a load error, not vLLM's
            self._bad = {block: "error" for block in blocks}
        finally:
            for event in self.ready:
                event.set()
            _close_views(self.opened, self.items, self._bad)
            self._done.set()

    def wait_layer(self, layer: int) -> None:
        """Block until layer ``layer`` (its position in a stored page) has landed."""
        self.waited[layer] = self.ready[layer].wait(self.WAIT_S) or self.waited[layer]

    def result(self) -> dict[int, str]:
        """Wait for the job; {vLLM block id: reason} of the blocks that must be
        recomputed ("checksum", "stale", "error", "unwaited")."""
        self._done.wait()
        if not all(self.waited):
            return {block: self._bad.get(block, "unwaited") for block, _, _ in self.items}
        return self._bad
