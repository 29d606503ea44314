"""Settings of `kvpool master|node|serve`: ports are checked, config-file typos are errors."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

import pytest

from kvpool.config import Option, add_options, load_config_file, parse_port, resolve
from kvpool.errors import UserError


def _kvpool(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `kvpool ARGS` in its own process group; a command that starts serving
    instead of refusing (port 70000 used to become 4464) is stopped and fails the test."""
    proc = subprocess.Popen([sys.executable, "-m", "kvpool", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate()
        pytest.fail(f"kvpool {' '.join(args)} started instead of refusing")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("command", ["master", "node", "serve"])
@pytest.mark.parametrize("flag", ["--port", "--http-port"])
@pytest.mark.parametrize("value", ["70000", "-5", "x"])
def test_out_of_range_ports_are_one_line_errors(command, flag, value):
    r = _kvpool(command, flag, value)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert repr(value) in r.stderr and flag[2:] in r.stderr and "0 to 65535" in r.stderr


def test_port_from_env_and_file_is_checked_too(tmp_path):
    r = _kvpool("master", env={"KVPOOL_MASTER_PORT": "70000"})
    assert r.returncode == 2 and "(from env)" in r.stderr
    cfg = tmp_path / "master.yaml"
    cfg.write_text("port: 99999\n")
    r = _kvpool("master", "--config", str(cfg))
    assert r.returncode == 2 and "(from config file)" in r.stderr


@pytest.mark.parametrize("value, port", [("0", 0), ("65535", 65535), (8080, 8080), (" 80 ", 80)])
def test_parse_port_accepts_the_whole_range(value, port):
    assert parse_port(value) == port


@pytest.mark.parametrize("value", [True, -1, 65536, "", "8080x"])
def test_parse_port_rejects(value):
    with pytest.raises(UserError, match="0 to 65535"):
        parse_port(value)


def test_unknown_config_key_names_it_and_the_known_keys(tmp_path):
    cfg = tmp_path / "node.yaml"
    cfg.write_text("segment-sise: 12XB\n")
    r = _kvpool("node", "--config", str(cfg))
    assert r.returncode == 2
    err = r.stderr
    assert "'segment-sise'" in err and "did you mean 'segment-size'" in err
    assert ("known: busy-poll, frame-timeout, host, http-port, master, master-wait, max-connections, port, "
            "prefault, secret, segment-size") in err


def test_unknown_key_in_json_without_a_close_match(tmp_path):
    opts = [Option("client-ttl", 10.0, float, "ttl")]
    parser = argparse.ArgumentParser()
    add_options(parser, opts)
    cfg = tmp_path / "m.json"
    cfg.write_text(json.dumps({"client_ttl": 3, "zzz": 1}))
    with pytest.raises(UserError, match=r"unknown setting 'zzz' \(known: client-ttl\)"):
        resolve(parser.parse_args(["--config", str(cfg)]), opts)
    cfg.write_text(json.dumps({"client-ttl": 3}))
    assert resolve(parser.parse_args(["--config", str(cfg)]), opts) == {"client_ttl": 3.0}


def test_a_config_file_not_utf8_or_setting_a_key_twice_is_a_one_line_error(tmp_path):
    """Found in a trial: a binary file given as --config printed a UnicodeDecodeError
    traceback; "segment-size" and "segment_size" in one file silently took the later."""
    binary = tmp_path / "c.yaml"
    binary.write_bytes(b"\x00\xff\xfe")
    r = _kvpool("master", "--config", str(binary))
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert "is not UTF-8 text" in r.stderr
    twice = tmp_path / "n.yaml"
    twice.write_text("segment-size: 64MiB\nsegment_size: 128MiB\n")
    r = _kvpool("node", "--config", str(twice))
    assert r.returncode == 2 and "sets 'segment-size' twice" in r.stderr


@pytest.mark.parametrize("name,text", [
    ("n.yaml", "segment-size: 64MiB\nport: 5\nsegment-size: 128MiB\n"),
    ("n.json", '{"segment-size": "64MiB", "segment-size": "128MiB"}'),
])
def test_a_key_written_twice_verbatim_is_refused(tmp_path, name, text):
    """Both parsers keep the last of two equal keys silently: which size was meant?"""
    cfg = tmp_path / name
    cfg.write_text(text)
    r = _kvpool("node", "--config", str(cfg))
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert "'segment-size' is set twice" in r.stderr
    if name.endswith(".yaml"):
        assert "line 3" in r.stderr  # where the second one is


def test_a_negative_size_after_its_flag_is_judged_as_a_value():
    """argparse took "-5MiB" for an option: "--segment-size: expected one argument"."""
    r = _kvpool("node", "--segment-size", "-5MiB")
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert "bad value '-5MiB' for segment-size" in r.stderr
    from kvpool.cli import _negative_values_joined
    assert _negative_values_joined(["plan", "--", "-5x.json"]) == ["plan", "--", "-5x.json"]
    assert _negative_values_joined(["a", "--", "--b", "-5MiB"]) == ["a", "--", "--b", "-5MiB"]


def test_a_yaml_merge_key_may_be_overridden(tmp_path):
    """``<<:`` brings another mapping's keys in; setting one of them again is no mistake."""
    cfg = tmp_path / "m.yaml"
    cfg.write_text("base: &b {client-ttl: 3}\nover:\n  <<: *b\n  client-ttl: 4\n")
    assert load_config_file(str(cfg))["over"] == {"client-ttl": 4}
    # a merged mapping merges another and is used again (found by the review)
    cfg.write_text("base: &base {a: 1}\ntop:\n  <<: &mid\n    <<: *base\n    a: 2\nother: *mid\n")
    assert load_config_file(str(cfg)) == {"base": {"a": 1}, "top": {"a": 2}, "other": {"a": 2}}


@pytest.mark.parametrize("size", ["1000000000000000000000000000GiB", "9" * 400 + "GiB", "9" * 5000 + "GiB"],
                         ids=("28_digits", "400_digits", "5000_digits"))
def test_an_absurd_segment_size_is_a_short_one_line_error(size):
    """Found in a trial: a typo'd size printed forty digits of float noise, and one past
    a float's range (400 digits) raised OverflowError; past Python's 4,300-digit limit on
    reading integers (review), ValueError."""
    r = _kvpool("node", "--segment-size", size)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert ("does not fit" in r.stderr or "not a size" in r.stderr) and len(r.stderr) < 300, r.stderr


def test_a_json_config_with_a_byte_order_mark_reads(tmp_path):
    opts = [Option("client-ttl", 10.0, float, "ttl")]
    parser = argparse.ArgumentParser()
    add_options(parser, opts)
    cfg = tmp_path / "m.json"
    cfg.write_bytes(b"\xef\xbb\xbf" + json.dumps({"client-ttl": 3}).encode())
    assert resolve(parser.parse_args(["--config", str(cfg)]), opts) == {"client_ttl": 3.0}


@pytest.mark.parametrize("text", ["1GiB", "16MiB", "3KiB", "2TiB", "1536"])
def test_a_size_is_printed_as_it_would_be_typed(text):
    from kvpool.config import format_size, parse_size

    shown = format_size(parse_size(text))
    assert parse_size(shown.replace(" bytes", "")) == parse_size(text)
    assert shown == (text if text[-1] == "B" else "1536 bytes")
