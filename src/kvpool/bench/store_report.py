"""The figures of a ``kvpool bench store`` run: medians per cell, kvpool/anchor ratios
paired by repeat, the printed table, the targets (:class:`~kvpool.bench.verdict.Verdict`)
and the plot's panels."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from kvpool.bench.harness import CellResult
from kvpool.bench.store_plan import KIB, MIB, Column, Row
from kvpool.bench.verdict import Verdict


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


RATIOS = (  # (label, kvpool column, anchor column)
    ("in/mc-in", "kvpool in-proc", "mooncake in-proc"),
    ("shm/mc-x", "kvpool shm", "mooncake x-proc"),
    ("shm/memcpy", "kvpool shm", "memcpy"),
    ("tcp/mc-x", "kvpool tcp", "mooncake x-proc"),
    ("tcp/stream", "kvpool tcp", "tcp-stream"),
    ("tcp/rr", "kvpool tcp", "tcp-rr"),
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


INPROC_SCOPE = {  # Row.metric -> (scope of the in-process target, higher is better)
    "gbps": ("in-proc, GB/s rows", True),
    "ops_per_s": ("in-proc, obj/s rows", True),
    "p50_us": ("in-proc, p50 rows", False),
}


def verdicts(rows: list[Row], fig: Figures, memory: dict[str, dict]) -> list[Verdict]:
    """kvpool's performance targets, one :class:`Verdict` per row each concerns.

    Speed targets are ratios kvpool / anchor within one run (the median of ratios paired by
    repeat, :meth:`Figures.ratio`), on GB/s, objects/s or p50 µs. From issue 16 of the
    project:

    - same host, >= 1 MiB (zero-copy and batch rows), GB/s: kvpool shm / memcpy >= 0.6;
      over TCP: kvpool tcp / one TCP stream >= 0.8.
    - 4 KiB single gets (bytes, zero copy), p50 µs, lower is better: kvpool shm and
      kvpool tcp each <= 1.0 x Mooncake cross-process.
    - 4 KiB single puts, p50 µs, lower is better: kvpool shm <= 1.0 x Redis, on the rows
      with a Redis figure (bytes; Redis has no zero-copy API).
    - kvpool in-process against Mooncake in-process on every row, by the row's own metric
      (:attr:`Row.metric`): GB/s and objects/s (4 KiB batches) >= 1.0, p50 µs (small
      single ops) <= 1.0.

    Kept from kvpool's earlier targets: >= 1 MiB, kvpool shm >= 2.5 x and kvpool tcp
    >= 1.0 x Mooncake cross-process (GB/s); 128 x 4 KiB batches, both >= 1.0 x Mooncake
    cross-process (objects/s); node peak RSS <= segment + 100 MiB; a client without a
    segment uses <= 150 MiB beyond Python and numpy.

    memory: {kvpool column: its stats} (node RSS, client probe), in bytes.
    """
    out: list[Verdict] = []

    def ratio(scope: str, a: str, b: str, bound: float, row: Row, metric: str,
              higher_is_better: bool = True) -> None:
        name = f"{scope}: {a} / {b} {'>=' if higher_is_better else '<='} {bound:.1f}"
        out.append(Verdict.bound(name, fig.ratio(a, b, row, metric), bound, row.label,
                                 higher_is_better))

    for row in rows:
        small = row.size == 4 * KIB
        if row.size >= MIB and row.api in ("zero_copy", "batch"):
            ratio("same host >=1MiB", "kvpool shm", "mooncake x-proc", 2.5, row, "gbps")
            ratio("same host >=1MiB", "kvpool shm", "memcpy", 0.6, row, "gbps")
            ratio("TCP >=1MiB", "kvpool tcp", "mooncake x-proc", 1.0, row, "gbps")
            ratio("TCP >=1MiB", "kvpool tcp", "tcp-stream", 0.8, row, "gbps")
        if small and row.api in ("bytes", "zero_copy") and row.op == "get":
            for col in ("kvpool shm", "kvpool tcp"):
                ratio("4KiB get p50", col, "mooncake x-proc", 1.0, row, "p50_us", False)
        if small and row.api == "bytes" and row.op == "put":
            ratio("4KiB put p50", "kvpool shm", "redis", 1.0, row, "p50_us", False)
        if small and row.api == "batch" and row.batch == 128:
            for col in ("kvpool shm", "kvpool tcp"):
                ratio("128x4KiB batch obj/s", col, "mooncake x-proc", 1.0, row, "ops_per_s")
        scope, higher = INPROC_SCOPE[row.metric]
        ratio(scope, "kvpool in-proc", "mooncake in-proc", 1.0, row, row.metric, higher)
    for name, mem in memory.items():
        if "node_peak_rss_bytes" in mem:
            limit = (mem["segment_size"] >> 20) + 100
            out.append(Verdict.bound("node peak RSS <= segment + 100 MiB (MiB)",
                                     mem["node_peak_rss_bytes"] / MIB, limit, name,
                                     higher_is_better=False))
        if "client_own_bytes" in mem:
            out.append(Verdict.bound("client without segment, own RSS beyond python+numpy <= 150 MiB",
                                     mem["client_own_bytes"] / MIB, 150, name,
                                     higher_is_better=False))
    return out


SMALL_GET = Row(4 * KIB, "bytes", "get")


def small_ops(fig: Figures, stats: dict[str, dict]) -> list[dict]:
    """Per kvpool column that measured a Ping: its p50 (us), the 4 KiB bytes get's p50 (us,
    None without that row) and their ratio: how much a small get costs beyond the bare
    control-plane round trip it cannot avoid (issue 16's figure to watch; no target)."""
    out = []
    for column, st in stats.items():
        ping = st.get("ping_p50_us")
        if ping:
            get = fig.get(column, SMALL_GET, "p50_us")
            out.append({"column": column, "ping_p50_us": ping, "get_4KiB_p50_us": get,
                        "get_per_ping": get / ping if get else None})
    return out


def format_small_ops(items: list[dict]) -> str:
    """One line per column of :func:`small_ops`."""
    lines = []
    for it in items:
        get = it["get_4KiB_p50_us"]
        tail = f"; 4KiB bytes get p50 {get:.0f} us = {it['get_per_ping']:.2f}x a Ping" if get else ""
        lines.append(f"  {it['column']}: Ping p50 {it['ping_p50_us']:.0f} us{tail}")
    return "\n".join(lines)


def format_verdicts(vs: list[Verdict]) -> str:
    """One line per target: met on k of n rows, and the worst row."""
    lines = []
    groups: dict[str, list[Verdict]] = {}
    for v in vs:
        groups.setdefault(v.name, []).append(v)
    for target, items in groups.items():
        known = [v for v in items if v.met is not None]
        if not known:
            lines.append(f"  n/a   {target}: not measured (column absent)")
            continue
        met = sum(v.met for v in known)
        pick = min if known[0].higher_is_better else max
        worst = pick(known, key=lambda v: v.measured)
        state = "MET " if met == len(known) else "MISS"
        lines.append(f"  {state}  {target}: {met}/{len(known)} rows; worst {worst.detail.strip()} "
                     f"= {worst.measured:.2f} (threshold {worst.target:g})")
    return "\n".join(lines)


def build_panels(rows: list[Row], columns: list[Column], fig: Figures) -> list:
    """Panels for the PNG: GB/s of gets and puts (>= 64 KiB), small-value p50 and obj/s."""
    from kvpool.bench.plot import Panel

    names = [c.name for c in columns]
    specs = (("get GB/s (values >= 64 KiB)", "gbps", lambda r: r.op == "get" and r.size >= 64 * KIB),
             ("put GB/s (values >= 64 KiB)", "gbps", lambda r: r.op == "put" and r.size >= 64 * KIB),
             ("small values: p50 latency, us (lower is better)", "p50_us",
              lambda r: r.size < 64 * KIB and r.api != "batch"),
             ("small values in batches: objects/s", "ops_per_s",
              lambda r: r.size < 64 * KIB and r.api == "batch"))
    panels = []
    for title, metric, keep in specs:
        chosen = [r for r in rows if keep(r)]
        series = {n: [fig.get(n, r, metric) for r in chosen] for n in names}
        series = {n: v for n, v in series.items() if any(x is not None for x in v)}
        panels.append(Panel(title, [" ".join(r.label.split()) for r in chosen], series,
                            ylabel={"gbps": "GB/s", "p50_us": "p50 µs"}.get(metric, "objects/s"),
                            log=metric != "p50_us"))
    return panels
