"""A shaped link between two network namespaces: a veth pair under ``tc``.

Each end of the pair (:class:`kvpool.bench.systems.netns.VethPair`) gets a token-bucket
filter (``tc qdisc replace ... tbf``, sch_tbf) at the line rate, so both directions
run at that rate. A one-way delay would need sch_netem; where the kernel lacks it (as
on the development machine) the link keeps the veth's own round trip, measured by
:func:`connect_rtt_ms` and reported instead.

Bucket sizes: ``burst`` holds half a millisecond at the rate, and at least two 64 KiB
GSO segments (a smaller bucket than one segment makes tbf split or drop it);
``latency`` bounds the queue at 100 ms, far above the links' round trips, so TCP sees
no loss from the shaper itself.
"""

from __future__ import annotations

import shutil
import socket
import statistics
import subprocess
import time

from kvpool.bench.harness import Unavailable

MIN_BURST = 128 << 10
QUEUE_LATENCY = "100ms"


def _tc(ns: str, *args: str) -> str:
    out = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise Unavailable(f"tc -n {ns} {' '.join(args)}: {out.stderr.strip()[:200]}")
    return out.stdout


def burst_bytes(gbit: float) -> int:
    """tbf bucket for a ``gbit`` Gbit/s line rate (module docstring)."""
    return max(MIN_BURST, int(gbit * 1e9 / 8 * 0.5e-3))


def shape(pair, gbit: float) -> None:
    """Set both ends of ``pair`` (a created VethPair) to ``gbit`` Gbit/s.
    Raises Unavailable when tc is missing or refuses (no sch_tbf, not root)."""
    if not shutil.which("tc"):
        raise Unavailable("tc (iproute2) not installed")
    rate = f"{gbit * 1000:.6g}mbit"
    for ns, dev in ((pair.server, "kvb0"), (pair.client, "kvb1")):
        _tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
            "burst", str(burst_bytes(gbit)), "latency", QUEUE_LATENCY)


def shaped_rate(pair) -> str:
    """``tc qdisc show`` of the server end (for the report and tests)."""
    return _tc(pair.server, "qdisc", "show", "dev", "kvb0").strip()


def connect_rtt_ms(host: str, port: int, samples: int = 20) -> float:
    """Median TCP connect time to ``host:port`` in ms: one round trip (SYN, SYN-ACK)."""
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        with socket.create_connection((host, port), timeout=5):
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
