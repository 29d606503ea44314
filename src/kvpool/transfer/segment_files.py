"""Segment files in /dev/shm that outlive a killed node, and how the next node finds them.

A node's segment is a file ``/dev/shm/kvpool-<id>`` as large as the segment. Python's
resource tracker unlinks it when the node is killed alone, but not when the tracker dies
with it (a process group killed with SIGKILL, an OOM kill of both, a container stopped
hard): the file then keeps its memory until someone removes it, and a host that restarts
nodes that way fills /dev/shm (seen here: 11 GB of dead segments after a day of tests).

Each segment therefore has an owner file ``<name>.owner`` on which its node holds an
exclusive ``flock(2)`` for as long as it lives. The kernel drops the lock when the last
descriptor of the node closes, however the node dies, and a lock is tied to the file,
not to a process id, so no pid reuse or pid namespace can fool the check.
:func:`sweep_stale` (run by every node before it creates its segment) removes a segment
whose owner file it can lock: nobody holds it, so nobody owns the segment. A segment
without an owner file (made by another program, or an older kvpool) is left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time

from kvpool.owned_dir import lock_if_abandoned
from kvpool.transfer.epoch import SHM_DIR

PREFIX = "kvpool-"
OWNER_SUFFIX = ".owner"
MAKING_SUFFIX = ".new"  # an owner file being made (a few microseconds)
MAKING_ABANDONED_S = 60.0  # one older than this, and unlocked, was left by a killed owner
log = logging.getLogger("kvpool.segments")


def owner_path(shm_name: str, shm_dir: str = SHM_DIR) -> str:
    return os.path.join(shm_dir, shm_name + OWNER_SUFFIX)


class OwnerLock:
    """The owner file of segment ``shm_name``, locked for this process's lifetime.

    Take it before creating the segment and :meth:`release` it after unlinking the
    segment, so a sweeper never sees a live segment with an unlocked owner file.
    Raises OSError when the file cannot be created (FileExistsError: another owner
    has the name).
    """

    def __init__(self, shm_name: str, shm_dir: str = SHM_DIR):
        self.path = owner_path(shm_name, shm_dir)
        # made and locked under another name, then linked into place: a sweep never
        # finds an owner file unlocked (one that did made its owner fail to start, or
        # lock a file it had just removed), and an existing one is never replaced
        making = self.path + MAKING_SUFFIX
        self._fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.link(making, self.path)  # FileExistsError: the name is taken
        except OSError:
            os.close(self._fd)
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(making)

    def release(self) -> None:
        """Remove the owner file and drop the lock (idempotent)."""
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = -1


def sweep_stale(shm_dir: str = SHM_DIR) -> tuple[int, int]:
    """Remove the kvpool segments in ``shm_dir`` whose owner is gone (see the module
    docstring). Returns (segments removed, bytes freed); logs what it removed."""
    removed = freed = 0
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return 0, 0
    for name in names:
        if name.startswith(PREFIX) and name.endswith(OWNER_SUFFIX + MAKING_SUFFIX):
            _sweep_making(os.path.join(shm_dir, name))
        elif name.startswith(PREFIX) and name.endswith(OWNER_SUFFIX):
            size = _sweep_one(shm_dir, name[: -len(OWNER_SUFFIX)])
            if size is not None:
                removed += 1
                freed += size
    if removed:
        log.warning("removed %d segment(s) of dead kvpool nodes from %s (%.1f MB)", removed, shm_dir, freed / 1e6)
    return removed, freed


def _sweep_one(shm_dir: str, shm_name: str) -> int | None:
    """Remove segment ``shm_name`` if its owner file is unlocked; the memory it held in
    bytes, or None when it is owned or gone (an unlocked owner file left after the
    resource tracker unlinked the segment is removed too)."""
    lock = owner_path(shm_name, shm_dir)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not lock_if_abandoned(fd, lock):
            return None  # its node is alive, or it replaced the file meanwhile
        path = os.path.join(shm_dir, shm_name)
        try:
            size = os.stat(path).st_blocks * 512  # memory held, not the sparse length
            os.unlink(path)
        except FileNotFoundError:
            size = None
        os.unlink(lock)  # while locked: a node that re-creates the name makes a new file
        return size
    finally:
        os.close(fd)


def _sweep_making(path: str) -> None:
    """Remove an owner file left half made (its owner killed between making and naming
    it): unlocked and older than :data:`MAKING_ABANDONED_S`, as a fresh one may not be
    locked yet."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if time.time() - os.fstat(fd).st_mtime > MAKING_ABANDONED_S and lock_if_abandoned(fd, path):
            os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)
