"""``kvpool bench store``: kvpool's data path against Mooncake Store, Redis and the machine.

Every system runs in its own worker process (:mod:`kvpool.bench.harness`). For each
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
kvpool ... put-st.  with ``--put-start-columns``: in-proc and shm with every put through
                    PutStart/PutEnd (no allocation lease), to measure what leases save
mooncake in-proc    Mooncake client that holds the segment itself (local copy)
mooncake x-proc     Mooncake client without segment; another process holds it (TCP)
redis               redis-server on 127.0.0.1, redis-py
memcpy              numpy copy into a preallocated buffer (limit of a same-host copy)
tcp-stream          one loopback TCP stream, sendall -> recv_into (limit of one connection)
tcp-rr              the same connection, one value per one-byte request (a bare single get)
==================  ========================================================================
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict

from kvpool.bench import l3load
from kvpool.bench.harness import CellResult, CellSpec
from kvpool.bench.logs import RunLogs
from kvpool.bench.store_plan import Column, Row, parse_list, plan_columns, plan_rows
from kvpool.bench.store_report import (
    RATIOS, Figures, build_panels, format_small_ops, format_table, format_verdicts, small_ops, summarize,
    verdicts,
)
from kvpool.bench.worker import Worker
from kvpool.config import parse_size
from kvpool.errors import UserError
from kvpool.launch import LaunchError

HELP = "benchmark the store's data path against Mooncake, Redis and the machine's limits"
SCHEMA = "kvpool.bench.store/1"

DEFAULT_SIZES = "4KiB,64KiB,1MiB,16MiB"
QUICK_SIZES = "4KiB,1MiB"
DEFAULT_BATCHES = "16,128"


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
                w.ask("drop", size=size)
    return results


def count_cells(columns: list[Column], rows: list[Row], repeats: int) -> int:
    return len(rows) * len(columns) * repeats


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
    p.add_argument("--put-start-columns", action="store_true",
                   help="add kvpool in-proc and shm columns whose puts skip allocation leases (PutStart/PutEnd)")
    p.add_argument("--no-veth", action="store_true",
                   help="leave out the kvpool column across two network namespaces joined by a "
                        "veth pair (needs root; absent with the reason when refused)")
    p.add_argument("--l3-load-repeats", type=int, default=None,
                   help="loads of the demo's 138 pages through the L3 tier, each against a "
                        "memcpy (default 15; --quick 7; 0 leaves it out)")
    p.add_argument("--only", default=None, help="comma-separated column names to keep")
    p.add_argument("--json", dest="json_path", default=None, help="write results as JSON here")
    p.add_argument("--plot", dest="plot_path", default=None, help="write a PNG plot here")
    p.add_argument("--log-dir", default=None, help="workers' and servers' logs (default: a temporary "
                   "folder, kept only when the run fails or a column is absent)")
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
    if args.l3_load_repeats is None:
        args.l3_load_repeats = 7 if args.quick else 15
    if args.repeats < 1 or args.budget <= 0:
        raise UserError("--repeats must be >= 1 and --budget > 0")
    args.working_set = parse_size(args.working_set)
    args.segment_size = parse_size(args.segment_size)
    args.max_batch_bytes = parse_size(args.max_batch_bytes)
    args.put_cap = parse_size(args.put_cap)
    args.only = parse_list(args.only, str) if args.only else None


def measure_l3_load(args, logs: RunLogs) -> dict | None:
    """The demo's L3 load against memcpy (:mod:`kvpool.bench.l3load`, its logs in
    ``logs``); None when left out (``--l3-load-repeats 0``) or when its cluster could
    not start (said why; the logs are kept)."""
    if not args.l3_load_repeats:
        return None
    print(f"measuring the demo's L3 load ({args.l3_load_repeats} loads) ...", file=sys.stderr, flush=True)
    try:
        return l3load.measure(args.l3_load_repeats, log_dir=logs.path)
    except LaunchError as exc:
        print(f"absent: demo L3 load: {exc}")
        logs.keep("the demo's L3 load was absent")
        return None


def run(args) -> int:
    """Run the benchmark; prints the table and the targets; writes JSON / PNG if asked.
    The logs' folder is kept when a column was absent (:class:`~kvpool.bench.logs.RunLogs`)."""
    resolve_args(args)
    with RunLogs(args.log_dir, "kvpool-bench-") as logs:
        return _run(args, logs)


def _run(args, logs: RunLogs) -> int:
    """:func:`run` with its logs in ``logs.path``."""
    from tqdm import tqdm

    log_dir = logs.path
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
        stats = {w.column: w.ask("stats") or {} for w in workers}
    finally:
        for w in workers:
            w.stop()
    l3 = measure_l3_load(args, logs)  # alone on the machine: the workers are gone
    summaries = {key: summarize(res) for key, res in results.items()}
    fig = Figures(summaries, columns)
    memory = {c.name: stats.get(c.name, {}) for c in columns if c.kind == "kvpool"}
    vs = verdicts(rows, fig, memory) + ([l3load.verdict(l3)] if args.l3_load_repeats else [])
    small = small_ops(fig, memory)
    print(format_table(rows, columns, fig))
    for w in workers:
        if w.absent:
            print(f"absent: {w.column}: {w.absent}")
            logs.keep("a column was absent")
    if small:
        print("control plane (a bare Ping round trip, and the 4 KiB bytes get against it):")
        print(format_small_ops(small))
    print("targets (issue 16 and earlier ones: kvpool / anchor within this run, against Mooncake, "
          "Redis, memcpy and one TCP stream; node and client memory):")
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
        "verdicts": [v.as_target() for v in vs],
        "small_ops": small,
        "l3_load": l3,
    }
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    if args.plot_path:
        from kvpool.bench.plot import save_panels

        save_panels(args.plot_path, build_panels(rows, columns, fig),
                    title="kvpool bench store (medians; same run)")
    print(f"done in {doc['seconds']} s")
    return 0
