"""``kvpool bench master`` end to end with small sizes: a real master process filled over
its port, and a simulated pool of 1,000 segments that mount, heartbeat and take load.

Behaviour only (rows filled, bytes per object bounded as a ratio, every segment used,
no node dropped, eviction running, files written), never timings.
"""

from __future__ import annotations

import json

import pytest

from kvpool.cli import main


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-master")
    rc = main(["bench", "master", "--sizes", "5e3,5e4", "--window", "5000", "--probes", "2",
               "--segments", "10,1000", "--pool-objects", "5000", "--rounds", "3", "--no-progress",
               "--json", str(out / "r.json"), "--plot", str(out / "r.png"), "--log-dir", str(out / "logs")])
    return rc, json.loads((out / "r.json").read_text()), out / "r.png"


def test_objects_rows_measure_memory_and_every_operation(small_run):
    rc, doc, _ = small_run
    assert rc == 0 and doc["schema"] == "kvpool.bench.master/1"
    rows = doc["objects"]
    assert [r["objects"] for r in rows] == [5000, 50_000]
    for r in rows:
        assert r["misses"] == 0  # every probed key was found
        for op in ("put", "exist", "get"):
            assert r[op]["ops"] > 0 and r[op]["ops_per_s"] > 0 and r[op]["master_us_per_op"] is not None
    # RSS growth at 5e4 objects: the records, not a fixed cost, and well under the target
    assert 0 < rows[-1]["bytes_per_object"] <= 400


def test_a_thousand_simulated_segments_mount_heartbeat_and_all_take_objects(small_run):
    _, doc, _ = small_run
    pools = {r["segments"]: r for r in doc["pool"]}
    assert set(pools) == {10, 1000}
    for count, r in pools.items():
        assert r["owners"] == count and r["heartbeats_refused"] == 0  # no node dropped
        assert r["puts_stored"] == 3 * 1000  # a full pool still takes every put...
        assert r["evicted"] >= 3 * 1000  # ...by evicting
        assert r["heartbeat"]["ops"] >= 2000 // count * count
    assert pools[1000]["segments_holding"] >= 990  # allocation reaches across the pool


def test_verdicts_and_plot(small_run):
    _, doc, png = small_run
    names = [v["target"] for v in doc["verdicts"]]
    assert any("bytes/object" in n for n in names) and any("heartbeat" in n for n in names)
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("argv, words", [
    (["--sizes", "many"], "not a number"),
    (["--sizes", "0.5"], "whole number"),
    (["--segments", "5000"], "at most 4096"),
    (["--key-bytes", "8"], "--key-bytes"),
])
def test_bad_options_are_one_line_errors(argv, words, capsys):
    assert main(["bench", "master", "--segments", "0", *argv] if "--segments" not in argv
                else ["bench", "master", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
