"""Segments of killed nodes: the owner lock of kvpool.transfer.segment_files, and the next
node on the host removing what a node killed with its resource tracker left in /dev/shm."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys

from kvpool.launch import Cluster
from kvpool.transfer.segment_files import OwnerLock, owner_path, sweep_stale
from proc_helpers import wait_ready_file

HOLD = """
import sys, time
from kvpool.transfer.segment_files import OwnerLock
lock = OwnerLock(sys.argv[1], sys.argv[2])
print("locked", flush=True)
time.sleep(600)
"""


def _segment(tmp_path, name: str, size: int = 1 << 16) -> str:
    path = tmp_path / name
    path.write_bytes(b"\1" * size)
    return str(path)


def test_a_segment_is_swept_only_once_its_owner_is_dead(tmp_path):
    seg = _segment(tmp_path, "kvpool-aaaa")
    owner = subprocess.Popen([sys.executable, "-c", HOLD, "kvpool-aaaa", str(tmp_path)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "locked"
        assert sweep_stale(str(tmp_path)) == (0, 0)  # alive: kept
        assert os.path.exists(seg)
    finally:
        owner.kill()
        owner.wait()
    removed, freed = sweep_stale(str(tmp_path))
    assert removed == 1 and freed >= 1 << 16
    assert not os.path.exists(seg) and not os.path.exists(owner_path("kvpool-aaaa", str(tmp_path)))


def test_files_without_an_owner_file_are_left_alone_and_orphan_locks_go(tmp_path):
    foreign = _segment(tmp_path, "kvpool-bbbb")  # an older kvpool's, or another program's
    other = _segment(tmp_path, "psm_cccc")
    (tmp_path / "kvpool-dddd.owner").write_bytes(b"")  # segment already unlinked by the tracker
    assert sweep_stale(str(tmp_path)) == (0, 0)
    assert os.path.exists(foreign) and os.path.exists(other)
    assert not (tmp_path / "kvpool-dddd.owner").exists()


def test_the_lock_is_held_until_released(tmp_path):
    seg = _segment(tmp_path, "kvpool-eeee")
    lock = OwnerLock("kvpool-eeee", str(tmp_path))
    assert sweep_stale(str(tmp_path)) == (0, 0)  # flock conflicts across open files of one process too
    lock.release()
    lock.release()
    assert os.path.exists(seg) and not os.path.exists(lock.path)


def test_an_owner_file_is_never_seen_unlocked(tmp_path, monkeypatch):
    """A sweep that ran between the making of an owner file and its lock removed it (the
    owner then locked a file that guarded nothing) or held its lock for a moment (the
    owner failed to start). The file is now locked before it gets its name."""
    from kvpool.transfer import segment_files
    real, seen = fcntl.flock, []

    def flock(fd, op):
        if not seen:
            seen.append(os.path.exists(owner_path("kvpool-ffff", str(tmp_path))))
            sweep_stale(str(tmp_path))  # finds only the fresh half-made file: kept
        return real(fd, op)

    monkeypatch.setattr(segment_files.fcntl, "flock", flock)
    lock = OwnerLock("kvpool-ffff", str(tmp_path))
    monkeypatch.undo()
    assert seen == [False] and os.path.exists(lock.path)
    assert sorted(os.listdir(tmp_path)) == ["kvpool-ffff.owner"]
    _segment(tmp_path, "kvpool-ffff")
    assert sweep_stale(str(tmp_path)) == (0, 0)  # guarded
    lock.release()


def test_a_half_made_owner_file_goes_once_old_and_unlocked(tmp_path):
    """An owner killed between making its file and naming it leaves ``*.owner.new``."""
    old, fresh, held = (tmp_path / f"kvpool-{n}.owner.new" for n in ("aa", "bb", "cc"))
    for path in (old, fresh, held):
        path.write_bytes(b"")
    for path in (old, held):
        os.utime(path, (0, 0))
    holder = os.open(held, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        sweep_stale(str(tmp_path))
    finally:
        os.close(holder)
    assert not old.exists() and fresh.exists() and held.exists()


def test_the_next_node_removes_a_segment_left_by_a_node_killed_with_its_tracker(tmp_path):
    with Cluster(segment_size="8MiB", num_nodes=0) as c:
        ready = tmp_path / "node.json"
        node = subprocess.Popen([sys.executable, "-m", "kvpool", "node", "--master", c.master_addr,
                                 "--segment-size", "8MiB", "--port", "0", "--ready-file", str(ready)],
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shm = f"/dev/shm/{wait_ready_file(node, ready)['shm_name']}"
        os.killpg(node.pid, signal.SIGKILL)  # the node and its resource tracker
        node.wait()
        assert os.path.exists(shm), "the tracker died with the node: the segment is left"
        c.start_node()
        assert not os.path.exists(shm) and not os.path.exists(shm + ".owner")
