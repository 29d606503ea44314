"""The logs' folder of a benchmark run (kvpool.bench.logs.RunLogs): a temporary one
goes when the run ends well and stays when it does not; one the user named stays."""

from __future__ import annotations

import os
import tempfile

import pytest

from kvpool.bench.logs import RunLogs
from kvpool.errors import UserError


@pytest.fixture
def temp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_temporary_folder_goes_after_a_run_that_ended_well(temp, capsys):
    with RunLogs(None, "kvpool-bench-") as logs:
        (temp / logs.path / "worker.log").write_text("x")
    assert list(temp.iterdir()) == []
    assert capsys.readouterr().err == ""


def test_a_failed_run_keeps_its_logs_and_says_where(temp, capsys):
    with pytest.raises(RuntimeError), RunLogs(None, "kvpool-bench-") as logs:
        raise RuntimeError("a worker died")
    assert [str(p) for p in temp.iterdir()] == [logs.path]
    assert f"logs kept in {logs.path} (the run failed)" in capsys.readouterr().err


def test_a_part_reported_absent_keeps_the_logs_with_the_first_reason(temp, capsys):
    with RunLogs(None, "kvpool-bench-") as logs:
        logs.keep("a column was absent")
        logs.keep("the demo's L3 load was absent")
    assert [str(p) for p in temp.iterdir()] == [logs.path]
    assert "(a column was absent)" in capsys.readouterr().err


def test_a_named_folder_is_made_and_kept(tmp_path, capsys):
    named = tmp_path / "a" / "logs"
    with RunLogs(str(named), "kvpool-bench-") as logs:
        pass
    assert logs.path == str(named) and named.is_dir()
    assert f"logs in {named}" in capsys.readouterr().err


def test_a_named_folder_that_cannot_be_made_is_a_user_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="--log-dir .*cannot make the folder"):
        RunLogs(str(tmp_path / "file" / "logs"), "kvpool-bench-")


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs sysfs")
def test_a_named_folder_where_no_file_can_be_made_is_a_user_error_even_for_root():
    # os.access says yes to root here; the first log file then failed with a traceback
    with pytest.raises(UserError, match="--log-dir /sys/kernel: folder is not writable"):
        RunLogs("/sys/kernel", "kvpool-bench-")
