"""`kvpool serve` and `kvpool.launch`: children never outlive their launcher.

A launcher killed with SIGKILL cannot stop its children, so each child asks the kernel
for SIGTERM when its parent dies (PR_SET_PDEATHSIG); the node then unlinks its segment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.child import child_preexec
from kvpool.launch import Cluster
from proc_helpers import kvpool_env, poll_until, wait_ready_file

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4: ppid
                out.append(int(entry.name))
    return out


def _shm_files(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {line.split(None, 5)[5].strip() for line in maps.splitlines()
            if len(line.split(None, 5)) == 6 and "/dev/shm/kvpool" in line}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie holds no port, no mapping


def _poll(check, timeout_s: float = 20.0) -> bool:
    return poll_until(check, timeout_s, 0.05)


def _start_serve(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    ready = tmp_path / "serve.ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool", "serve", "--port", "0", "--segment-size", "16MiB",
         "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        start_new_session=True)
    wait_ready_file(proc, ready, 60, "kvpool serve")
    return proc, ready


def test_sigkilled_serve_leaves_no_master_node_or_segment(tmp_path):
    serve, _ = _start_serve(tmp_path)
    try:
        kids = _children(serve.pid)
        assert len(kids) == 2, kids  # master and node
        shm = set().union(*(_shm_files(pid) for pid in kids))
        assert shm, "the node maps its segment from /dev/shm"
    finally:
        serve.kill()
        serve.wait()
    assert _poll(lambda: not any(_alive(pid) for pid in kids)), "children outlived kvpool serve"
    assert _poll(lambda: not any(os.path.exists(f) for f in shm)), f"segment left: {shm}"


def test_serve_removes_its_temp_dir_on_sigterm(tmp_path):
    serve, _ = _start_serve(tmp_path)
    kids = _children(serve.pid)
    cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in kids]
    ready_files = [Path(args[args.index(b"--ready-file") + 1].decode()) for args in cmdlines]
    serve.send_signal(signal.SIGTERM)
    assert serve.wait(30) == 0
    assert not any(f.parent.exists() for f in ready_files)


def test_child_preexec_is_a_callable_on_linux():
    preexec = child_preexec()
    assert callable(preexec)
    # a child that outlives its parent's death is signalled: parent = a short-lived shell
    out = subprocess.run(
        [sys.executable, "-c",
         "import subprocess, sys\n"
         "from kvpool.child import child_preexec\n"
         "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
         " preexec_fn=child_preexec())\n"
         "print(p.pid, flush=True)\n"],
        capture_output=True, text=True, timeout=60, check=True, env=kvpool_env())
    grandchild = int(out.stdout.split()[0])
    assert _poll(lambda: not _alive(grandchild)), "child outlived its parent"


def test_exit_message_names_the_child_and_its_log():
    with Cluster(segment_size="16MiB") as c:
        c.stop_node(0, kill=True)
        msg = c.node_children[0].exit_message()
    assert msg.startswith(f"node (pid {c.node_children[0].proc.pid}) was killed by SIGKILL; log: ")
    assert msg.endswith("node1.log")
