"""``kvpool bench store``: kvpool's data path against Mooncake Store, Redis and the machine.

Every system runs in its own worker process (:mod:`kvpool.bench.anchors_base`). For each
value size, API and operation, the controller measures one repeat in every column, then
the next repeat in every column (rotating the order), so kvpool and its anchors share the
same minutes of a noisy machine and their ratios stay fair. Figures are medians over
repeats: GB/s (10^9 payload bytes per second), objects/s, p50 and p99 call latency.

Columns (absent, with the reason, when they cannot run here):

==================  ========================================================================
kvpool in-proc      the client holds the segment itself (no node): same process
kvpool shm          client and node in different processes on this host: shared-memory mapping
kvpool tcp          the same, with every byte over the node's TCP port (``force_tcp=True``)
kvpool veth         client in another network namespace, joined to the node by a veth pair
mooncake in-proc    Mooncake client that holds the segment itself (local copy)
mooncake x-proc     Mooncake client without segment; another process holds it (TCP)
redis               redis-server on 127.0.0.1, redis-py
memcpy              numpy copy into a preallocated buffer (limit of a same-host copy)
tcp-stream          one loopback TCP stream, sendall -> recv_into (limit of one connection)
==================  ========================================================================
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from kvpool.bench.anchors_base import CellResult, CellSpec, Worker
from kvpool.bench.anchors_netns import private_netns_prefix
from kvpool.config import parse_size
from kvpool.errors import UserError

HELP = "benchmark the store's data path against Mooncake, Redis and the machine's limits"
SCHEMA = "kvpool.bench.store/1"

_KIB, _MIB = 1 << 10, 1 << 20
DEFAULT_SIZES = "4KiB,64KiB,1MiB,16MiB"
QUICK_SIZES = "4KiB,1MiB"
DEFAULT_BATCHES = "16,128"


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Column:
    """One system column: the worker that measures it and what it is compared with."""

    name: str
    target: str
    cfg: dict = field(default_factory=dict, hash=False, compare=False)
    prefix: tuple[str, ...] = ()
    kind: str = "anchor"  # "kvpool" | "anchor" | "limit"


@dataclass(frozen=True)
class Row:
    """One line of the table: an operation of an API on values of ``size`` bytes."""

    size: int
    api: str
    op: str
    batch: int = 1

    @property
    def label(self) -> str:
        api = f"batch{self.batch}" if self.api == "batch" else self.api
        return f"{fmt_size(self.size):>6} {api:<9} {self.op}"

    @property
    def metric(self) -> str:
        """What the table shows for this row: 'gbps', 'ops_per_s' or 'p50_us'."""
        if self.size >= 64 * _KIB:
            return "gbps"
        return "ops_per_s" if self.api == "batch" else "p50_us"


def fmt_size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", _MIB), ("KiB", _KIB)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n}B"


def parse_list(text: str, parse) -> list:
    try:
        items = [parse(x.strip()) for x in str(text).split(",") if x.strip()]
    except (ValueError, UserError) as exc:
        raise UserError(f"bad list {text!r}: {exc}") from None
    if not items:
        raise UserError(f"empty list {text!r}")
    return items


def plan_rows(sizes: list[int], apis: list[str], ops: list[str], batches: list[int],
              max_batch_bytes: int) -> list[Row]:
    """Rows in run order; batches above ``max_batch_bytes`` per call are left out."""
    rows = []
    for size in sizes:
        for api in apis:
            for op in ops:
                if api != "batch":
                    rows.append(Row(size, api, op))
                    continue
                rows.extend(Row(size, api, op, b) for b in batches if b * size <= max_batch_bytes)
    return rows


def plan_columns(args, log_dir: str) -> list[Column]:
    """The columns this run measures, from the command-line switches."""
    seg = args.segment_size

    def logs(name: str) -> str:  # each cluster's master/node logs in their own folder
        return os.path.join(log_dir, name.replace(" ", "_"))

    cols = [Column("kvpool in-proc", "kvpool.bench.anchors_kvpool:KvpoolTarget",
                   {"client_segment": seg, "log_dir": logs("kvpool in-proc")}, kind="kvpool"),
            Column("kvpool shm", "kvpool.bench.anchors_kvpool:KvpoolTarget",
                   {"segment_size": seg, "force_tcp": False, "log_dir": logs("kvpool shm")},
                   kind="kvpool"),
            Column("kvpool tcp", "kvpool.bench.anchors_kvpool:KvpoolTarget",
                   {"segment_size": seg, "force_tcp": True, "log_dir": logs("kvpool tcp")},
                   kind="kvpool")]
    if not args.no_veth:
        cols.append(Column("kvpool veth", "kvpool.bench.anchors_kvpool:VethKvpoolTarget",
                           {"segment_size": seg, "log_dir": logs("kvpool veth")}, kind="kvpool"))
    if not args.no_mooncake:
        prefix, _ = private_netns_prefix()
        for layout, name in (("in_process", "mooncake in-proc"), ("cross_process", "mooncake x-proc")):
            cols.append(Column(name, "kvpool.bench.anchors_mooncake:MooncakeTarget",
                               {"layout": layout, "segment_size": seg,
                                "master_binary": args.mooncake_master}, prefix))
    if not args.no_redis:
        cols.append(Column("redis", "kvpool.bench.anchors_redis:RedisTarget",
                           {"binary": args.redis_server}))
    cols.append(Column("memcpy", "kvpool.bench.anchors_limits:MemcpyTarget", kind="limit"))
    cols.append(Column("tcp-stream", "kvpool.bench.anchors_limits:TcpStreamTarget", kind="limit"))
    return [c for c in cols if not args.only or c.name in args.only]


# --------------------------------------------------------------------------- run


@dataclass
class Summary:
    """Medians over the successful repeats of one (column, row), and the raw repeats."""

    gbps: float | None = None
    ops_per_s: float | None = None
    p50_us: float | None = None
    p99_us: float | None = None
    repeats: list[dict] = field(default_factory=list)
    error: str | None = None


def summarize(results: list[CellResult]) -> Summary:
    ok = [r for r in results if r.error is None]
    out = Summary(repeats=[asdict(r) for r in results])
    if not ok:
        out.error = results[0].error if results else "not measured"
        return out
    for name in ("gbps", "ops_per_s", "p50_us", "p99_us"):
        vals = [getattr(r, name) for r in ok if getattr(r, name) is not None]
        setattr(out, name, statistics.median(vals) if vals else None)
    return out


def cell_spec(col: Column, row: Row, rep: int, args) -> CellSpec:
    """What a column measures in a row: the row itself, or for a limit a copy of that size.

    Limits are measured in every row, right beside the stores, so that each kvpool figure
    has its limit from the same seconds (the machine's memory bandwidth and CPU share
    drift by 2-3x while other jobs run).
    """
    api, op, batch = ("copy", "copy", 1) if col.kind == "limit" else (row.api, row.op, row.batch)
    return CellSpec(api, op, row.size, batch, rep, args.budget,
                    working_set=args.working_set, put_cap_bytes=args.put_cap)


def start_workers(columns: list[Column], log_dir: str, quiet: bool) -> list[Worker]:
    workers = []
    for col in columns:
        w = Worker(col.name, col.target, col.cfg, col.prefix,
                   log_path=os.path.join(log_dir, col.name.replace(" ", "_") + ".log"))
        if not w.start() and not quiet:
            print(f"  {col.name}: absent ({w.absent})", file=sys.stderr)
        workers.append(w)
    return workers


def measure(workers: list[Worker], columns: list[Column], rows: list[Row], args,
            progress) -> dict[tuple[str, Row], list[CellResult]]:
    """The interleaved loop: per row, per repeat, every column once (order rotated)."""
    results: dict[tuple[str, Row], list[CellResult]] = {}
    by_size: dict[int, list[Row]] = {}
    for row in rows:
        by_size.setdefault(row.size, []).append(row)
    live = list(zip(columns, workers))
    for size, size_rows in by_size.items():
        for row in size_rows:
            for rep in range(args.repeats):
                here = [(c, w) for c, w in live if not w.absent]
                shift = rep % len(here) if here else 0
                for col, w in here[shift:] + here[:shift]:
                    progress.set_postfix_str(f"{row.label.strip()} | {col.name}", refresh=False)
                    results.setdefault((col.name, row), []).append(w.cell(cell_spec(col, row, rep, args)))
                    progress.update(1)
        for w in workers:
            if not w.absent:
                w.ask({"cmd": "drop", "size": size})
    return results


def count_cells(columns: list[Column], rows: list[Row], repeats: int) -> int:
    return len(rows) * len(columns) * repeats


# --------------------------------------------------------------------------- table and targets

RATIOS = (  # (label, kvpool column, anchor column)
    ("in/mc-in", "kvpool in-proc", "mooncake in-proc"),
    ("shm/mc-x", "kvpool shm", "mooncake x-proc"),
    ("shm/memcpy", "kvpool shm", "memcpy"),
    ("tcp/mc-x", "kvpool tcp", "mooncake x-proc"),
    ("tcp/stream", "kvpool tcp", "tcp-stream"),
    ("tcp/redis", "kvpool tcp", "redis"),
)


class Figures:
    """Medians per (column, row), and kvpool/anchor ratios paired by repeat."""

    def __init__(self, summaries: dict[tuple[str, Row], Summary], columns: list[Column]):
        self.s = summaries
        self.limits = {c.name for c in columns if c.kind == "limit"}

    def get(self, column: str, row: Row, metric: str | None = None) -> float | None:
        metric = metric or row.metric
        if column in self.limits and metric == "p50_us":
            return None  # a stream or a copy has no call latency to compare with
        summ = self.s.get((column, row))
        return getattr(summ, metric) if summ else None

    def ratio(self, a: str, b: str, row: Row, metric: str | None = None) -> float | None:
        """Median over repeats of a/b, each repeat paired with the same repeat of b.

        Repeat r of every column runs within the same few seconds, so the pair shares
        the machine's load at that moment; the median of paired ratios is much steadier
        than the ratio of two medians on a shared machine.
        """
        metric = metric or row.metric
        if self.get(a, row, metric) is None or self.get(b, row, metric) is None:
            return None
        pairs = [(x.get(metric), y.get(metric))
                 for x, y in zip(self.s[(a, row)].repeats, self.s[(b, row)].repeats)]
        ratios = [x / y for x, y in pairs if x is not None and y]
        return statistics.median(ratios) if ratios else None


def fmt_value(v: float | None, metric: str) -> str:
    if v is None:
        return "-"
    if metric == "gbps":
        return f"{v:.2f}"
    if metric == "ops_per_s":
        return f"{v / 1e3:.1f}k"
    return f"{v:.0f}"


def format_table(rows: list[Row], columns: list[Column], fig: Figures) -> str:
    """The printed table: one line per row, each column's median, then kvpool/anchor ratios
    (medians of ratios paired by repeat, see :meth:`Figures.ratio`).

    Units per row: GB/s for values >= 64 KiB, k objects/s for small batches, p50 µs for
    small single ops (for p50 a ratio below 1 means kvpool is faster). A limit column
    shows its copy (or stream) of values of the row's size, measured beside the row.
    """
    names = [c.name for c in columns]
    ratios = [r for r in RATIOS if r[1] in names and r[2] in names]
    width = [max(10, len(n) + 1) for n in names]
    head = f"{'size   api       op':<24}{'unit':<6}" + "".join(
        f"{n:>{w}}" for n, w in zip(names, width)) + "".join(f"{r[0]:>12}" for r in ratios)
    lines = [head, "-" * len(head)]
    unit = {"gbps": "GB/s", "ops_per_s": "obj/s", "p50_us": "p50us"}
    for row in rows:
        m = row.metric
        vals = "".join(f"{fmt_value(fig.get(n, row), m):>{w}}" for n, w in zip(names, width))
        rats = "".join(f"{_fmt_ratio(fig.ratio(a, b, row)):>12}" for _, a, b in ratios)
        lines.append(f"{row.label:<24}{unit[m]:<6}{vals}{rats}")
    return "\n".join(lines)


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


@dataclass
class Verdict:
    """One performance target checked on one row: ``value`` vs ``threshold`` (the
    targets are the ratios against Mooncake, memcpy and one TCP stream and the memory
    limits listed in :func:`verdicts` and docs/bench.md)."""

    target: str
    row: str
    value: float | None
    threshold: float
    higher_is_better: bool = True
    met: bool | None = None

    def __post_init__(self):
        if self.value is not None:
            self.met = (self.value >= self.threshold if self.higher_is_better
                        else self.value <= self.threshold)


def verdicts(rows: list[Row], fig: Figures, memory: dict[str, dict]) -> list[Verdict]:
    """kvpool's performance targets, per row they concern (ratios of medians of the same
    run): speed against Mooncake's cross-process store, memcpy and one TCP stream, and
    the memory of nodes and clients.

    memory: {kvpool column: its stats} (node RSS, client probe), in bytes.
    """
    out: list[Verdict] = []
    for row in rows:
        if row.size >= _MIB and row.api in ("zero_copy", "batch"):
            checks = (("same host >=1MiB: kvpool shm / mooncake x-proc >= 2.5", "kvpool shm",
                       "mooncake x-proc", 2.5),
                      ("same host >=1MiB: kvpool shm / memcpy >= 0.6", "kvpool shm", "memcpy", 0.6),
                      ("TCP >=1MiB: kvpool tcp / mooncake x-proc >= 1.0", "kvpool tcp",
                       "mooncake x-proc", 1.0),
                      ("TCP >=1MiB: kvpool tcp / tcp-stream >= 0.8", "kvpool tcp", "tcp-stream", 0.8))
            for name, a, b, th in checks:
                out.append(Verdict(name, row.label, fig.ratio(a, b, row, "gbps"), th))
        if row.size == 4 * _KIB and row.api in ("bytes", "zero_copy") and row.op == "get":
            for col in ("kvpool shm", "kvpool tcp"):
                out.append(Verdict(f"4KiB get p50: {col} / mooncake x-proc <= 1.2", row.label,
                                   fig.ratio(col, "mooncake x-proc", row, "p50_us"),
                                   1.2, higher_is_better=False))
        if row.size == 4 * _KIB and row.api == "batch" and row.batch == 128:
            for col in ("kvpool shm", "kvpool tcp"):
                out.append(Verdict(f"128x4KiB batch obj/s: {col} / mooncake x-proc >= 1.0",
                                   row.label, fig.ratio(col, "mooncake x-proc", row, "ops_per_s"),
                                   1.0))
    for name, mem in memory.items():
        if "node_peak_rss_bytes" in mem:
            limit = (mem["segment_size"] >> 20) + 100
            out.append(Verdict("node peak RSS <= segment + 100 MiB (MiB)", name,
                               mem["node_peak_rss_bytes"] / _MIB, limit, higher_is_better=False))
        if "client_own_bytes" in mem:
            out.append(Verdict("client without segment, own RSS beyond python+numpy <= 150 MiB",
                               name, mem["client_own_bytes"] / _MIB, 150, higher_is_better=False))
    return out


def format_verdicts(vs: list[Verdict]) -> str:
    """One line per target: met on k of n rows, and the worst row."""
    lines = []
    groups: dict[str, list[Verdict]] = {}
    for v in vs:
        groups.setdefault(v.target, []).append(v)
    for target, items in groups.items():
        known = [v for v in items if v.met is not None]
        if not known:
            lines.append(f"  n/a   {target}: not measured (column absent)")
            continue
        met = sum(v.met for v in known)
        pick = min if known[0].higher_is_better else max
        worst = pick(known, key=lambda v: v.value)
        state = "MET " if met == len(known) else "MISS"
        lines.append(f"  {state}  {target}: {met}/{len(known)} rows; worst {worst.row.strip()} "
                     f"= {worst.value:.2f} (threshold {worst.threshold:g})")
    return "\n".join(lines)


# --------------------------------------------------------------------------- plot, JSON, CLI


def build_panels(rows: list[Row], columns: list[Column], fig: Figures) -> list:
    """Panels for the PNG: GB/s of gets and puts (>= 64 KiB), small-value p50 and obj/s."""
    from kvpool.bench.plot import Panel

    names = [c.name for c in columns]
    specs = (("get GB/s (values >= 64 KiB)", "gbps", lambda r: r.op == "get" and r.size >= 64 * _KIB),
             ("put GB/s (values >= 64 KiB)", "gbps", lambda r: r.op == "put" and r.size >= 64 * _KIB),
             ("small values: p50 latency, us (lower is better)", "p50_us",
              lambda r: r.size < 64 * _KIB and r.api != "batch"),
             ("small values in batches: objects/s", "ops_per_s",
              lambda r: r.size < 64 * _KIB and r.api == "batch"))
    panels = []
    for title, metric, keep in specs:
        chosen = [r for r in rows if keep(r)]
        series = {n: [fig.get(n, r, metric) for r in chosen] for n in names}
        series = {n: v for n, v in series.items() if any(x is not None for x in v)}
        panels.append(Panel(title, [" ".join(r.label.split()) for r in chosen], series,
                            ylabel={"gbps": "GB/s", "p50_us": "p50 µs"}.get(metric, "objects/s"),
                            log=metric != "p50_us"))
    return panels


def machine_facts() -> dict:
    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "loadavg": os.getloadavg()}


def add_arguments(p) -> None:
    """Options of ``kvpool bench store``."""
    p.add_argument("--sizes", default=None,
                   help=f"value sizes, comma separated (default {DEFAULT_SIZES}; --quick {QUICK_SIZES})")
    p.add_argument("--batches", default=DEFAULT_BATCHES, help="keys per batch call (default 16,128)")
    p.add_argument("--apis", default="bytes,zero_copy,batch",
                   help="APIs: bytes (plain bytes), zero_copy (put from / get into a buffer), batch")
    p.add_argument("--ops", default="put,get", help="operations: put,get")
    p.add_argument("--repeats", type=int, default=None, help="repeats per cell (default 5; --quick 2)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds per repeat of a cell (default 0.25; --quick 0.06)")
    p.add_argument("--working-set", default="64MiB",
                   help="bytes a cell cycles over (above the CPU cache; default 64MiB)")
    p.add_argument("--segment-size", default="1GiB", help="segment of each kvpool node / Mooncake")
    p.add_argument("--max-batch-bytes", default="128MiB", help="skip batches larger than this")
    p.add_argument("--put-cap", default="256MiB", help="bytes written per put repeat at most")
    p.add_argument("--quick", action="store_true", help="small matrix, finishes in under 2 minutes")
    p.add_argument("--no-mooncake", action="store_true", help="leave the Mooncake columns out")
    p.add_argument("--no-redis", action="store_true", help="leave the Redis column out")
    p.add_argument("--mooncake-master", default=None,
                   help="mooncake_master binary (default: on PATH or in the mooncake package)")
    p.add_argument("--redis-server", default=None, help="redis-server binary (default: on PATH)")
    p.add_argument("--no-veth", action="store_true",
                   help="leave out the kvpool column across two network namespaces joined by a "
                        "veth pair (needs root; absent with the reason when refused)")
    p.add_argument("--only", default=None, help="comma-separated column names to keep")
    p.add_argument("--json", dest="json_path", default=None, help="write results as JSON here")
    p.add_argument("--plot", dest="plot_path", default=None, help="write a PNG plot here")
    p.add_argument("--log-dir", default=None, help="workers' and servers' logs (default: temp)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def resolve_args(args) -> None:
    """Fill defaults that depend on --quick and parse sizes; raises UserError on bad input."""
    args.sizes = parse_list(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES), parse_size)
    args.batches = parse_list(args.batches, int)
    args.apis = parse_list(args.apis, str)
    args.ops = parse_list(args.ops, str)
    for api in args.apis:
        if api not in ("bytes", "zero_copy", "batch"):
            raise UserError(f"unknown API {api!r} (bytes, zero_copy, batch)")
    for op in args.ops:
        if op not in ("put", "get"):
            raise UserError(f"unknown op {op!r} (put, get)")
    if any(s <= 0 for s in args.sizes) or any(b <= 0 for b in args.batches):
        raise UserError("sizes and batches must be > 0")
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.budget = args.budget or (0.06 if args.quick else 0.25)
    if args.repeats < 1 or args.budget <= 0:
        raise UserError("--repeats must be >= 1 and --budget > 0")
    args.working_set = parse_size(args.working_set)
    args.segment_size = parse_size(args.segment_size)
    args.max_batch_bytes = parse_size(args.max_batch_bytes)
    args.put_cap = parse_size(args.put_cap)
    args.only = parse_list(args.only, str) if args.only else None


def run(args) -> int:
    """Run the benchmark; prints the table and the targets; writes JSON / PNG if asked."""
    from tqdm import tqdm

    resolve_args(args)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvpool-bench-")
    os.makedirs(log_dir, exist_ok=True)
    rows = plan_rows(args.sizes, args.apis, args.ops, args.batches, args.max_batch_bytes)
    columns = plan_columns(args, log_dir)
    started = time.time()
    facts_before = machine_facts()
    workers = start_workers(columns, log_dir, quiet=False)
    try:
        with tqdm(total=count_cells([c for c, w in zip(columns, workers) if not w.absent],
                                    rows, args.repeats),
                  disable=args.no_progress, unit="cell", file=sys.stderr) as bar:
            results = measure(workers, columns, rows, args, bar)
        stats = {w.column: (w.ask({"cmd": "stats"}) or {}).get("stats", {}) for w in workers}
    finally:
        for w in workers:
            w.stop()
    summaries = {key: summarize(res) for key, res in results.items()}
    fig = Figures(summaries, columns)
    memory = {c.name: stats.get(c.name, {}) for c in columns if c.kind == "kvpool"}
    vs = verdicts(rows, fig, memory)
    print(format_table(rows, columns, fig))
    for w in workers:
        if w.absent:
            print(f"absent: {w.column}: {w.absent}")
    print("targets (kvpool's goals: speed vs Mooncake x-proc, memcpy and one TCP stream, "
          "from the medians above; node and client memory):")
    print(format_verdicts(vs))
    doc = {
        "schema": SCHEMA,
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "machine": {"before": facts_before, "after": machine_facts()},
        "seconds": round(time.time() - started, 1),
        "columns": {w.column: {"kind": c.kind, "absent": w.absent, "info": w.info,
                               "stats": stats.get(w.column, {})}
                    for c, w in zip(columns, workers)},
        "cells": [{"column": name, **asdict(row), "metric": row.metric, **asdict(summ)}
                  for (name, row), summ in summaries.items()],
        "ratios": [{"ratio": label, "kvpool": a, "anchor": b, **asdict(row), "metric": row.metric,
                    "value": fig.ratio(a, b, row)}
                   for row in rows for label, a, b in RATIOS if fig.ratio(a, b, row) is not None],
        "verdicts": [asdict(v) for v in vs],
    }
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    if args.plot_path:
        from kvpool.bench.plot import save_panels

        save_panels(args.plot_path, build_panels(rows, columns, fig),
                    title="kvpool bench store (medians; same run)")
    print(f"done in {doc['seconds']} s; logs in {log_dir}")
    return 0
