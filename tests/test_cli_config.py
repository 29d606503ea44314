"""Settings of `kvpool master|node|serve`: ports are checked, config-file typos are errors."""

from __future__ import annotations

import argparse
import json

import pytest

from kvpool.cli import main
from kvpool.config import Option, add_options, parse_port, resolve
from kvpool.errors import UserError


@pytest.mark.parametrize("command", ["master", "node", "serve"])
@pytest.mark.parametrize("flag", ["--port", "--http-port"])
@pytest.mark.parametrize("value", ["70000", "65536", "-5", "x", "1.5"])
def test_out_of_range_ports_are_one_line_errors(command, flag, value, capsys):
    assert main([command, flag, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert repr(value) in err and flag[2:] in err and "0 to 65535" in err


def test_port_from_env_and_file_is_checked_too(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVPOOL_MASTER_PORT", "70000")
    assert main(["master"]) == 2
    assert "(from env)" in capsys.readouterr().err
    monkeypatch.delenv("KVPOOL_MASTER_PORT")
    cfg = tmp_path / "master.yaml"
    cfg.write_text("port: 99999\n")
    assert main(["master", "--config", str(cfg)]) == 2
    assert "(from config file)" in capsys.readouterr().err


@pytest.mark.parametrize("value, port", [("0", 0), ("65535", 65535), (8080, 8080), (" 80 ", 80)])
def test_parse_port_accepts_the_whole_range(value, port):
    assert parse_port(value) == port


@pytest.mark.parametrize("value", [True, -1, 65536, "", "8080x"])
def test_parse_port_rejects(value):
    with pytest.raises(UserError, match="0 to 65535"):
        parse_port(value)


def test_unknown_config_key_names_it_and_the_known_keys(tmp_path, capsys):
    cfg = tmp_path / "node.yaml"
    cfg.write_text("segment-sise: 12XB\n")
    assert main(["node", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "'segment-sise'" in err and "did you mean 'segment-size'" in err
    assert "known: host, http-port, master, port, prefault, segment-size" in err


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
