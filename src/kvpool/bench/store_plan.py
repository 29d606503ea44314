"""The plan of a ``kvpool bench store`` run: its rows (value size x API x operation) and
its columns (kvpool's and the compared systems', each a worker target)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvpool.bench.systems.netns import private_netns_prefix
from kvpool.errors import UserError

KIB, MIB = 1 << 10, 1 << 20


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
        if self.size >= 64 * KIB:
            return "gbps"
        return "ops_per_s" if self.api == "batch" else "p50_us"


def fmt_size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
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

    cols = [Column("kvpool in-proc", "kvpool.bench.systems.kvpool:KvpoolTarget",
                   {"client_segment": seg, "log_dir": logs("kvpool in-proc")}, kind="kvpool"),
            Column("kvpool shm", "kvpool.bench.systems.kvpool:KvpoolTarget",
                   {"segment_size": seg, "force_tcp": False, "log_dir": logs("kvpool shm")},
                   kind="kvpool"),
            Column("kvpool tcp", "kvpool.bench.systems.kvpool:KvpoolTarget",
                   {"segment_size": seg, "force_tcp": True, "log_dir": logs("kvpool tcp")},
                   kind="kvpool")]
    if getattr(args, "put_start_columns", False):  # the same layouts, every put through PutStart/PutEnd
        for name, cfg in [("kvpool in-proc put-start", {"client_segment": seg}),
                          ("kvpool shm put-start", {"segment_size": seg, "force_tcp": False})]:
            cols.append(Column(name, "kvpool.bench.systems.kvpool:KvpoolTarget",
                               {**cfg, "alloc_leases": False, "log_dir": logs(name)}, kind="kvpool"))
    if not args.no_veth:
        cols.append(Column("kvpool veth", "kvpool.bench.systems.kvpool:VethKvpoolTarget",
                           {"segment_size": seg, "log_dir": logs("kvpool veth")}, kind="kvpool"))
    if not args.no_mooncake:
        prefix, _ = private_netns_prefix()
        for layout, name in (("in_process", "mooncake in-proc"), ("cross_process", "mooncake x-proc")):
            cols.append(Column(name, "kvpool.bench.systems.mooncake:MooncakeTarget",
                               {"layout": layout, "segment_size": seg,
                                "master_binary": args.mooncake_master}, prefix))
    if not args.no_redis:
        cols.append(Column("redis", "kvpool.bench.systems.redis:RedisTarget",
                           {"binary": args.redis_server}))
    cols.append(Column("memcpy", "kvpool.bench.systems.limits:MemcpyTarget", kind="limit"))
    cols.append(Column("tcp-stream", "kvpool.bench.systems.limits:TcpStreamTarget", kind="limit"))
    cols.append(Column("tcp-rr", "kvpool.bench.systems.limits:TcpRoundTripTarget", kind="limit"))
    return [c for c in cols if not args.only or c.name in args.only]
