"""Background saves of the vLLM connector: a bounded queue of batches and one thread.

The worker hands each step's completed blocks to :class:`Sender` in ``wait_for_save``
and returns to vLLM at once. The sender thread takes one batch at a time: it copies the
blocks out of vLLM's KV cache into its own staging pages (``copy_out``), then stores
them with one batch put (``store``), while vLLM runs its next steps.

vLLM must not reuse a block while it is being copied out. KVConnectorBase_V1's
contract (vLLM 0.32, ``request_finished`` / ``get_finished``): a connector that returns
True from ``request_finished`` keeps the request's blocks until a worker names the
request in ``finished_sending``. So the worker asks :meth:`Sender.pending` before it
names a finished request. A preempted request's blocks are freed by vLLM at once
(``handle_preemptions`` runs before they are written again): :meth:`Sender.drop` takes
its blocks out of the queued batches and waits for a copy of them in progress.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvpool.integrations.vllm.store import SAVES_SKIPPED

if TYPE_CHECKING:  # meta imports vLLM; this module is tested without it
    from kvpool.integrations.vllm.meta import BlockRun


@dataclasses.dataclass
class Batch:
    """Blocks to save together (one batch put). ``ready``: called on the sender thread
    before the copy; it returns once the step that wrote these blocks has finished
    writing them (a device event), None when the step had finished on return."""

    runs: list[BlockRun]
    ready: Callable[[], Any] | None = None

    @property
    def blocks(self) -> int:
        return sum(len(r.block_ids) for r in self.runs)

    @property
    def req_ids(self) -> set[str]:
        return {r.req_id for r in self.runs}


def split_runs(runs: list[BlockRun], max_blocks: int) -> list[list[BlockRun]]:
    """``runs`` cut into batches of at most ``max_blocks`` blocks, in order (a run that
    does not fit is split between two batches)."""
    batches: list[list[BlockRun]] = [[]]
    room = max_blocks
    for run in runs:
        start = 0
        while start < len(run.block_ids):
            if room == 0:
                batches.append([])
                room = max_blocks
            end = min(len(run.block_ids), start + room)
            batches[-1].append(dataclasses.replace(
                run, first_index=run.first_index + start,
                block_hashes=run.block_hashes[start:end], block_ids=run.block_ids[start:end]))
            room -= end - start
            start = end
    return [b for b in batches if b]


class Sender:
    """One background thread that saves :class:`Batch` objects in order.

    Args:
        copy_out: ``copy_out(batch) -> pages`` copies the batch's blocks out of vLLM's
            cache (vLLM may reuse the blocks once it returns).
        store: ``store(batch, pages)`` stores what ``copy_out`` returned.
        log: vLLM's logger; an exception of either call is logged once per message,
            its blocks counted as ``kvpool_vllm_saves_skipped{reason="error"}``, and
            the sender goes on with the next batch.
        max_batches: batches queued at most; :meth:`submit` refuses more.
        drain_s: how long :meth:`close` waits, at most, for the queued batches when the
            process exits (each store call ends within the client's timeout).
    """

    def __init__(self, copy_out: Callable[[Batch], Any], store: Callable[[Batch, Any], None],
                 log, max_batches: int = 8, drain_s: float = 60.0):
        self.copy_out, self.store, self.log = copy_out, store, log
        self.max_batches, self.drain_s = max_batches, drain_s
        self._cond = threading.Condition()
        self._queue: collections.deque[Batch] = collections.deque()
        self._copying: Batch | None = None
        self._pending: collections.Counter[str] = collections.Counter()  # batches per request
        self._thread: threading.Thread | None = None
        self._closed = False
        self._errors_seen: set[str] = set()

    def submit(self, batch: Batch) -> bool:
        """Queue ``batch``; False (nothing queued) when the queue is full or closed."""
        with self._cond:
            if self._closed or len(self._queue) >= self.max_batches:
                return False
            self._queue.append(batch)
            self._pending.update(batch.req_ids)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvpool-vllm-sender",
                                                daemon=True)
                self._thread.start()
                # atexit runs before the interpreter stops daemon threads
                atexit.register(self.close, self.drain_s)
            self._cond.notify_all()
        return True

    def pending(self, req_id: str) -> bool:
        """True while a batch with blocks of ``req_id`` is queued, copied or stored."""
        with self._cond:
            return self._pending[req_id] > 0

    def drop(self, req_ids: set[str]) -> int:
        """Take the blocks of ``req_ids`` out of the queued batches and wait until no copy
        of their blocks is in progress; returns the blocks taken out (not saved)."""
        dropped = 0
        with self._cond:
            kept: collections.deque[Batch] = collections.deque()
            for batch in self._queue:
                gone = [r for r in batch.runs if r.req_id in req_ids]
                dropped += sum(len(r.block_ids) for r in gone)
                self._release({r.req_id for r in gone})
                batch.runs = [r for r in batch.runs if r.req_id not in req_ids]
                if batch.runs:
                    kept.append(batch)
            self._queue = kept
            self._cond.wait_for(lambda: self._copying is None
                                or not (self._copying.req_ids & req_ids))
        return dropped

    def close(self, timeout_s: float | None = None) -> bool:
        """Save what is queued, then stop the thread; True when it stopped in time.
        Later :meth:`submit` calls are refused. Safe to call twice."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                batch = self._copying = self._queue.popleft()
            try:
                self._save(batch)
            finally:
                with self._cond:
                    self._release(batch.req_ids)
                    self._cond.notify_all()

    def _release(self, req_ids: set[str]) -> None:
        """One batch fewer for each of ``req_ids`` (holding the condition's lock)."""
        for req_id in req_ids:
            self._pending[req_id] -= 1
            if self._pending[req_id] <= 0:
                del self._pending[req_id]

    def _save(self, batch: Batch) -> None:
        try:
            if batch.ready is not None:
                batch.ready()
            pages = self.copy_out(batch)
        except Exception as exc:  # noqa: BLE001 - a failed save must not stop the sender
            self._failed("copying", batch, exc)
            return
        finally:
            with self._cond:
                self._copying = None
                self._cond.notify_all()
        try:
            self.store(batch, pages)
        except Exception as exc:  # noqa: BLE001 - as above: vLLM serves on
            self._failed("storing", batch, exc)

    def _failed(self, what: str, batch: Batch, exc: Exception) -> None:
        SAVES_SKIPPED.labels("error").inc(batch.blocks)
        message = f"{type(exc).__name__}: {exc}"
        if message not in self._errors_seen:
            self._errors_seen.add(message)
            self.log.error("kvpool: %s %d blocks for kvpool failed (%s); they are not saved, "
                           "vLLM serves on", what, batch.blocks, message, exc_info=exc)
