"""`kvpool bench links`: the crossover arithmetic, and one tiny run of the real rig
(master and node in their own network namespace, a tc-shaped veth pair, the reference
engine loading its prefix from the store over it) where the machine allows it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from kvpool.bench.links import agreement, measured_crossover
from kvpool.cli import main


def test_measured_crossover_interpolates_the_sign_change():
    assert measured_crossover([(256, 50.0), (512, 10.0), (1024, -30.0)]) == \
        {"tokens": 512 + 512 * 10 / 40, "relation": "between"}
    assert measured_crossover([(256, -1.0), (512, -5.0)])["relation"] == "below"
    assert measured_crossover([(256, 3.0), (512, 1.0)])["relation"] == "above"
    # noise crossing back and forth: the last change to "fetch wins" counts
    assert measured_crossover([(1, 1.0), (2, -1.0), (3, 1.0), (4, -1.0)])["tokens"] == 3.5


def test_agreement_within_range_and_outside():
    inside = agreement({"tokens": 1000.0, "relation": "between"}, 1100, [256, 2048])
    assert inside["error"] == pytest.approx(0.1) and inside["within_tolerance"]
    assert not agreement({"tokens": 1000.0, "relation": "between"}, 1300,
                         [256, 2048])["within_tolerance"]
    both_below = agreement({"tokens": None, "relation": "below"}, 40, [256, 2048])
    assert both_below["within_tolerance"] and both_below["error"] is None
    assert not agreement({"tokens": None, "relation": "below"}, None, [256, 2048])["within_tolerance"]


def _netns_allowed() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    probe = subprocess.run(["ip", "netns", "add", f"kvb-probe-{os.getpid()}"], capture_output=True)
    subprocess.run(["ip", "netns", "del", f"kvb-probe-{os.getpid()}"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _netns_allowed(), reason="needs root with ip netns and tc")
def test_tiny_run_loads_every_prefix_over_the_shaped_link(tmp_path, capsys):
    out = tmp_path / "links.json"
    assert main(["bench", "links", "--model", "tiny-random", "--prefixes", "32,64,128",
                 "--rates", "0.05,5", "--repeats", "1", "--segment-size", "64MiB",
                 "--json", str(out), "--plot", str(tmp_path / "links.png")]) == 0
    doc = json.loads(out.read_text())
    assert [link["gbit"] for link in doc["links"]] == [0.05, 5.0]
    for link in doc["links"]:
        assert [r["prefix"] for r in link["rows"]] == [32, 64, 128]
        assert all(r["fetch_ms"] > 0 and r["recompute_ms"] > 0 for r in link["rows"])
        assert link["crossover_measured"]["relation"] in ("below", "between", "above")
    assert "tbf" in doc["tc"]  # the shaper was on the server end of the link
    assert (tmp_path / "links.png").stat().st_size > 0
    assert "crossover measured" in capsys.readouterr().out
    assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                          text=True).stdout.split() if n.startswith("kvb-")
                and str(os.getpid()) in n]  # namespaces removed
