"""``kvpool demo`` end to end, as a user runs it (a subprocess), with the tiny model.

The real demo (SmolLM2, ~2 minutes) is run by hand; here the same code path runs with
``--model tiny-random`` and two questions: cluster, two engine processes, reuse through
the store, cold replay, verdict and JSON.
"""

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time

from proc_helpers import KVPOOL, kvpool_env

DEMO = [*KVPOOL, "demo", "--model", "tiny-random", "--questions", "2",
        "--max-new-tokens", "6", "--segment-size", "64MiB", "--l1-size", "64MiB"]


def test_demo_runs_end_to_end_and_writes_a_passing_verdict(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run([*DEMO, "--force-tcp", "--quiet", "--json", str(out)],
                          capture_output=True, text=True, timeout=170, env=kvpool_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["ok"] is True
    assert report["verdict"].startswith("PASS") and report["verdict"] in proc.stdout
    assert report["transport"] == "tcp"
    assert report["attention"] == "kvpool_causal" == report["model"]["attention"]
    rows = report["requests"]
    # 2 questions (A, then B) and a follow-up of each on the other engine
    assert [r["engine"] for r in rows] == ["A", "B", "B", "A"]
    assert all(r["tokens_match"] and r["max_abs_dlogit"] <= 1e-4 for r in rows)
    assert rows[0]["reused_tokens"] == 0
    # B's first request found the document's pages that A wrote, in the store
    assert rows[1]["reused_by_tier"].get("L3", 0) > 1000
    assert report["cross_engine_l3_tokens"] == rows[1]["reused_by_tier"]["L3"]
    assert all(r["cold"]["ttft_ms"] > 0 and r["speedup"] > 0 for r in rows)
    assert report["target"]["requests"] == [2, 3, 4]


def test_demo_ctrl_c_stops_every_child_process_and_leaves_no_temp_folder(tmp_path):
    # a terminal's Ctrl-C goes to the whole foreground group: the demo and its engines
    proc = subprocess.Popen(DEMO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=kvpool_env(TMPDIR=str(tmp_path)), start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    pids, deadline = [], time.monotonic() + 150
    try:
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, "demo ended before its engines were ready"
                continue
            pids += [int(p) for p in re.findall(r"\(pid (\d+)", line)]
            if "engine B ready" in line:
                break
        assert len(pids) == 4, pids  # master, node, engine A, engine B
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130  # not 2: "engine A exited with status 130"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for pid in pids:
        assert not _alive(pid), f"child {pid} still running"
    assert list(tmp_path.glob("kvpool-*")) == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has exited; only its parent's wait is missing
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def test_a_demo_whose_store_holds_too_little_says_why_and_keeps_its_logs():
    """A segment smaller than what A writes: B finds nothing in the store. The FAIL
    line says why (what A wrote, more than the segment holds) and the logs stay, as
    --help promises when something failed; before, the line gave no reason and the
    logs were removed."""
    args = list(DEMO)
    args[args.index("--segment-size") + 1] = "1MiB"
    proc = subprocess.run([*args, "--quiet"], capture_output=True, text=True, timeout=170, env=kvpool_env())
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "B reused 0 tokens" in proc.stdout
    assert "more than the segment (1MiB) holds, so the store evicted them" in proc.stdout, proc.stdout
    logs = re.search(r"logs of the master, node and engines: (\S+)", proc.stderr)
    assert logs and os.path.isdir(logs.group(1)), proc.stderr
    assert any(name.endswith(".log") for name in os.listdir(logs.group(1)))
    shutil.rmtree(logs.group(1))
