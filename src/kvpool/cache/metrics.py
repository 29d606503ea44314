"""Counters of one prefix cache (thread safe; read as a dict).

Names (all monotonically increasing integers):
    lookups, lookup_tokens           match() calls and the prompt tokens they covered
    hit_tokens_l1/_l2                tokens of matched tree pages (locked by match(), so
                                     load() serves every one), by the tier that held them
    hit_tokens_l3                    tokens of L3 pages that load() read and checked: the
                                     bytes landed (counted at a match's first load)
    announced_tokens_l3              tokens match() found present in L3 (not yet read)
    lost_tokens_l3                   announced by match(), then missing or refused at
                                     load() (vanished, rejected, L3 error); the match is cut
    pages_loaded_l3, bytes_loaded_l3 pages and bytes read back from L3 (load and prefetch)
    pages_written_l3, bytes_written_l3, pages_dedup_l3
                                     backups written, and pages skipped as already in L3
    pages_refused_l3                 backup pages the store did not take (full, a write
                                     that failed); offered again later
    evictions_l1, evictions_l2       pages dropped from a tier to make room
    evictions_stuck_l1               write_back victims skipped: no L2 slot for a page
                                     whose children live in L2 only (K20)
    page_rejects, page_rejects_<why> L3 pages refused on load (checksum, namespace, ...)
    l3_vanished                      L3 reads cut at a page present at match() (or in a
                                     prefetch plan) but gone when read; once per read
    l3_errors                        L3 calls that failed as a whole (l3.BACKEND_ERRORS:
                                     treated as misses; other errors propagate)
    key_collisions                   same page key, different token ids (never a hit)
    l1_full, l2_full                 placements cut short (insert, prefetch landing, copy
                                     to L2): no page of the tier could go

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
