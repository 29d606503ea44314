"""Counters of one prefix cache (thread safe; read as a dict).

Names (all monotonically increasing integers):
    lookups, lookup_tokens           match() calls and the prompt tokens they covered
    hit_tokens_l1/_l2/_l3            matched tokens by the tier that holds them
    pages_loaded_l3, bytes_loaded_l3 pages and bytes read back from L3 by load()
    pages_written_l3, bytes_written_l3, pages_dedup_l3
                                     backups written, and pages skipped as already in L3
    evictions_l1, evictions_l2       pages dropped from a tier to make room
    page_rejects, page_rejects_<why> L3 pages refused on load (checksum, namespace, ...)
    l3_vanished                      pages present at match() but gone at load()
    l3_errors                        L3 calls that failed as a whole (treated as misses)
    key_collisions                   same page key, different token ids (never a hit)
    l1_full                          inserts cut short: every L1 page locked

Gauges are read live rather than counted here: pages used per tier, tree pages and the
backup queue depth (:mod:`kvpool.cache.prometheus` exposes them).
"""

from __future__ import annotations

import threading
from collections import Counter


class CacheMetrics:
    """A counter map; ``metrics["hit_tokens_l1"]`` reads 0 for a name never counted."""

    def __init__(self):
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter."""
        with self._lock:
            return dict(self._counts)

    def __repr__(self) -> str:
        return f"CacheMetrics({self.snapshot()})"
