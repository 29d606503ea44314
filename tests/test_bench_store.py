"""``kvpool bench store`` runs its own code path end to end with tiny sizes.

Real processes everywhere (kvpool clusters, Mooncake and Redis when installed); the tests
check behaviour (cells filled, bytes verified, absent anchors reported, files written),
never timings.
"""

from __future__ import annotations

import json
import tempfile

import pytest

from kvpool.bench.harness import Bench, CellSpec, Target
from kvpool.bench.store_plan import Column, Row
from kvpool.bench.store_report import (
    Figures, Summary, format_small_ops, format_table, format_verdicts, small_ops, verdicts,
)
from kvpool.bench.worker import Worker
from kvpool.cli import main
from proc_helpers import poll_until

TINY = ["bench", "store", "--sizes", "4KiB,64KiB", "--batches", "4", "--repeats", "1",
        "--budget", "0.01", "--working-set", "256KiB", "--segment-size", "64MiB",
        "--put-cap", "1MiB", "--no-progress", "--l3-load-repeats", "1"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = main([*TINY, "--json", str(out / "r.json"), "--plot", str(out / "r.png"),
               "--log-dir", str(out / "logs")])
    return rc, json.loads((out / "r.json").read_text()), out / "r.png"


def test_tiny_run_fills_every_cell_of_every_present_column(tiny_run):
    rc, doc, _ = tiny_run
    assert rc == 0
    assert doc["schema"] == "kvpool.bench.store/1"
    always = {"kvpool in-proc", "kvpool shm", "kvpool tcp", "memcpy", "tcp-stream", "tcp-rr"}
    present = {name for name, col in doc["columns"].items() if col["absent"] is None}
    assert always <= present
    cells = [c for c in doc["cells"] if c["column"] in present]
    assert cells
    for cell in cells:
        assert {"size", "api", "op", "batch", "metric", "gbps", "ops_per_s", "p50_us",
                "p99_us", "repeats", "error"} <= set(cell)
        if "has no" in (cell["error"] or ""):
            continue  # e.g. Redis has no zero-copy API: an empty cell, not a failure
        assert cell["error"] is None, cell
        assert cell["gbps"] > 0 and cell["ops_per_s"] > 0
        assert len(cell["repeats"]) == 1
    kvpool_rows = {(c["size"], c["api"], c["op"], c["batch"])
                   for c in cells if c["column"] == "kvpool shm"}
    assert (4096, "batch", "get", 4) in kvpool_rows and (65536, "zero_copy", "put", 1) in kvpool_rows
    limit_cells = [c for c in cells if c["column"] == "memcpy"]
    assert {(c["size"], c["api"], c["op"]) for c in limit_cells} == {
        (c["size"], c["api"], c["op"]) for c in cells if c["column"] == "kvpool shm"}


def test_tiny_run_records_memory_and_verdicts(tiny_run):
    _, doc, _ = tiny_run
    stats = doc["columns"]["kvpool shm"]["stats"]
    assert stats["segment_size"] == 64 << 20
    assert stats["node_rss_bytes"] > 0 and "client_own_bytes" in stats
    assert doc["ratios"] and all(r["value"] > 0 for r in doc["ratios"])
    targets = {v["target"] for v in doc["verdicts"]}
    assert any(t.startswith("node peak RSS") for t in targets)
    assert any(t.startswith("4KiB get p50") for t in targets)
    # the demo's L3 load, side by side with a memcpy of its bytes
    assert doc["l3_load"]["pages"] == 138 and doc["l3_load"]["bytes"] == 138 * 737_280
    assert doc["l3_load"]["ratio"] > 0
    assert any(v["target"].startswith("demo L3 load") and v["value"] == doc["l3_load"]["ratio"]
               for v in doc["verdicts"])
    # a small get against the bare control-plane round trip, per kvpool column
    small = {it["column"]: it for it in doc["small_ops"]}
    assert {"kvpool in-proc", "kvpool shm", "kvpool tcp"} <= set(small)
    for it in small.values():
        assert it["ping_p50_us"] > 0 and it["get_4KiB_p50_us"] > 0
        assert it["get_per_ping"] == pytest.approx(it["get_4KiB_p50_us"] / it["ping_p50_us"])


def test_tiny_run_writes_a_png(tiny_run):
    _, _, png = tiny_run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_anchors_present_or_absent_with_a_reason(tiny_run):
    _, doc, _ = tiny_run
    for name in ("kvpool veth", "mooncake in-proc", "mooncake x-proc", "redis"):
        col = doc["columns"][name]
        if col["absent"] is None:
            assert any(c["column"] == name and c["error"] is None for c in doc["cells"])
        else:
            assert col["absent"]  # a reason, and the run went on


def test_missing_anchor_binaries_become_absent_columns(tmp_path, capsys, monkeypatch):
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the logs' folder is made
    rc = main(["bench", "store", "--sizes", "4KiB", "--apis", "bytes", "--ops", "get",
               "--repeats", "1", "--budget", "0.01", "--working-set", "64KiB",
               "--segment-size", "16MiB", "--no-progress", "--only", "redis,mooncake x-proc,memcpy",
               "--l3-load-repeats", "0",
               "--redis-server", str(tmp_path / "no-redis"),
               "--mooncake-master", str(tmp_path / "no-mooncake"),
               "--json", str(tmp_path / "r.json")])
    assert rc == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert "not found" in doc["columns"]["redis"]["absent"]
    assert doc["columns"]["mooncake x-proc"]["absent"]
    assert doc["columns"]["memcpy"]["absent"] is None
    assert not [c for c in doc["cells"] if c["column"] in ("redis", "mooncake x-proc")]
    out, err = capsys.readouterr()
    assert "absent: redis" in out
    kept = list(temp.glob("kvpool-bench-*"))  # the logs that explain an absent column stay
    assert len(kept) == 1 and (kept[0] / "redis.log").is_file()
    assert f"logs kept in {kept[0]} (a column was absent)" in err


def test_a_run_that_ends_well_leaves_no_logs_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rc = main(["bench", "store", "--sizes", "4KiB", "--apis", "bytes", "--ops", "get", "--repeats", "1",
               "--budget", "0.01", "--working-set", "64KiB", "--no-progress", "--only", "memcpy",
               "--l3-load-repeats", "0"])
    assert rc == 0
    assert "memcpy" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # the temporary logs' folder is gone


@pytest.mark.parametrize("argv, words", [
    (["--sizes", "lots"], "not a size"),
    (["--apis", "mmap"], "unknown API"),
    (["--ops", "scan"], "unknown op"),
    (["--batches", "0"], "must be > 0"),
])
def test_bad_options_are_one_line_errors(argv, words, capsys):
    assert main(["bench", "store", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_bench_without_subcommand_explains(capsys):
    assert main(["bench"]) == 2
    assert "kvpool bench store" in capsys.readouterr().err


class _Corrupting(Target):
    """A store that hands back other bytes than it was given: the check must catch it."""

    name = "corrupting"

    def __init__(self):
        self.data = {}

    def put_from(self, key, buf):
        self.data[key] = buf.copy()

    def get_into(self, key, buf):
        buf[:] = self.data[key]
        buf[0] ^= 0xFF
        return buf.nbytes

    def batch_put_from(self, keys, bufs):
        for k, b in zip(keys, bufs):
            self.put_from(k, b)

    def remove(self, keys):
        for k in keys:
            self.data.pop(k, None)


def test_wrong_bytes_fail_the_cell_not_the_run():
    result = Bench(_Corrupting()).run(CellSpec("zero_copy", "get", 4096, budget_s=0.01,
                                               working_set=8192))
    assert result.error and "wrong bytes" in result.error and result.gbps is None


def test_the_tcp_limits_send_resident_distinct_bytes():
    """Found measuring: the stream's sources were ``bytes(size)``, which CPython takes
    from calloc, whose large blocks map the kernel's one zero page: the sender read a
    single cached 4 KiB page (64 x 1 MiB kept 14 MB resident) and the limit came out
    faster than any store's values allow. Its sources are now random bytes: every page
    of every source was written (so it is resident and its own), and no two are alike."""
    import numpy as np

    from kvpool.bench.systems.limits import resident_sources

    sources = resident_sources(1 << 20, 8)
    assert all(len(s) == 1 << 20 for s in sources)
    for source in sources:
        pages = np.frombuffer(source, np.uint8).reshape(-1, 4096)
        assert pages.any(axis=1).all(), "a page of zeros: never written"
    assert len({bytes(s[:64]) for s in sources}) == 8


def test_worker_for_an_unknown_target_is_absent(tmp_path):
    w = Worker("ghost", "kvpool.bench.no_such_module:Nothing", log_path=str(tmp_path / "w.log"))
    assert not w.start()
    assert "no_such_module" in w.absent
    assert w.cell(CellSpec("bytes", "get", 4096)).error


def _summary(metric: str, *values: float) -> Summary:
    """A column's figures over repeats, as the controller records them."""
    reps = [{"gbps": None, "ops_per_s": None, "p50_us": None, metric: v} for v in values]
    return Summary(**{metric: sorted(values)[len(values) // 2]}, repeats=reps)


def test_ratios_pair_repeats_and_verdicts_follow_them():
    cols = [Column("kvpool shm", "", kind="kvpool"), Column("mooncake x-proc", ""),
            Column("memcpy", "", kind="limit")]
    big, small = Row(1 << 20, "zero_copy", "get"), Row(4096, "zero_copy", "get")
    # the machine slowed down 3x during repeat 1: paired ratios stay 3.0 and 0.75
    fig = Figures({("kvpool shm", big): _summary("gbps", 6.0, 2.0, 6.0),
                   ("mooncake x-proc", big): _summary("gbps", 2.0, 2.0 / 3, 2.0),
                   ("memcpy", big): _summary("gbps", 8.0, 8.0 / 3, 8.0),
                   ("kvpool shm", small): _summary("p50_us", 50.0, 60.0, 50.0),
                   ("mooncake x-proc", small): _summary("p50_us", 100.0, 120.0, 100.0)}, cols)
    assert fig.ratio("kvpool shm", "mooncake x-proc", big) == pytest.approx(3.0)
    table = format_table([big, small], cols, fig)
    assert "3.00x" in table and "0.75x" in table and "0.50x" in table
    vs = {v.name: v for v in verdicts([big, small], fig, {})}
    assert vs["same host >=1MiB: kvpool shm / mooncake x-proc >= 2.5"].met is True
    assert vs["same host >=1MiB: kvpool shm / memcpy >= 0.6"].measured == pytest.approx(0.75)
    p50 = vs["4KiB get p50: kvpool shm / mooncake x-proc <= 1.0"]
    assert p50.met is True and p50.measured == pytest.approx(0.5)
    assert vs["TCP >=1MiB: kvpool tcp / tcp-stream >= 0.8"].met is None  # column absent
    memory = {"kvpool tcp": {"segment_size": 64 << 20, "node_peak_rss_bytes": 200 << 20,
                             "client_own_bytes": 10 << 20}}
    vs = {v.name: v for v in verdicts([], fig, memory)}
    assert vs["node peak RSS <= segment + 100 MiB (MiB)"].met is False
    assert vs["client without segment, own RSS beyond python+numpy <= 150 MiB"].met is True


ALL_COLUMNS = [Column("kvpool in-proc", "", kind="kvpool"), Column("kvpool shm", "", kind="kvpool"),
               Column("kvpool tcp", "", kind="kvpool"), Column("mooncake in-proc", ""),
               Column("mooncake x-proc", ""), Column("redis", ""), Column("memcpy", "", kind="limit")]
GET4, PUT4 = Row(4096, "bytes", "get"), Row(4096, "bytes", "put")
PUT4_ZC, BATCH128 = Row(4096, "zero_copy", "put"), Row(4096, "batch", "get", 128)
GET1M = Row(1 << 20, "zero_copy", "get")


def _verdicts(cells: dict[tuple[str, Row], float]) -> dict[str, list]:
    """Verdicts by target on canned figures: one repeat per cell, in the row's own metric."""
    fig = Figures({(col, row): _summary(row.metric, v) for (col, row), v in cells.items()},
                  ALL_COLUMNS)
    out: dict[str, list] = {}
    for v in verdicts([GET4, PUT4, PUT4_ZC, BATCH128, GET1M], fig, {}):
        out.setdefault(v.name, []).append(v)
    return out


@pytest.mark.parametrize("shm, tcp, met", [(110.0, 100.0, (False, True)),  # 1.1x: missed since 1.0
                                           (90.0, 130.0, (True, False))])
def test_4kib_get_p50_is_held_to_mooncake_cross_process(shm, tcp, met):
    vs = _verdicts({("kvpool shm", GET4): shm, ("kvpool tcp", GET4): tcp,
                    ("mooncake x-proc", GET4): 100.0})
    got = [vs[f"4KiB get p50: {col} / mooncake x-proc <= 1.0"] for col in ("kvpool shm", "kvpool tcp")]
    assert tuple(v.met for [v] in got) == met
    assert [v.measured for [v] in got] == pytest.approx([shm / 100, tcp / 100])


@pytest.mark.parametrize("shm, met", [(120.0, False), (80.0, True), (100.0, True)])
def test_4kib_put_p50_is_held_to_redis_on_the_rows_redis_has(shm, met):
    vs = _verdicts({("kvpool shm", PUT4): shm, ("redis", PUT4): 100.0,
                    ("kvpool shm", PUT4_ZC): 500.0})  # Redis has no zero-copy API: no verdict
    [v] = vs["4KiB put p50: kvpool shm / redis <= 1.0"]
    assert v.detail == PUT4.label and v.higher_is_better is False
    assert v.met is met and v.measured == pytest.approx(shm / 100)


@pytest.mark.parametrize("factor, met", [(0.9, (True, False, False)),   # p50, obj/s, GB/s
                                         (1.1, (False, True, True))])
def test_in_process_is_held_to_mooncake_in_process_on_every_row(factor, met):
    mooncake = {GET4: 100.0, PUT4: 100.0, BATCH128: 100e3, GET1M: 4.0}
    cells = {("mooncake in-proc", r): v for r, v in mooncake.items()}
    cells |= {("kvpool in-proc", r): v * factor for r, v in mooncake.items() if r != PUT4}
    vs = _verdicts(cells)
    p50 = vs["in-proc, p50 rows: kvpool in-proc / mooncake in-proc <= 1.0"]
    obj = vs["in-proc, obj/s rows: kvpool in-proc / mooncake in-proc >= 1.0"]
    gbps = vs["in-proc, GB/s rows: kvpool in-proc / mooncake in-proc >= 1.0"]
    assert [v.detail for v in p50] == [GET4.label, PUT4.label, PUT4_ZC.label]
    assert [v.measured for v in p50][1:] == [None, None]  # a figure missing: not judged
    assert (p50[0].met, obj[0].met, gbps[0].met) == met
    assert [v.measured for v in (p50[0], obj[0], gbps[0])] == pytest.approx([factor] * 3)
    assert (p50[0].higher_is_better, obj[0].higher_is_better, gbps[0].higher_is_better) == (
        False, True, True)


def test_small_ops_pair_each_ping_with_its_columns_4kib_get():
    get = Row(4096, "bytes", "get")
    fig = Figures({("kvpool shm", get): Summary(p50_us=60.0, repeats=[{"p50_us": 60.0}])},
                  [Column("kvpool shm", "t", kind="kvpool"), Column("kvpool tcp", "t", kind="kvpool")])
    items = small_ops(fig, {"kvpool shm": {"ping_p50_us": 20.0}, "kvpool tcp": {"ping_p50_us": 40.0},
                            "mooncake x-proc": {}})
    assert items == [{"column": "kvpool shm", "ping_p50_us": 20.0, "get_4KiB_p50_us": 60.0, "get_per_ping": 3.0},
                     {"column": "kvpool tcp", "ping_p50_us": 40.0, "get_4KiB_p50_us": None, "get_per_ping": None}]
    assert format_small_ops(items).splitlines() == [
        "  kvpool shm: Ping p50 20 us; 4KiB bytes get p50 60 us = 3.00x a Ping", "  kvpool tcp: Ping p50 40 us"]


def test_format_verdicts_prints_the_issue_targets():
    vs = _verdicts({("kvpool shm", GET4): 110.0, ("kvpool tcp", GET4): 90.0,
                    ("mooncake x-proc", GET4): 100.0, ("kvpool shm", PUT4): 120.0,
                    ("redis", PUT4): 100.0, ("kvpool in-proc", GET4): 90.0,
                    ("mooncake in-proc", GET4): 100.0, ("kvpool in-proc", BATCH128): 90e3,
                    ("mooncake in-proc", BATCH128): 100e3, ("kvpool in-proc", GET1M): 5.0,
                    ("mooncake in-proc", GET1M): 4.0})
    lines = format_verdicts([v for group in vs.values() for v in group]).splitlines()
    expect = [
        "  MISS  4KiB get p50: kvpool shm / mooncake x-proc <= 1.0: 0/1 rows; worst 4KiB bytes     get = 1.10 (threshold 1)",
        "  MET   4KiB get p50: kvpool tcp / mooncake x-proc <= 1.0: 1/1 rows; worst 4KiB bytes     get = 0.90 (threshold 1)",
        "  MISS  4KiB put p50: kvpool shm / redis <= 1.0: 0/1 rows; worst 4KiB bytes     put = 1.20 (threshold 1)",
        "  MET   in-proc, p50 rows: kvpool in-proc / mooncake in-proc <= 1.0: 1/1 rows; worst 4KiB bytes     get = 0.90 (threshold 1)",
        "  MISS  in-proc, obj/s rows: kvpool in-proc / mooncake in-proc >= 1.0: 0/1 rows; worst 4KiB batch128  get = 0.90 (threshold 1)",
        "  MET   in-proc, GB/s rows: kvpool in-proc / mooncake in-proc >= 1.0: 1/1 rows; worst 1MiB zero_copy get = 1.25 (threshold 1)",
    ]
    for line in expect:
        assert line in lines


def test_a_benchmark_module_not_in_the_build_is_a_clear_error():
    from kvpool.bench import cli as bench_cli
    from kvpool.errors import UserError

    parser = bench_cli._LazyParser(prog="kvpool bench nope", module="kvpool.bench.no_such_bench")
    args = parser.parse_args(["--anything", "x"])
    args.bench = "nope"
    with pytest.raises(UserError, match="not in this build"):
        bench_cli.run(args)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_whose_controller_vanishes_stops_its_cluster(tmp_path):
    w = Worker("kvpool shm", "kvpool.bench.systems.kvpool:KvpoolTarget",
               {"segment_size": 16 << 20, "log_dir": str(tmp_path)}, log_path=str(tmp_path / "w.log"))
    assert w.start(), w.absent
    pids = w.info["pids"]
    assert pids and all(_alive(p) for p in pids)
    w.proc.stdin.close()  # what the worker sees when the controller is killed
    w.proc.wait(timeout=30)
    poll_until(lambda: not any(_alive(p) for p in pids), 15, 0.05)
    assert not any(_alive(p) for p in pids)
    w.proc.stdout.close()
