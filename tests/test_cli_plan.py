"""`kvpool plan` as a user meets it: bad files, closed pipes, wording, assumed rates."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvpool.cli import EXIT_BROKEN_PIPE, main
from kvpool.plan import configs_dir, load_spec
from kvpool.plan.prefill import Rates, prefill_report


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    return captured.err


@pytest.mark.parametrize("content, says", [
    (b'{"num_hidden_layers": "\xff\xfe"}', "not a UTF-8 text file"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "not a UTF-8 text file"),
    (b"[1, 2, 3]", "expected a JSON object"),
    (b'"text"', "expected a JSON object"),
    (b"[" * 100_000, "JSON"),
    (b"", "not valid JSON"),
])
@pytest.mark.parametrize("command", [["kv"], ["prefill", "--prompt", "100"]])
def test_unreadable_configs_are_user_errors(tmp_path, capsys, content, says, command):
    bad = tmp_path / "b.json"
    bad.write_bytes(content)
    assert main(["plan", command[0], str(bad), *command[1:]]) == 2
    assert says in _one_line_error(capsys)


def test_a_directory_is_a_user_error(tmp_path, capsys):
    assert main(["plan", "kv", str(tmp_path)]) == 2
    assert "cannot read config" in _one_line_error(capsys)


def _without(tmp_path, *fields):
    cfg = json.loads((configs_dir() / "llama-3-8b.json").read_text())
    for f in fields:
        del cfg[f]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_plan_kv_does_not_need_the_mlp_or_vocab(tmp_path, capsys):
    path = _without(tmp_path, "intermediate_size", "vocab_size")
    assert main(["plan", "kv", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["per_token"] == 32 * 8 * 128 * 2 * 2
    assert main(["plan", "prefill", path, "--prompt", "100"]) == 2
    assert "missing field 'intermediate_size'" in _one_line_error(capsys)


def _run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: like `| head -1`
    try:
        return subprocess.run([sys.executable, "-m", "kvpool", *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [
    ("plan", "kv", "llama-3-70b"),
    ("plan", "kv", "llama-3-70b", "--json"),
    ("plan", "prefill", "llama-3-8b", "--prompt", "8192"),
])
def test_closed_pipe_ends_quietly_with_141(args):
    r = _run_into_closed_pipe(*args)
    assert r.stderr == ""
    assert r.returncode == EXIT_BROKEN_PIPE


@pytest.mark.parametrize("args", [("plan", "--help"), ("master", "--help"), ("--help",)])
def test_help_into_a_closed_pipe_is_quiet(args):
    r = _run_into_closed_pipe(*args)  # argparse itself ignores the failed write: status 0
    assert r.stderr == "" and r.returncode in (0, EXIT_BROKEN_PIPE)


@pytest.mark.parametrize("hit", [0.0, 0.001, 0.25, 0.5, 0.9])
def test_speedup_sentence_makes_sense_for_every_hit(hit):
    r = prefill_report(load_spec("llama-3-8b"), 8192, hit, Rates(), page_size=16)
    if r.cached == 0:
        assert r.explanation == "No token is reused: the prefill runs cold."
        return
    naive = r.prompt / (r.prompt - r.cached)
    assert f"ideal compute speedup is {r.ideal_speedup:.2f}x, less than the {naive:.2f}x" \
        in r.explanation


def test_speedup_equal_to_the_hit_ratio_at_two_decimals_is_not_a_contrast():
    r = prefill_report(load_spec("llama-3-70b"), 64, 0.5, Rates())
    assert f"{r.ideal_speedup:.2f}" == "2.00"  # attention is next to nothing at 64 tokens
    assert "2.00x, all that reusing 50.0% of the tokens can give" in r.explanation
    assert "not 2.00x" not in r.explanation and "than the 2.00x" not in r.explanation


@pytest.mark.parametrize("flag, value, unit", [
    ("--bandwidth", "-5", "GB/s"), ("--bandwidth", "0", "GB/s"),
    ("--linear-flops", "-1.5", "GFLOP/s"), ("--attention-flops", "nan", "GFLOP/s"),
    ("--overhead-ms", "-1", "ms"), ("--linear-flops", "inf", "GFLOP/s"),
])
def test_bad_rates_repeat_the_value_in_its_unit(capsys, flag, value, unit):
    assert main(["plan", "prefill", "llama-3-8b", "--prompt", "100", flag, value]) == 2
    assert f"{flag} must be a finite number" in (err := _one_line_error(capsys))
    assert f"got {float(value):g} {unit}" in err


def test_assumed_rates_are_named_with_the_flags_to_change_them(capsys):
    assert main(["plan", "prefill", "llama-3-8b", "--prompt", "8192"]) == 0
    out = capsys.readouterr().out
    assert "rates assumed: linear 170 GFLOP/s, attention 150 GFLOP/s, overhead 50 ms, " \
        "load 5 GB/s" in out
    assert "--linear-flops, --attention-flops, --overhead-ms, --bandwidth not given" in out
    assert "--measure" in out
    assert main(["plan", "prefill", "llama-3-8b", "--prompt", "8192", "--linear-flops", "400e3",
                 "--attention-flops", "300e3", "--overhead-ms", "5", "--bandwidth", "20"]) == 0
    out = capsys.readouterr().out
    assert "NOTE" not in out and "rates assumed: linear 400000 GFLOP/s" in out
    assert main(["plan", "prefill", "llama-3-8b", "--prompt", "8192", "--bandwidth", "20",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["default_rates"] == [
        "--linear-flops", "--attention-flops", "--overhead-ms"]


def test_prefill_rounds_the_cached_prefix_to_pages(capsys):
    assert main(["plan", "prefill", "llama-3-8b", "--prompt", "1000", "--hit", "0.5",
                 "--page-size", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cached"] == 448  # 500 down to 7 pages
