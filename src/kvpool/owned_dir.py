"""Temporary folders that say whether their writer is alive, so that the next run can
remove the ones a killed process left behind.

A process that fills a temporary folder (a model conversion, a launcher's ready files
and logs) holds an exclusive ``flock(2)`` on a lock file inside it for as long as it
works; the kernel drops the lock however the process ends, kill -9 included, and a
lock is tied to the open file, not to a process id, so pid reuse cannot fool the check.
:func:`sweep_abandoned` removes the folders of a prefix whose lock file it can lock.
A folder kept on purpose (logs worth reading) has its lock file removed first
(:meth:`OwnedDir.keep`), so a folder without one is left alone, unless the caller gives
a ``max_age_s`` past which it is removed too (where nothing is ever kept: a writer
killed before it made the file, or a folder of an older kvpool).
Seen without it: 513 MiB of a killed conversion kept for good, and a
``/tmp/kvpool-cluster-*`` folder per launcher killed with -9.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

LOCK_NAME = ".writing.lock"


class OwnedDir:
    """A new folder ``dir/prefix*`` (``tempfile.mkdtemp``) locked by this process until
    :meth:`release` or :meth:`keep`. Raises OSError when it cannot be made."""

    def __init__(self, prefix: str, dir: str | Path | None = None):
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=dir))
        # locked under another name, then renamed: a sweep never finds it unlocked
        making = self.path / (LOCK_NAME + ".new")
        self._fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.rename(making, self.path / LOCK_NAME)

    def keep(self) -> None:
        """Leave the folder for a person to read (no sweep removes it) and unlock it."""
        try:
            os.unlink(self.path / LOCK_NAME)
        except FileNotFoundError:
            pass
        self._close()

    def remove(self) -> None:
        """Delete the folder and unlock it (idempotent)."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._close()

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def sweep_abandoned(parent: str | Path, prefix: str, max_age_s: float | None = None,
                    before_removal: Callable[[Path], None] | None = None) -> int:
    """Remove the folders ``parent/prefix*`` whose writer is gone (see the module
    docstring; ``max_age_s``: seconds after which a folder without a lock file goes
    too, None: never); returns how many were removed. ``before_removal(folder)`` is
    called for each abandoned folder while its lock is held, before it is removed (to
    undo what its files record; it must not raise). Never raises for a folder it
    cannot read or remove; a folder whose lock is held (this process's own included)
    is kept."""
    removed = 0
    for folder in Path(parent).glob(f"{prefix}*"):
        try:
            fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            if max_age_s is not None and _older_than(folder, max_age_s):
                shutil.rmtree(folder, ignore_errors=True)
                removed += 1
            continue
        except OSError:
            continue
        try:
            if lock_if_abandoned(fd, folder / LOCK_NAME):
                if before_removal is not None:
                    before_removal(folder)
                shutil.rmtree(folder, ignore_errors=True)
                removed += 1
        finally:
            os.close(fd)
    return removed


def lock_if_abandoned(fd: int, path: str | Path) -> bool:
    """Try to take the exclusive lock of the open lock file ``fd`` (opened from
    ``path``) without waiting; True when it is taken and ``path`` still names that file.

    False when its owner holds the lock, or when the owner unlinked or replaced the file
    between the caller's open and this lock: an owner unlinks its lock file (keep,
    remove, rename) before it unlocks, so a lock taken on a file no longer at ``path``
    proves nothing about what ``path`` guards. The caller closes ``fd``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False  # held by its owner, or gone meanwhile


def _older_than(folder: Path, seconds: float) -> bool:
    """Whether ``folder`` is a folder last changed more than ``seconds`` ago."""
    try:
        return folder.is_dir() and time.time() - folder.stat().st_mtime > seconds
    except OSError:
        return False
