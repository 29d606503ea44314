"""``kvpool bench master``: the master at scale, and a simulated pool of many segments.

Objects (``--sizes``, ``--max``): one real master process and one simulated node
(:mod:`kvpool.bench.master_sim`) with a segment large enough for every object; the
master is filled over its port in batches of 1,000 keys of 64-byte values, and at each
size the benchmark reads the master's RSS (bytes per object = growth since the empty
master / objects) and measures put, exist and get throughput: puts over the last
``--window`` keys before the size is reached, exists and gets over ``--probes`` batches
of keys drawn uniformly from all objects held.

Segments (``--segments``): for each count, a fresh master with that many simulated
nodes (each one segment; together ``--pool-objects`` values) under a synthetic load:
fill the pool, then rounds of one batch of new puts (the pool is full: each one
evicts), one batch of gets and one of exists over recent keys; then a burst of
heartbeats. Reported per count: ops/s, the master's CPU microseconds per operation
(from ``/proc``, so a loaded machine inflates it less than wall time), master RSS,
objects evicted, and how many segments received objects.

A master's share of an operation is its control-plane messages: no value bytes move
(the simulated segments have no memory), so the figures are the master's, not the data
path's (``kvpool bench store``).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from kvpool.bench.logs import RunLogs
from kvpool.bench.master_sim import MasterProcess, MetaClient, SimNodes
from kvpool.bench.verdict import Verdict
from kvpool.config import parse_size, raise_open_files
from kvpool.errors import UserError

HELP = "benchmark the master: bytes per object and ops/s from 1e4 to 1e7 objects; a simulated pool"
SCHEMA = "kvpool.bench.master/1"
BATCH = 1000  # keys per request
FILL_STEP = 1_000_000  # objects between two progress lines of a fill
MIN_KEY_BYTES = 16
DEFAULT_SIZES, QUICK_SIZES = "1e4,1e5,1e6", "1e4,1e5"
DEFAULT_SEGMENTS, QUICK_SEGMENTS = "10,100,1000", "10,100,1000"
BYTES_PER_OBJECT_TARGET = 300
FLAT_TARGET = 0.7  # master CPU per op at the smallest size / at the largest: "flat"


def parse_counts(text: str, flag: str) -> list[int]:
    """"1e4,1e5" -> [10000, 100000]; positive whole numbers. Raises UserError."""
    out = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise UserError(f"{flag}: {part!r} is not a number") from None
        if value < 1 or value != int(value):
            raise UserError(f"{flag}: {part!r} must be a whole number >= 1")
        out.append(int(value))
    return sorted(set(out))


class Keys:
    """Key ``i`` as a ``length``-byte string: "<prefix>/000...i" (``length`` >= 16)."""

    def __init__(self, prefix: str, length: int):
        self.prefix = prefix + "/"
        self.digits = length - len(self.prefix)

    def range(self, start: int, stop: int) -> list[str]:
        return [f"{self.prefix}{i:0{self.digits}d}" for i in range(start, stop)]

    def sample(self, low: int, high: int, n: int, rng: random.Random) -> list[str]:
        return [f"{self.prefix}{rng.randrange(low, high):0{self.digits}d}" for _ in range(n)]


class Meter:
    """Ops/s and master CPU microseconds per op over what runs between start and stop."""

    def __init__(self, master: MasterProcess):
        self.master = master
        self.ops = 0
        self.wall = self.cpu = 0.0

    def __enter__(self) -> "Meter":
        self._t, self._c = time.perf_counter(), self.master.cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        self.wall += time.perf_counter() - self._t
        self.cpu += self.master.cpu_s() - self._c

    def figures(self) -> dict:
        return {"ops": self.ops, "ops_per_s": round(self.ops / self.wall, 1) if self.wall else None,
                "master_us_per_op": round(self.cpu / self.ops * 1e6, 2) if self.ops else None}


def _say(args, text: str) -> None:
    if not args.no_progress:
        print(text, file=sys.stderr, flush=True)


def _put_range(client: MetaClient, keys: Keys, start: int, stop: int, meter: Meter | None = None) -> int:
    stored = 0
    for lo in range(start, stop, BATCH):
        batch = keys.range(lo, min(stop, lo + BATCH))
        if meter is None:
            stored += client.put(batch)
            continue
        with meter:
            stored += client.put(batch)
        meter.ops += len(batch)
    return stored


def _probe(client: MetaClient, op: str, keys: Keys, low: int, high: int, batches: int, meter: Meter,
           rng: random.Random) -> int:
    found = 0
    call = client.get if op == "get" else client.exist
    for _ in range(batches):
        batch = keys.sample(low, high, BATCH, rng)
        with meter:
            found += call(batch)
        meter.ops += len(batch)
    return found


def run_objects(args, log_dir: str) -> list[dict]:
    """Fill one master through ``args.sizes``; one row per size (see module docstring)."""
    keys, rng, rows = Keys("bench", args.key_bytes), random.Random(1), []
    top = args.sizes[-1]
    segment = parse_size(args.segment_size) if args.segment_size else 2 * top * max(64, args.value_size)
    with MasterProcess(log_dir, "master-objects") as master:
        nodes = SimNodes(master.addr, 1, segment, tag="objects")
        client = MetaClient(master.addr, args.value_size)
        try:
            base = master.rss()
            held, began = 0, time.time()
            for size in args.sizes:
                tail = max(held, size - args.window)
                _say(args, f"  filling to {size:,} objects ({time.time() - began:.0f} s so far)")
                stored = 0
                for lo in range(held, tail, FILL_STEP):  # a long fill shows progress
                    stored += _put_range(client, keys, lo, min(tail, lo + FILL_STEP))
                    if lo + FILL_STEP < tail:
                        _say(args, f"    {lo + FILL_STEP:,} objects ({time.time() - began:.0f} s)")
                put = Meter(master)
                stored += _put_range(client, keys, tail, size, put)
                if stored != size - held:
                    raise UserError(f"the master stored {stored} of {size - held} puts (log in {log_dir})")
                held = size
                rss = master.rss()
                exist, get = Meter(master), Meter(master)
                hits = _probe(client, "exist", keys, 0, held, args.probes, exist, rng)
                hits += _probe(client, "get", keys, 0, held, args.probes, get, rng)
                rows.append({"objects": held, "rss_bytes": rss, "base_rss_bytes": base,
                             "bytes_per_object": round((rss - base) / held, 1),
                             "put": put.figures(), "exist": exist.figures(), "get": get.figures(),
                             "misses": exist.ops + get.ops - hits, "loadavg": os.getloadavg()})
                _say(args, "  " + format_object_row(rows[-1]))
        finally:
            client.close()
            nodes.close()
    return rows


def run_pool(args, log_dir: str) -> list[dict]:
    """One fresh master per segment count in ``args.segments``; one row each."""
    _enough_files(max(args.segments) + 256)
    rows = []
    for count in args.segments:
        _say(args, f"  simulated pool of {count} segments")
        rows.append(_pool_row(args, log_dir, count))
        _say(args, "  " + format_pool_row(rows[-1]))
    return rows


def _enough_files(n: int) -> None:
    """Raise this process's open-file limit (inherited by the master it starts) to ``n``
    when the hard limit allows: each simulated node keeps a socket open on both sides.
    Raises UserError when it cannot."""
    limit = raise_open_files(n)
    if limit < n:
        raise UserError(f"--segments needs {n} open files; the limit is {limit} (ulimit -n)")


def _pool_row(args, log_dir: str, count: int) -> dict:
    keys, rng = Keys("pool", args.key_bytes), random.Random(count)
    aligned = -(-args.value_size // 64) * 64
    segment = max(1 << 10, -(-args.pool_objects // count) * aligned)
    capacity = segment // aligned * count
    with MasterProcess(log_dir, f"master-pool-{count}") as master:
        base = master.rss()
        started = time.perf_counter()
        nodes = SimNodes(master.addr, count, segment, tag=f"pool{count}")
        mount_s = time.perf_counter() - started
        client = MetaClient(master.addr, args.value_size)
        try:
            held = capacity
            _put_range(client, keys, 0, held)
            put, get, exist = Meter(master), Meter(master), Meter(master)
            stored = hits = 0
            for _ in range(args.rounds):
                stored += _put_range(client, keys, held, held + BATCH, put)
                held += BATCH
                hits += _probe(client, "get", keys, max(0, held - capacity), held, 1, get, rng)
                _probe(client, "exist", keys, max(0, held - capacity), held, 1, exist, rng)
            beats, sock = Meter(master), nodes.connect()
            try:
                for _ in range(max(1, 2000 // count)):
                    with beats:
                        beats.ops += nodes.heartbeat_round(sock)
            finally:
                sock.close()
            stats = client.stats()
            rss = master.rss()
        finally:
            client.close()
            nodes.close()
    return {"segments": count, "segment_bytes": segment, "capacity_objects": capacity,
            "mount_s": round(mount_s, 3), "put": put.figures(), "get": get.figures(),
            "exist": exist.figures(), "heartbeat": beats.figures(),
            "puts_stored": stored, "get_hits": hits, "rss_bytes": rss, "base_rss_bytes": base,
            "objects": stats.object_count, "evicted": stats.counters.get("evicted_objects", 0),
            "segments_holding": sum(s.used > 0 for s in stats.segments),
            "heartbeats_refused": nodes.refused, "owners": stats.owner_count, "loadavg": os.getloadavg()}


def _rate(fig: dict) -> str:
    ops = fig.get("ops_per_s")
    return "-" if ops is None else f"{ops / 1000:.1f}k/s ({fig['master_us_per_op']:.1f} us)"


def format_object_row(r: dict) -> str:
    return (f"{r['objects']:>11,} objects  {r['bytes_per_object']:>7.1f} B/object  "
            f"put {_rate(r['put'])}  exist {_rate(r['exist'])}  get {_rate(r['get'])}")


def format_pool_row(r: dict) -> str:
    return (f"{r['segments']:>5} segments  put {_rate(r['put'])}  get {_rate(r['get'])}  "
            f"exist {_rate(r['exist'])}  heartbeat {_rate(r['heartbeat'])}  "
            f"RSS {r['rss_bytes'] / 2**20:.0f} MiB  evicted {r['evicted']:,}  "
            f"segments holding objects {r['segments_holding']}/{r['segments']}")


def verdicts(objects: list[dict], pool: list[dict]) -> list[Verdict]:
    """Bytes/object at 1e6 and above (at the largest size when smaller), and flatness:
    the master's CPU per op at the smallest size (segment count) over that at the
    largest (1.0: flat; CPU time, because wall time on a shared machine moves with
    everything else that runs)."""
    out = []
    big = [r for r in objects if r["objects"] >= 10**6] or objects[-1:]
    for r in big:
        out.append(Verdict.bound(f"master bytes/object at {r['objects']:,} objects", r["bytes_per_object"],
                                 BYTES_PER_OBJECT_TARGET, higher_is_better=False))
    for rows, what, ops in ((objects, "objects", ("put", "exist", "get")),
                            (pool, "segments", ("put", "get", "exist", "heartbeat"))):
        if len(rows) < 2:
            continue
        lo, hi = rows[0], rows[-1]
        for op in ops:
            a, b = lo[op]["master_us_per_op"], hi[op]["master_us_per_op"]
            out.append(Verdict.bound(f"{op} cost flat: {hi[what]:,} vs {lo[what]:,} {what}",
                                     round(a / b, 3) if a and b else None, FLAT_TARGET,
                                     f"master CPU {b} vs {a} us/op; {hi[op]['ops_per_s']} vs "
                                     f"{lo[op]['ops_per_s']} ops/s"))
    return out


def add_arguments(p) -> None:
    """Options of ``kvpool bench master``."""
    p.add_argument("--sizes", default=None,
                   help=f"objects held at which to measure (default {DEFAULT_SIZES}; --quick {QUICK_SIZES})")
    p.add_argument("--max", dest="max_objects", default=None,
                   help="also measure at this many objects (e.g. 1e7: minutes, ~3 GB of master memory)")
    p.add_argument("--segments", default=None,
                   help=f"simulated pool sizes in segments (default {DEFAULT_SEGMENTS}; 0 = no pool run)")
    p.add_argument("--no-objects", action="store_true", help="only the simulated pool")
    p.add_argument("--quick", action="store_true", help="small sizes: about a minute")
    p.add_argument("--value-size", type=int, default=64, help="bytes per value (default 64)")
    p.add_argument("--key-bytes", type=int, default=32, help="bytes per key (default 32)")
    p.add_argument("--window", type=int, default=None,
                   help="puts timed before each size is reached (default 100000; --quick 20000)")
    p.add_argument("--probes", type=int, default=None,
                   help="batches of exists and of gets timed at each size (default 50; --quick 10)")
    p.add_argument("--segment-size", default=None, help="the objects run's one segment (default: 2x what fits)")
    p.add_argument("--pool-objects", type=int, default=None,
                   help="values the simulated pool holds in all (default 100000; --quick 20000)")
    p.add_argument("--rounds", type=int, default=None,
                   help="load rounds per pool (a batch each of put, get, exist; default 50; --quick 10)")
    p.add_argument("--json", dest="json_path", default=None, help="write results as JSON here")
    p.add_argument("--plot", dest="plot_path", default=None, help="write a PNG plot here")
    p.add_argument("--log-dir", default=None,
                   help="the masters' logs (default: a temporary folder, kept only when the run fails)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines")


def resolve_args(args) -> None:
    """Fill defaults that depend on --quick; raises UserError on bad input."""
    sizes = parse_counts(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES), "--sizes")
    if args.max_objects:
        sizes = sorted(set(sizes + parse_counts(args.max_objects, "--max")))
    args.sizes = [] if args.no_objects else sizes
    segs = args.segments or (QUICK_SEGMENTS if args.quick else DEFAULT_SEGMENTS)
    args.segments = [] if segs.strip() == "0" else parse_counts(segs, "--segments")
    if any(s > 4096 for s in args.segments):
        raise UserError("--segments: a master mounts at most 4096 segments")
    args.window = args.window or (20_000 if args.quick else 100_000)
    args.probes = args.probes or (10 if args.quick else 50)
    args.pool_objects = args.pool_objects or (20_000 if args.quick else 100_000)
    args.rounds = args.rounds or (10 if args.quick else 50)
    if args.key_bytes < MIN_KEY_BYTES:
        raise UserError(f"--key-bytes must be at least {MIN_KEY_BYTES} (a prefix and 10 digits)")
    for flag, value in (("--value-size", args.value_size), ("--window", args.window), ("--probes", args.probes),
                        ("--pool-objects", args.pool_objects), ("--rounds", args.rounds)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1")


def build_panels(objects: list[dict], pool: list[dict]):
    from kvpool.bench.plot import Panel

    labels = [f"{r['objects']:.0e}" for r in objects]
    seg_labels = [f"{r['segments']} segments" for r in pool]
    return [
        Panel("master RSS per object (bytes; target <= 300)", labels,
              {"bytes/object": [r["bytes_per_object"] for r in objects]}, "bytes"),
        Panel("master ops/s by objects held (1,000-key batches)", labels,
              {op: [r[op]["ops_per_s"] for r in objects] for op in ("put", "exist", "get")}, "ops/s"),
        Panel("simulated pool: ops/s by segments mounted", seg_labels,
              {op: [r[op]["ops_per_s"] for r in pool] for op in ("put", "get", "exist", "heartbeat")}, "ops/s"),
        Panel("simulated pool: master CPU per op (us)", seg_labels,
              {op: [r[op]["master_us_per_op"] for r in pool] for op in ("put", "get", "exist", "heartbeat")},
              "us"),
    ]


def run(args) -> int:
    """Run the benchmark; prints one line per size and pool, the verdicts; JSON / PNG if asked."""
    resolve_args(args)
    with RunLogs(args.log_dir, "kvpool-bench-master-") as logs:
        return _run(args, logs.path)


def _run(args, log_dir: str) -> int:
    """:func:`run` with the masters' logs in ``log_dir``."""
    started, load_before = time.time(), os.getloadavg()
    objects = run_objects(args, log_dir) if args.sizes else []
    pool = run_pool(args, log_dir) if args.segments else []
    for r in objects:
        print(format_object_row(r))
    for r in pool:
        print(format_pool_row(r))
    vs = verdicts(objects, pool)
    for v in vs:
        state = {True: "MET", False: "MISSED", None: "n/a"}[v.met]
        bound = "<=" if not v.higher_is_better else ">="
        print(f"  {state:6} {v.name}: {v.measured} ({bound} {v.target}) {v.detail}")
    doc = {"schema": SCHEMA, "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
           "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
           "seconds": round(time.time() - started, 1), "objects": objects, "pool": pool,
           "verdicts": [v.as_target() for v in vs]}
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    if args.plot_path:
        from kvpool.bench.plot import save_panels

        save_panels(args.plot_path, build_panels(objects, pool), title="kvpool bench master")
    print(f"done in {doc['seconds']} s")
    return 0
