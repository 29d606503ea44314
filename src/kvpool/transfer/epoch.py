"""The mount epoch word of a hosted segment and the lock its same-host writers hold.

A segment's shared memory is ``size`` value bytes followed, at :func:`epoch_offset`, by
one 64-byte cache line whose first 8 bytes (u64, native order, aligned) hold the
segment's current mount epoch: the number the master stamped on this mount
(:attr:`kvpool.protocol.SegmentInfo.epoch`), or :data:`NO_EPOCH` while the segment is
between mounts; the next 8 bytes hold the last epoch fenced (so a grant of it, certainly
stale, need not wait for a mount in progress). The hosting node writes them; every
process that maps the segment reads them. A grant names the epoch it was issued under,
and its bytes may move only while the word holds that epoch:

- a reader copies, then checks the word (:meth:`EpochWord.valid`): a copy that may
  have overlapped a later mount's writes is discarded, as a late copy is after its lease;
- a writer takes a shared ``flock(2)`` on the segment's file, checks the word, copies,
  and unlocks (:meth:`EpochWord.writing`);
- the node, before mounting again, stores NO_EPOCH and then takes the exclusive lock
  once (:meth:`EpochWord.fence`): every writer that saw the old epoch has finished,
  every later one sees NO_EPOCH. Only after that does the new mount (and so the first
  grant that could reuse a range) exist.

flock locks belong to open file descriptions and a process dies holding none, so a
killed writer never blocks a fence; each :class:`EpochWord` opens the file itself
(threads of one process share its shared lock through a count, because one unlock
would release it for all). The flock calls are also the memory barriers between a
writer's check and its copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from typing import Iterator

NO_EPOCH = 0  # the word between mounts; in a grant: no epoch, nothing is checked
EPOCH_BYTES = 64
SHM_DIR = "/dev/shm"
MOUNT_WAIT_S = 2.0  # how long a grant of a new epoch waits for the node to finish mounting


def epoch_offset(size: int) -> int:
    """Byte offset of the epoch word in a segment of ``size`` value bytes (64-aligned)."""
    return -(-size // EPOCH_BYTES) * EPOCH_BYTES


def shm_bytes(size: int) -> int:
    """Bytes of shared memory a segment of ``size`` value bytes occupies."""
    return epoch_offset(size) + EPOCH_BYTES


class EpochWord:
    """The epoch word of one mapping (``view``: the whole mapped file; ``size``: the
    segment's value bytes) and a descriptor of file ``shm_name`` of its own for the lock.
    Raises OSError if the file cannot be opened."""

    def __init__(self, view: memoryview, size: int, shm_name: str):
        start = epoch_offset(size)
        self._word = view[start : start + 16].cast("Q")  # [current epoch, last fenced epoch]
        self._fd = os.open(os.path.join(SHM_DIR, shm_name), os.O_RDWR)
        self._lock = threading.Lock()
        self._writers = 0

    def read(self) -> int:
        return self._word[0]

    def valid(self, epoch: int) -> bool:
        """True if a copy under a grant of ``epoch`` may be kept (NO_EPOCH: unchecked)."""
        return epoch == NO_EPOCH or self._word[0] == epoch

    def mounting(self, epoch: int) -> bool:
        """Whether a grant of ``epoch`` may belong to a mount still being made: the word
        is NO_EPOCH (the node is between its fence and the end of its new mount, whose
        grants may already be out: the master answers the mount before the node stores
        its epoch) and ``epoch`` is not the one fenced (a grant of that one is stale)."""
        return epoch != NO_EPOCH and self._word[0] == NO_EPOCH and self._word[1] != epoch

    def await_mount(self, epoch: int, deadline: float) -> None:
        """Before a copy under a grant of ``epoch``: while it may belong to a mount in
        progress (:meth:`mounting`), wait for the mount, at most MOUNT_WAIT_S and until
        ``deadline`` (time.monotonic). Without it a read right after a master restart
        failed as stale (seen in CI). Whether the copy may be kept is still
        :meth:`valid`'s to say."""
        if not self.mounting(epoch):
            return
        limit = min(deadline, time.monotonic() + MOUNT_WAIT_S)
        while self._word[0] == NO_EPOCH and time.monotonic() < limit:
            time.sleep(0.001)

    # ---------------------------------------------------------------- hosting node

    def set(self, epoch: int) -> None:
        self._word[0] = epoch

    def close_epoch(self) -> None:
        """Store NO_EPOCH, the current epoch (if any) kept as the last one fenced first."""
        if self._word[0] != NO_EPOCH:
            self._word[1] = self._word[0]
        self._word[0] = NO_EPOCH

    def fence(self, deadline: float, stop: threading.Event | None = None) -> bool:
        """Store NO_EPOCH, then wait (until ``deadline``, time.monotonic, or until
        ``stop`` is set) for the writers that saw the old epoch. False if one still
        holds the lock (a stopped process): the caller must not mount again yet."""
        self.close_epoch()
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                    return False
                time.sleep(0.001)
                continue
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            return True

    # ---------------------------------------------------------------- writers

    @contextlib.contextmanager
    def writing(self, epoch: int, deadline: float) -> Iterator[bool]:
        """Hold the segment for a write under a grant of ``epoch``; yields whether the
        write may go ahead. A grant of a new epoch may reach a writer just before the
        node finishes mounting (the word still NO_EPOCH): it waits for that
        (:meth:`await_mount`)."""
        if epoch == NO_EPOCH:
            yield True
            return
        self.await_mount(epoch, deadline)
        self._enter()
        try:
            yield self._word[0] == epoch
        finally:
            self._exit()

    def _enter(self) -> None:
        with self._lock:
            if self._writers == 0:
                fcntl.flock(self._fd, fcntl.LOCK_SH)
            self._writers += 1

    def _exit(self) -> None:
        with self._lock:
            self._writers -= 1
            if self._writers == 0:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(BufferError):
            self._word.release()
