"""Fetch a cached prefix over a network link, or recompute it?

Loading ``P`` cached tokens over a link costs a fixed latency plus their KV bytes over
the link's payload bandwidth; recomputing them costs their share of the prefill
(:mod:`kvpool.plan.prefill`). With a suffix of ``S`` new tokens after the prefix:

    fetch(P)     = round_trips · 2 · delay + bytes(P) / B_payload
    recompute(P) = T_compute(P + S, 0) − T_compute(P + S, P)

The net gain ``recompute(P) − fetch(P)`` is convex in ``P`` (bytes grow linearly,
while the attention work a cached token saves grows with its position) and negative at
``P = 0`` (the latency), so it crosses zero at most once: below the crossover
recomputing is faster, above it fetching is. The same convexity makes a lookup's
decision all-or-nothing: loading part of a found run never beats both loading all of
it and loading none.

``B_payload`` is the line rate times the TCP payload share of a full frame, MSS over
frame bytes: 1448 / 1514 at an MTU of 1500 (20 bytes IPv4, 20 TCP, 12 TCP timestamp
option, 14 Ethernet header; RFC 791, RFC 9293, RFC 7323). Round trips of one kvpool
load: the existence check (lookup), the master's replica list (read grant), the node's
data read (:mod:`kvpool.client`); the read-done notification is not waited for.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.errors import UserError
from kvpool.plan.prefill import Rates, kv_bytes, prefill_flops
from kvpool.plan.spec import ModelSpec

TCP_PAYLOAD_SHARE = 1448 / 1514
LOAD_ROUND_TRIPS = 3


@dataclass(frozen=True)
class Link:
    """A network link: line rate ``gbit`` (Gbit/s), one-way ``delay_ms``, and the
    round trips of one load (:data:`LOAD_ROUND_TRIPS`). Raises UserError when the rate
    is not > 0 or the delay is negative."""

    gbit: float
    delay_ms: float = 0.0
    round_trips: int = LOAD_ROUND_TRIPS
    payload_share: float = TCP_PAYLOAD_SHARE

    def __post_init__(self):
        if not 0 < self.gbit < float("inf"):
            raise UserError(f"link rate must be a finite number > 0 Gbit/s, got {self.gbit:g}")
        if not 0 <= self.delay_ms < float("inf"):
            raise UserError(f"link delay must be >= 0 ms, got {self.delay_ms:g}")

    @property
    def bandwidth(self) -> float:
        """Payload bytes/s."""
        return self.gbit * 1e9 / 8 * self.payload_share

    @property
    def latency_s(self) -> float:
        """Fixed seconds of one load: its round trips."""
        return self.round_trips * 2 * self.delay_ms / 1e3


def compute_seconds(spec: ModelSpec, prompt: int, cached: int, rates: Rates) -> float:
    """Compute part of a prefill's TTFT (linear + attention, no overhead, no load)."""
    f = prefill_flops(spec, prompt, cached, rates.attention_kernel)
    return f.linear / rates.linear + f.attention / rates.attention


def fetch_seconds(spec: ModelSpec, tokens: int, bandwidth: float, latency_s: float,
                  kv_dtype: str, tp: int = 1, pp: int = 1) -> float:
    """Seconds to load the KV of ``tokens`` tokens (one rank) at ``bandwidth`` bytes/s
    after ``latency_s``; 0 for no tokens."""
    if tokens <= 0:
        return 0.0
    return latency_s + kv_bytes(spec, tokens, kv_dtype, tp, pp) / bandwidth


def recompute_seconds(spec: ModelSpec, prompt: int, computed: int, tokens: int,
                      rates: Rates) -> float:
    """Compute seconds that loading ``tokens`` tokens after ``computed`` ones saves in a
    ``prompt``-token prefill: ``T(prompt, computed) − T(prompt, computed + tokens)``."""
    if tokens <= 0:
        return 0.0
    return (compute_seconds(spec, prompt, computed, rates)
            - compute_seconds(spec, prompt, computed + tokens, rates))


def fetch_gain(spec: ModelSpec, prefix: int, suffix: int, rates: Rates, link: Link,
               kv_dtype: str, tp: int = 1, pp: int = 1) -> float:
    """Seconds fetching a ``prefix``-token prefix saves over recomputing it, before a
    ``suffix``-token tail (negative: recomputing is faster)."""
    return (recompute_seconds(spec, prefix + suffix, 0, prefix, rates)
            - fetch_seconds(spec, prefix, link.bandwidth, link.latency_s, kv_dtype, tp, pp))


def crossover(spec: ModelSpec, rates: Rates, link: Link, kv_dtype: str, suffix: int,
              max_prefix: int, tp: int = 1, pp: int = 1) -> int | None:
    """The smallest prefix length in ``[1, max_prefix]`` from which fetching it over
    ``link`` beats recomputing it (module docstring), or None when recomputing wins
    up to ``max_prefix``. Bisection: the gain changes sign at most once."""
    if suffix < 1 or max_prefix < 1:
        raise UserError(f"suffix and max prefix must be >= 1 token, got {suffix}, {max_prefix}")

    def wins(p: int) -> bool:
        return fetch_gain(spec, p, suffix, rates, link, kv_dtype, tp, pp) > 0

    if not wins(max_prefix):
        return None
    lo, hi = 0, max_prefix  # wins(lo) is False (the latency, or nothing to fetch)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid, hi)
    return hi
