"""Lock-owned temporary folders (kvpool.owned_dir): a sweep removes only folders whose
writer is gone, never one being made, written, or kept on purpose, whatever the order
in which a writer and a sweeper interleave."""

from __future__ import annotations

import fcntl

from kvpool import owned_dir
from kvpool.owned_dir import LOCK_NAME, OwnedDir, sweep_abandoned


def _interleaved(monkeypatch, when, then):
    """Run ``then()`` once, inside the first flock call for which ``when(op)`` holds."""
    real, done = fcntl.flock, []

    def flock(fd, op):
        if not done and when(op):
            done.append(True)
            then()
        return real(fd, op)

    monkeypatch.setattr(owned_dir.fcntl, "flock", flock)


def test_a_sweep_between_making_and_locking_a_folder_leaves_it(tmp_path, monkeypatch):
    swept = []
    _interleaved(monkeypatch, lambda op: op == fcntl.LOCK_EX,
                 lambda: swept.append(sweep_abandoned(tmp_path, "w-")))
    writer = OwnedDir("w-", tmp_path)
    assert swept == [0] and (writer.path / LOCK_NAME).is_file()
    writer.remove()


def test_a_folder_kept_while_a_sweep_waits_on_its_lock_stays(tmp_path, monkeypatch):
    writer = OwnedDir("w-", tmp_path)
    (writer.path / "log").write_text("why it failed")
    # the sweeper has opened the lock file; the writer keeps the folder and unlocks it
    _interleaved(monkeypatch, lambda op: op & fcntl.LOCK_NB, writer.keep)
    assert sweep_abandoned(tmp_path, "w-") == 0
    assert (writer.path / "log").read_text() == "why it failed"


def test_only_an_unlocked_folder_goes_and_a_kept_one_stays(tmp_path):
    alive, dead, kept = (OwnedDir("w-", tmp_path) for _ in range(3))
    kept.keep()
    dead._close()  # as a writer killed with -9: the lock file stays, unlocked
    assert sweep_abandoned(tmp_path, "w-") == 1
    assert alive.path.is_dir() and not dead.path.exists() and kept.path.is_dir()
    assert sweep_abandoned(tmp_path, "w-", max_age_s=0) == 1  # lock-less folders past an age
    assert alive.path.is_dir() and not kept.path.exists()
    alive.remove()
