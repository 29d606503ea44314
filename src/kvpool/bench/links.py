"""``kvpool bench links``: fetch a cached prefix over a shaped link, or recompute it?

The store (master and node) runs in one network namespace, "another host"; the
reference engine (:class:`kvpool.engine.Engine`, fp32, its ``kvpool_causal`` kernel)
runs here in a second one; a veth pair joins them, shaped with tc at each line rate
(:mod:`kvpool.bench.linkshape`), and every byte of KV crosses it over TCP.

In each round, for each prefix length ``P`` a fresh random prompt of ``P + suffix``
tokens is computed once cold (the *recompute* TTFT; its prefix pages go to the store),
then, for each link rate, run again by an engine cache with an empty L1, which loads
the ``P`` tokens from the store over the link (the *fetch* TTFT). A point's figure is
its fastest round (other processes only add time). Where the crossover lies depends
on the machine's speed: on a loaded 2-core CPU even 1 Gbit/s is faster than
recomputing any prefix, so the rate list may hold ``auto``: after the first round's
recompute runs, the rate at which the planner puts the crossover in the middle of
the prefix range (:func:`auto_rate`) is measured as well.

The crossover is the prefix length from which fetching wins: measured, by linear
interpolation of (fetch − recompute) between the two prefix lengths where it changes
sign; predicted, by :func:`kvpool.plan.link.crossover` with the compute speeds fitted
to this run's recompute TTFTs (:func:`kvpool.plan.fit.fit_cold`), the link's line rate
and half the measured round trip as the one-way delay: the same function as
``kvpool plan prefill --link-gbit``. Needs root (``ip netns``, ``tc``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import numpy as np

from kvpool.bench.harness import Unavailable
from kvpool.bench.linkshape import connect_rtt_ms, shape, shaped_rate
from kvpool.config import check_at_least, parse_addr, parse_size
from kvpool.errors import UserError
from kvpool.plan.fit import fit_cold
from kvpool.plan.link import Link, compute_seconds, crossover, fetch_seconds
from kvpool.plan.prefill import kv_bytes

HELP = ("fetch or recompute: TTFT loading a cached prefix over a tc-shaped veth link vs "
        "recomputing it, crossover measured vs predicted")
TOLERANCE = 0.20
DEFAULT_RATES = "auto,1,10,25"
SLOW_READ_S = 600  # read lease and client timeout: one read over the slowest link
FULL = {"prefixes": "256,512,1024,2048,4096,8128", "repeats": 2}
QUICK = {"prefixes": "256,512,1024,2048", "repeats": 2}


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true",
                   help=f"prefixes {QUICK['prefixes']}, {QUICK['repeats']} rounds (default: "
                   f"{FULL['prefixes']}, {FULL['repeats']} rounds)")
    p.add_argument("--model", default="smollm2", help="engine model (default smollm2)")
    p.add_argument("--rates", default=DEFAULT_RATES,
                   help=f"link line rates in Gbit/s (default {DEFAULT_RATES}); 'auto' adds "
                   "the rate at which the first round's fit predicts the crossover in the "
                   "middle of the prefix range")
    p.add_argument("--prefixes", default=None, help="prefix lengths in tokens, comma separated")
    p.add_argument("--suffix", type=int, default=32, help="new tokens after the prefix (32)")
    p.add_argument("--repeats", type=int, default=None, help="rounds over every point")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (16)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine (1)")
    p.add_argument("--segment-size", default="1GiB", help="the node's segment (1GiB)")
    p.add_argument("--json", dest="json_path", default="bench_links.json",
                   help="JSON output (default bench_links.json)")
    p.add_argument("--plot", dest="plot_path", default="bench_links.png",
                   help="PNG output (default bench_links.png; '' for none)")


def parse_list(text: str, what: str, cast=float) -> list:
    """Comma-separated positive numbers; UserError naming ``what`` otherwise."""
    try:
        values = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise UserError(f"{what} must be numbers > 0, got {text!r}")
    return sorted(set(values))


def run(args) -> int:
    check_at_least(args, 1, "suffix", "threads")
    preset = QUICK if args.quick else FULL
    prefixes = parse_list(args.prefixes or preset["prefixes"], "--prefixes", int)
    auto = "auto" in [x.strip() for x in args.rates.split(",")]
    rates = parse_list(",".join(x for x in args.rates.split(",") if x.strip() != "auto"),
                       "--rates")
    if any(p % args.page_size for p in prefixes):
        raise UserError(f"--prefixes must be multiples of --page-size {args.page_size}")
    repeats = args.repeats or preset["repeats"]
    try:
        doc = measure_links(args.model, prefixes, rates, args.suffix, repeats, args.page_size,
                            args.threads, parse_size(args.segment_size), auto)
    except Unavailable as exc:
        raise UserError(f"bench links cannot run here: {exc}") from None
    doc["command"] = "kvpool bench links" + (" --quick" if args.quick else "")
    print(format_table(doc))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json_path}")
    if args.plot_path:
        plot_links(doc, args.plot_path)
        print(f"wrote {args.plot_path}")
    return 0


class Rig:
    """Master and node in a server namespace, this process in a client one, joined by
    a shaped veth pair (see the module docstring). A context manager; Unavailable when
    the machine refuses namespaces or tc."""

    def __init__(self, segment_size: int):
        self.segment_size = segment_size

    def __enter__(self) -> "Rig":
        from kvpool.bench.systems.netns import VethPair, setns
        from kvpool.launch import Cluster

        self._setns = setns
        self.pair = VethPair(str(os.getpid()))
        self.pair.create()
        self.home = os.open("/proc/self/ns/net", os.O_RDONLY)
        self.cluster = None
        try:
            setns(self.pair.server, self.home)
            host = ["--host", self.pair.server_addr]
            # a slow link's read of a long prefix outlasts the default 10 s read lease
            lease = ["--default-kv-lease-ttl", str(SLOW_READ_S * 1000)]
            self.cluster = Cluster(segment_size=self.segment_size, extra_master_args=host + lease,
                                   extra_node_args=host).start()
            setns(self.pair.client, self.home)
        except BaseException:
            self.__exit__()
            raise
        return self

    def shape(self, gbit: float) -> None:
        shape(self.pair, gbit)

    def rtt_ms(self) -> float:
        host, port = parse_addr(self.cluster.node_addrs[0])
        return connect_rtt_ms(host, port)

    def __exit__(self, *exc) -> None:
        self._setns(None, self.home)
        if self.cluster is not None:
            self.cluster.stop()
        self.pair.delete()
        os.close(self.home)


@dataclass
class Point:
    """Samples (ms) of one prefix length: recompute TTFT, and per rate fetch TTFT and
    the load step's time."""

    prefix: int
    recompute: list
    fetch: dict
    load: dict


