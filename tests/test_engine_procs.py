"""Engine worker processes seen from the parent: every wait ends, and says what it waits for.

Real ``kvpool generate --worker`` processes with the tiny model, no store.
"""

import pytest

from kvpool.engine import procs
from kvpool.engine.procs import EngineProcess, EngineProcessError

TINY = ["--model", "tiny-random", "--threads", "1"]


def test_wait_ready_twice_returns_the_ready_event_without_waiting_again(tmp_path):
    # the ready event comes once; a second wait for it could only end at its timeout
    engine = EngineProcess("A", TINY, tmp_path / "a.log")
    try:
        first = engine.wait_ready(120)
        assert engine.wait_ready(5) is first
        assert engine.call({"prompt_ids": [1, 2, 3], "max_new_tokens": 1}, 60)["prompt_tokens"] == 3
    finally:
        engine.stop()


def test_waits_on_an_exited_worker_fail_at_once_with_its_status_every_time(tmp_path):
    engine = EngineProcess("A", ["--model", str(tmp_path / "missing")], tmp_path / "a.log")
    try:
        for _ in range(2):  # the end of its output is seen once, remembered after
            with pytest.raises(EngineProcessError, match=r"exited with status 2\n.*unknown model"):
                engine.wait_ready(60)
        with pytest.raises(EngineProcessError, match="is gone|exited with status 2"):
            engine.call({"prompt_ids": [1]}, 60)
    finally:
        engine.stop()


def test_a_long_wait_says_what_it_waits_for(tmp_path, monkeypatch):
    monkeypatch.setattr(procs, "HEARTBEAT_S", 0.01)
    lines = []
    engine = EngineProcess("A", TINY, tmp_path / "a.log", lambda name, text: lines.append(text))
    try:
        engine.wait_ready(120)
        engine.call({"prompt_ids": list(range(1, 64)), "max_new_tokens": 16}, 120)
    finally:
        engine.stop()
    assert any(line.startswith("still loading (") for line in lines), lines
    # the operation, not the child's own request count (a demo's cold "request 1" was its 4th)
    assert any(line.startswith("still working on generate (") for line in lines), lines
