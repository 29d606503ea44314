"""Every subcommand checks its options before any expensive work, in one line.

A typo must cost nothing: no model load, no cluster, no benchmark cell. Each case runs
the real ``kvpool`` of this checkout and expects exit 2 with one line naming the flag
(a command that starts working instead is stopped and fails, see ``run_kvpool``).
"""

import argparse

import pytest

from kvpool.config import Option, add_options, resolve
from kvpool.errors import UserError
from proc_helpers import run_kvpool

TINY = ["--model", "tiny-random"]
GEN = ["generate", *TINY, "--prompt", "hi"]
DEMO = ["demo", *TINY]

REFUSED = [
    # generate: before the model loads
    ([*GEN, "--l1-size", "banana"], "not a size: 'banana'"),
    ([*GEN, "--l1-size", "0"], "--l1-size 0: the L1 pool must hold at least one page"),
    ([*GEN, "--page-size", "0"], "--page-size must be >= 1, got 0"),
    ([*GEN, "--reserve-tokens", "-1"], "--reserve-tokens must be >= 0, got -1"),
    ([*GEN, "--threads", "0"], "--threads must be >= 1, got 0"),
    ([*GEN, "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    ([*GEN, "--master", "host:port"], "host:port"),
    (["generate", "--model", "no-such-model", "--prompt", "hi"], "unknown model 'no-such-model'"),
    # demo: before the cluster starts
    ([*DEMO, "--page-size", "0"], "--page-size must be >= 1, got 0"),
    ([*DEMO, "--l1-size", "12XB"], "not a size: '12XB'"),
    ([*DEMO, "--questions", "0"], "--questions must be >= 1, got 0"),
    ([*DEMO, "--segment-size", "1"], "--segment-size 1: a segment must be at least 1MiB"),
    ([*DEMO, "--segment-size", "999999TiB"], "does not fit"),
    ([*DEMO, "--json", "/nonexistent/x.json"], "--json /nonexistent/x.json: folder /nonexistent"),
    # serve and node: before any segment is created or master contacted
    (["serve", "--segment-size", "999999TiB"], "--segment-size 1,023,998,976.00 GiB does not fit"),
    (["node", "--segment-size", "100TiB"], "--segment-size 102,400.00 GiB does not fit"),
    (["node", "--segment-size", "100TiB", "--prefault", "no"], "GiB free in /dev/shm"),
    (["node", "--host", "0.0.0.0"], "--host 0.0.0.0: a node announces its --host to clients"),
    (["master", "--busy-poll", "-5"], "bad value '-5' for busy-poll (from flag): must be >= 0"),
    # a TTL of NaN started a master that then failed every MountSegment
    (["master", "--client-ttl", "nan"], "bad value 'nan' for client-ttl (from flag): must be a finite number"),
    (["master", "--frame-timeout", "inf"], "for frame-timeout (from flag): must be a finite number"),
    (["node", "--frame-timeout", "inf"], "for frame-timeout (from flag): must be a finite number"),
    # output folders: a line naming the flag, not a traceback or "cannot listen"
    (["master", "--ready-file", "/nonexistent/dir/r.json"], "--ready-file /nonexistent/dir/r.json: folder"),
    (["node", "--ready-file", "/nonexistent/dir/r.json"], "--ready-file /nonexistent/dir/r.json: folder"),
    (["serve", "--log-dir", "/proc/nope"], "--log-dir /proc/nope: cannot make the folder"),
    ([*DEMO, "--log-dir", "/proc/nope"], "--log-dir /proc/nope: cannot make the folder"),
    ([*DEMO, "--log-dir", __file__], "cannot make the folder: File exists"),
    (["bench", "master", "--log-dir", "/proc/nope"], "--log-dir /proc/nope: cannot make the folder"),
    # bench: before the first cell, not at the end of the run
    (["bench", "store", "--quick", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["bench", "store", "--quick", "--l3-load-repeats", "-1"], "--l3-load-repeats must be >= 0, got -1"),
    (["bench", "store", "--quick", "--json", "/nonexistent/x.json"], "folder /nonexistent"),
    (["bench", "store", "--quick", "--plot", "/nonexistent/x.png"], "folder /nonexistent"),
    (["bench", "cache", "--json", "/nonexistent/x.json"], "folder /nonexistent"),
    (["bench", "cache", "--quick", "--json", "/nonexistent/x.json"], "folder /nonexistent"),
    (["bench", "cache", "--engine", "--page-size", "0"], "--page-size must be >= 1, got 0"),
    (["bench", "cache", "--engine", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    # plan: an unknown name lists the shipped ones
    (["plan", "kv", "llama-9"], "shipped configs: deepseek-v3, "),
    (["plan", "prefill", "llama-9", "--prompt", "100"], "llama-3-8b, mistral-7b"),
    (["plan", "prefill", "smollm2-135m", "--prompt", "100", "--measure", "--repeats", "0"],
     "--repeats must be >= 1, got 0"),
    (["plan", "prefill", "smollm2-135m", "--prompt", "100", "--measure", "--threads", "-1"],
     "--threads must be >= 0, got -1"),
    (["plan", "prefill", "smollm2-135m", "--prompt", "100", "--measure", "--out",
      f"{__file__}/sub/plan"], "test_cli_checks.py is not a folder"),
]


@pytest.mark.parametrize("args, message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_bad_option_is_refused_at_once_in_one_line(args, message):
    r = run_kvpool(*args, timeout_s=60)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "loading model" not in r.stderr and "kvpool master" not in r.stdout


@pytest.mark.parametrize("command", [["master"], ["bench", "store"]])
def test_an_unknown_flag_comes_with_its_subcommands_usage(command):
    """argparse's usage and error line, of the subcommand typed, not of ``kvpool``."""
    r = run_kvpool(*command, "--bogus", timeout_s=60)
    name = " ".join(["kvpool", *command])
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith(f"usage: {name} [-h]"), r.stderr
    assert lines[-1] == f"{name}: error: unrecognized arguments: --bogus", r.stderr


def test_one_bad_count_names_only_its_flag():
    r = run_kvpool(*DEMO, "--page-size", "0")
    assert "--page-size" in r.stderr
    assert not any(f in r.stderr for f in ("--threads", "--questions", "--max-new-tokens"))


def _resolve_file(tmp_path, name: str, text: str) -> dict:
    opts = [Option("client-ttl", 10.0, float, "ttl")]
    parser = argparse.ArgumentParser()
    add_options(parser, opts)
    cfg = tmp_path / name
    cfg.write_text(text)
    return resolve(parser.parse_args(["--config", str(cfg)]), opts)


@pytest.mark.parametrize("name", ["master.json", "master.yaml"])
def test_invalid_json_config_is_reported_as_invalid_json(tmp_path, name):
    # YAML's flow syntax reads `{client-ttl: 3}` as a mapping: a .json file, or text
    # that opens like JSON, is JSON and must not be read as something else
    with pytest.raises(UserError, match=r"is not valid JSON: Expecting property name"):
        _resolve_file(tmp_path, name, "{client-ttl: 3}\n")
    assert _resolve_file(tmp_path, name, '{"client-ttl": 3}') == {"client_ttl": 3.0}


def test_yaml_config_still_reads(tmp_path):
    assert _resolve_file(tmp_path, "m.yaml", "client-ttl: 4\n") == {"client_ttl": 4.0}
    with pytest.raises(UserError, match="is not valid YAML") as bad:
        _resolve_file(tmp_path, "m.yaml", "client-ttl: [4\n")
    assert "\n" not in str(bad.value)  # one line, with where the [ opened and where it ended
    assert "while parsing a flow sequence (line 1, column 13): expected ',' or ']'" in str(bad.value)
    assert str(bad.value).endswith("(line 2, column 1)")


def test_generate_reads_master_as_kvpool_node_does():
    """Found in a trial: `kvpool node --master host` meant host:50051 while `kvpool
    generate --master host` refused it ("needs a port"), and generate took no HA spec."""
    r = run_kvpool("generate", "--master", "nosuchhost.invalid", "--prompt", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "nosuchhost.invalid:50051" in r.stderr, r.stderr
    r = run_kvpool("generate", "--master", "127.0.0.1:1,:x", "--prompt", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "bad port in address ':x'" in r.stderr, r.stderr