def measure_links(model: str, prefixes: list[int], rates: list[float], suffix: int,
                  repeats: int, page_size: int, threads: int, segment_size: int,
                  auto: bool = False, seed: int = 0, progress=print) -> dict:
    """Run the measurement (module docstring); returns the JSON document. ``auto``
    adds the link rate at which this run's first-round fit predicts the crossover in
    the middle of the prefix range (:func:`auto_rate`)."""
    import torch

    from kvpool.client import Client
    from kvpool.engine import Engine

    torch.set_num_threads(threads)
    engine = Engine(model, dtype="float32")
    rng = np.random.default_rng(seed)
    vocab = engine.config.vocab_size
    rates = list(rates)
    points = {p: Point(p, [], {}, {}) for p in prefixes}
    auto_gbit = None
    with Rig(segment_size) as rig:
        rig.shape(max(rates))
        rtt = rig.rtt_ms()
        client = Client(rig.cluster.master_addr, force_tcp=True, timeout_s=SLOW_READ_S)
        meter = _Meter(engine, rig, client, page_size, max(prefixes) + suffix)
        try:
            # warm-up at the longest prompt: the KV buffer and every reader's staging
            # rows are allocated and touched before anything is timed
            warm_ids = rng.integers(0, vocab, max(prefixes) + suffix).tolist()
            warm = Point(max(prefixes), [], {}, {})
            meter.cold(warm, warm_ids)
            for gbit in rates:
                meter.fetch(warm, warm_ids, gbit)
            for r in range(repeats):
                prompts = {p: rng.integers(0, vocab, p + suffix).tolist() for p in prefixes}
                for p in prefixes:
                    meter.cold(points[p], prompts[p])
                if auto and auto_gbit is None:
                    auto_gbit = auto_rate(engine, points, suffix, rtt / 2)
                    progress(f"auto link rate: {auto_gbit:g} Gbit/s")
                    meter.fetch(warm, warm_ids, auto_gbit)  # its reader's warm-up
                    rates = sorted(rates + [auto_gbit])
                for p in prefixes:
                    for gbit in rates:
                        meter.fetch(points[p], prompts[p], gbit)
                    progress(f"round {r + 1}/{repeats}: prefix {p} done")
            shaped = shaped_rate(rig.pair)
        finally:
            meter.close()
            client.close()
    doc = analyse(engine, points, rates, suffix, rtt, threads, shaped)
    doc["auto_gbit"] = auto_gbit
    return doc


