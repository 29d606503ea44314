"""One background thread that runs jobs from a bounded queue (L3 backups, prefetches)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
_STOP = object()


class JobThread:
    """Runs ``fn(job)`` for each submitted job, in order, on one daemon thread.

    A job that raises is logged and counted in ``errors``; the thread goes on, and
    :meth:`join` raises the first such error so that it is not lost. :attr:`depth` counts
    the jobs submitted and not yet finished (the one running included).
    """

    def __init__(self, name: str, fn: Callable[[object], None], max_jobs: int):
        self._fn = fn
        self._queue: queue.Queue = queue.Queue(max_jobs)
        self.errors = 0
        self._first_error: BaseException | None = None
        self._depth = 0
        self._depth_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: object) -> bool:
        """Queue ``job``; False when the queue is full (the caller decides what to drop)."""
        with self._depth_lock:  # counted before the put: the thread may finish it at once
            self._depth += 1
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._finished()
            return False
        return True

    @property
    def depth(self) -> int:
        """Jobs submitted and not finished yet, the running one included (0 when idle)."""
        with self._depth_lock:
            return self._depth

    def _finished(self) -> None:
        with self._depth_lock:
            self._depth -= 1

    def join(self) -> None:
        """Wait until every job queued so far has run."""
        self._queue.join()
        if self._first_error is not None:
            error, self._first_error = self._first_error, None
            raise error

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        self._queue.put(_STOP)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is _STOP:
                    return
                self._fn(job)
            except Exception as exc:  # a bug in a job must not kill the writer thread
                log.exception("background job failed")
                self.errors += 1
                self._first_error = self._first_error or exc
            finally:
                if job is not _STOP:
                    self._finished()  # before task_done: depth is 0 once join() returns
                self._queue.task_done()