class _Meter:
    """Cold runs through a writer cache (their prefix pages go to the store) and fetch
    runs through one reader cache per rate, each seeing a prompt once (its L1 never
    holds the prefix, every prefix page comes from L3 over the link)."""

    def __init__(self, engine, rig: Rig, client, page_size: int, longest: int):
        from kvpool.cache import PrefixCache, StoreBackend

        self.engine, self.rig, self.client, self.page_size = engine, rig, client, page_size
        self.shape_args = (engine.namespace(page_size), engine.page_shape(page_size))
        self.writer = PrefixCache(*self.shape_args, l1_pages=longest // page_size + 8,
                                  l3=StoreBackend(client))
        self.readers: dict = {}

    def cold(self, point: Point, ids: list[int]) -> None:
        """Recompute TTFT of ``ids``; then only its prefix pages stay in the store."""
        from kvpool.cache.keys import page_keys, store_key

        self.engine.cache = self.writer
        cold = self.engine.generate(ids, 1)
        if cold.reused_tokens:
            raise UserError("a fresh random prompt hit the cache: the store was not empty")
        self.writer.flush()
        tail = page_keys(self.writer.ns, ids)[point.prefix // self.page_size:]
        if tail:  # the suffix's full pages: a fetch loads exactly the prefix
            self.client.batch_remove([store_key(k) for k in tail], force=True)
        point.recompute.append(cold.ttft_ms)

    def fetch(self, point: Point, ids: list[int], gbit: float) -> None:
        """Fetch TTFT of ``ids`` over the link shaped to ``gbit``."""
        from kvpool.cache import PrefixCache, StoreBackend

        if gbit not in self.readers:
            self.readers[gbit] = PrefixCache(*self.shape_args, l1_pages=1,
                                             l3=StoreBackend(self.client))
        self.rig.shape(gbit)
        self.engine.cache = self.readers[gbit]
        warm = self.engine.generate(ids, 1)
        self.readers[gbit].flush()
        if warm.reused_by_tier.get("L3", 0) != point.prefix:
            raise UserError(f"prefix {point.prefix}: reused {warm.reused_by_tier} from the "
                            "store, expected all of it from L3 (store too small?)")
        point.fetch.setdefault(gbit, []).append(warm.ttft_ms)
        point.load.setdefault(gbit, []).append(warm.timings_ms["load"]
                                               + warm.timings_ms["lookup"])

    def close(self) -> None:
        for c in (self.writer, *self.readers.values()):
            c.close()


def _spec(engine):
    from kvpool.plan.spec import spec_from_config

    name = engine.loaded.name
    return spec_from_config({**engine.config.to_dict(), "_name_or_path": name}, source=name)


def auto_rate(engine, points: dict, suffix: int, delay_ms: float) -> float:
    """The line rate (Gbit/s, 3 significant digits) at which the planner, with speeds
    fitted to the recompute TTFTs so far, puts the crossover at the geometric middle
    of the prefix range. The crossover falls as the rate rises: bisection on log rate."""
    spec = _spec(engine)
    prefixes = sorted(points)
    fit = fit_cold(spec, [(p + suffix, min(points[p].recompute) / 1e3) for p in prefixes])
    rates = fit.rates(1.0)
    target = (prefixes[0] * prefixes[-1]) ** 0.5
    lo, hi = -6.0, 3.0  # log10 Gbit/s
    for _ in range(40):
        mid = (lo + hi) / 2
        cross = crossover(spec, rates, Link(10 ** mid, delay_ms), "fp32", suffix, 1 << 20)
        lo, hi = (mid, hi) if cross is None or cross > target else (lo, mid)
    return float(f"{10 ** hi:.3g}")


def analyse(engine, points: dict, rates: list[float], suffix: int, rtt_ms: float,
            threads: int, shaped: str) -> dict:
    """Fit compute speeds to the recompute TTFTs, predict each link, find crossovers."""
    name = engine.loaded.name
    spec = _spec(engine)
    prefixes = sorted(points)
    recompute = {p: min(points[p].recompute) for p in prefixes}
    fit = fit_cold(spec, [(p + suffix, recompute[p] / 1e3) for p in prefixes])
    rates_fit = fit.rates(1.0)
    context = int(getattr(engine.config, "max_position_embeddings", 0) or 8192) - suffix
    links = []
    for gbit in rates:
        link = Link(gbit, rtt_ms / 2)
        rows = []
        for p in prefixes:
            fetch, load = min(points[p].fetch[gbit]), min(points[p].load[gbit])
            kv = kv_bytes(spec, p, "fp32")
            rows.append({
                "prefix": p, "recompute_ms": recompute[p], "fetch_ms": fetch, "load_ms": load,
                "effective_gbps": kv / (load / 1e3) / 1e9,
                "predicted_recompute_ms": _predict(spec, rates_fit, p, suffix, None) * 1e3,
                "predicted_fetch_ms": _predict(spec, rates_fit, p, suffix, link) * 1e3,
                "fetch_samples_ms": points[p].fetch[gbit],
                "recompute_samples_ms": points[p].recompute})
        measured = measured_crossover([(r["prefix"], r["fetch_ms"] - r["recompute_ms"])
                                       for r in rows])
        predicted = crossover(spec, rates_fit, link, "fp32", suffix, context)
        links.append({"gbit": gbit, "payload_gbps": link.bandwidth / 1e9, "rows": rows,
                      "crossover_measured": measured, "crossover_predicted": predicted,
                      "agreement": agreement(measured, predicted, prefixes)})
    return {"model": name, "engine": "kvpool reference engine (fp32, kvpool_causal kernel)",
            "threads": threads, "suffix": suffix, "prefixes": prefixes, "rtt_ms": rtt_ms,
            "delay": "tc tbf shapes the rate only (no sch_netem here): the veth's own "
                     f"round trip, {rtt_ms:.3f} ms, is the link's delay",
            "tc": shaped, "fit": {"linear_gflops": fit.linear_flops / 1e9,
                                  "attention_gflops": fit.attention_flops / 1e9,
                                  "overhead_ms": fit.overhead_s * 1e3,
                                  "max_rel_error": fit.max_rel_error},
            "links": links, "load_average": os.getloadavg(), "finished": time.time()}


def _predict(spec, rates, prefix: int, suffix: int, link: Link | None) -> float:
    """Predicted TTFT (s): overhead + compute, after loading ``prefix`` over ``link``
    (None: recompute everything)."""
    n = prefix + suffix
    if link is None:
        return rates.overhead_s + compute_seconds(spec, n, 0, rates)
    return (rates.overhead_s + compute_seconds(spec, n, prefix, rates)
            + fetch_seconds(spec, prefix, link.bandwidth, link.latency_s, "fp32"))


def measured_crossover(diffs: list[tuple[int, float]]) -> dict:
    """Where ``fetch − recompute`` (ms, per prefix length, ascending) turns negative.

    Returns {"tokens": interpolated prefix length or None, "relation": "between",
    "below" (fetch wins at every measured length) or "above" (recompute wins at the
    longest one)}. With noise crossing back and forth, the last change to negative counts.
    """
    if all(d < 0 for _, d in diffs):
        return {"tokens": None, "relation": "below"}
    changes = [i for i in range(len(diffs) - 1) if diffs[i][1] >= 0 > diffs[i + 1][1]]
    if not changes:  # recompute wins at the longest prefix measured
        return {"tokens": None, "relation": "above"}
    (p0, d0), (p1, d1) = diffs[changes[-1]], diffs[changes[-1] + 1]
    return {"tokens": p0 + (p1 - p0) * d0 / (d0 - d1), "relation": "between"}


def agreement(measured: dict, predicted: int | None, prefixes: list[int]) -> dict:
    """Measured vs predicted crossover: the relative error when both fall inside the
    measured range, else whether both lie on the same side of it."""
    lo, hi = prefixes[0], prefixes[-1]
    side = ("below" if predicted is not None and predicted < lo else
            "above" if predicted is None or predicted > hi else "between")
    if measured["relation"] == "between" and side == "between":
        error = predicted / measured["tokens"] - 1
        return {"error": error, "within_tolerance": abs(error) <= TOLERANCE}
    return {"error": None, "within_tolerance": measured["relation"] == side,
            "note": f"measured {measured['relation']}, predicted {side} the range {lo}..{hi}"}


def _cross_text(measured: dict, prefixes: list[int]) -> str:
    if measured["relation"] == "below":
        return f"< {prefixes[0]}"
    if measured["relation"] == "above":
        return f"> {prefixes[-1]}"
    return f"{measured['tokens']:.0f}"


def format_table(doc: dict) -> str:
    """One Markdown row per link rate and prefix length, then the crossovers."""
    lines = [f"model {doc['model']}, {doc['engine']}, {doc['threads']} thread(s), suffix "
             f"{doc['suffix']} tokens; {doc['delay']}",
             f"fit of the recompute runs: linear {doc['fit']['linear_gflops']:.1f} GFLOP/s, "
             f"attention {doc['fit']['attention_gflops']:.1f} GFLOP/s, overhead "
             f"{doc['fit']['overhead_ms']:.0f} ms",
             "| link Gbit/s | prefix | recompute ms | fetch ms | load ms | effective GB/s "
             "| predicted recompute ms | predicted fetch ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for link in doc["links"]:
        for r in link["rows"]:
            lines.append(f"| {link['gbit']:g} | {r['prefix']} | {r['recompute_ms']:.0f} | "
                         f"{r['fetch_ms']:.0f} | {r['load_ms']:.0f} | "
                         f"{r['effective_gbps']:.3g} | {r['predicted_recompute_ms']:.0f} | "
                         f"{r['predicted_fetch_ms']:.0f} |")
    lines += ["", "| link Gbit/s | crossover measured (tokens) | predicted | agreement |",
              "|---:|---:|---:|---|"]
    for link in doc["links"]:
        a = link["agreement"]
        verdict = (f"{a['error']:+.0%}" if a["error"] is not None else a["note"]) + \
            (" (within 20%)" if a["within_tolerance"] else " (NOT within)")
        pred = link["crossover_predicted"]
        lines.append(f"| {link['gbit']:g} | {_cross_text(link['crossover_measured'], doc['prefixes'])}"
                     f" | {pred if pred is not None else 'none'} | {verdict} |")
    return "\n".join(lines)


def plot_links(doc: dict, path: str) -> None:
    """TTFT vs prefix length: recompute, and fetch per link rate (measured markers,
    predicted lines), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.6))
    first = doc["links"][0]["rows"]
    xs = [r["prefix"] for r in first]
    ax.plot(xs, [r["recompute_ms"] for r in first], "ks", label="recompute (measured)")
    ax.plot(xs, [r["predicted_recompute_ms"] for r in first], "k-", label="recompute (predicted)")
    for i, link in enumerate(doc["links"]):
        color = f"C{i}"
        ax.plot(xs, [r["fetch_ms"] for r in link["rows"]], "o", color=color,
                label=f"fetch at {link['gbit']:g} Gbit/s")
        ax.plot(xs, [r["predicted_fetch_ms"] for r in link["rows"]], "--", color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"cached prefix (tokens), then {doc['suffix']} new tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"{doc['model']}: fetch over a shaped link vs recompute (dashed: predicted)",
                 fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
