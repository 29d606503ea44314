"""Requests that look at every object, in slices, so that one request never holds the
master's event loop for long (K23).

Each scan is a generator over a :class:`~kvpool.master.service.MasterService`: it does
at most :data:`SCAN_SLICE` objects' work, yields, and returns its reply when done
(``StopIteration.value``). The server runs it with :func:`run_in_slices`, which lets
every other ready request run between two slices; :func:`run_to_end` runs it at once
(in-process use, tests). A scan walks a snapshot of the keys taken when it starts (one
C-level copy of references): objects created after that are not seen, objects gone
since are skipped, so a scan's result is that of some order of the requests that
interleaved with it.

Key patterns are RE2 (google-re2): matching takes time linear in the key's length, so
no pattern can backtrack exponentially (``^(a+)+$`` over ``aaaa...b`` takes 2.5 s per
key with Python's ``re``). RE2 is Python's ``re`` syntax without backreferences and
lookaround (https://github.com/google/re2/wiki/Syntax); a pattern that uses them, that
does not compile, or whose program would exceed :data:`PATTERN_MAX_MEM` is refused with
INVALID_PARAMS.
"""

from __future__ import annotations

import asyncio
import heapq
from itertools import islice
from typing import Callable, Generator, TypeVar

import re2

from kvpool.errors import ErrorCode
from kvpool.protocol import CountResp

SCAN_SLICE = 1000  # objects per turn of the event loop (measured: ~0.3 ms for a regex removal slice)
PATTERN_MAX_MEM = 8 << 20  # bytes RE2 may spend on one compiled pattern
T = TypeVar("T")
Scan = Generator[None, None, T]


def key_matcher(pattern: str) -> Callable[[str], bool] | None:
    """A linear-time ``search`` predicate for ``pattern`` (RE2 syntax), or None when the
    pattern is refused (see the module docstring)."""
    options = re2.Options()
    options.log_errors = False
    options.max_mem = PATTERN_MAX_MEM
    try:
        rx = re2.compile(pattern, options)
    except re2.error:
        return None
    return lambda key: rx.search(key) is not None


def _slices(keys: list[str]):
    for start in range(0, len(keys), SCAN_SLICE):
        yield keys[start : start + SCAN_SLICE]


def remove_matching(svc, pattern: str | None, force: bool) -> Scan[CountResp]:
    """Remove every visible object (whose key matches ``pattern``: RE2 ``search``; None:
    all); leased objects are skipped unless ``force``. Returns CountResp(OK, removed), or
    CountResp(INVALID_PARAMS) for a refused pattern."""
    match = None if pattern is None else key_matcher(pattern)
    if pattern is not None and match is None:
        return CountResp(ErrorCode.INVALID_PARAMS)
    count = 0
    for keys in _slices(list(svc.objects)):
        for key in keys:
            obj = svc.objects.get(key)
            if obj is not None and obj.visible and (match is None or match(key)):
                count += svc.remove(key, force).code == ErrorCode.OK
        yield
    return CountResp(ErrorCode.OK, count)


def visible_keys(svc, prefix: str, limit: int) -> Scan[tuple[list[str], int]]:
    """The first ``limit`` keys (sorted) of visible objects that start with ``prefix``,
    and how many there are: each slice's matches are sorted, then merged lazily."""
    runs, count = [], 0
    for keys in _slices(list(svc.objects)):
        run = sorted(k for k in keys if k.startswith(prefix) and _visible(svc, k))
        count += len(run)
        runs.append(run)
        yield
    merged, first = heapq.merge(*runs), []
    while len(first) < limit:
        piece = list(islice(merged, min(SCAN_SLICE, limit - len(first))))
        if not piece:
            break
        first += piece
        yield
    return first, count


def _visible(svc, key: str) -> bool:
    obj = svc.objects.get(key)
    return obj is not None and obj.visible


def run_to_end(scan: Scan[T]) -> T:
    """Run a scan (or any generator) to its end at once; its return value."""
    while True:
        try:
            next(scan)
        except StopIteration as stop:
            return stop.value


async def run_in_slices(scan: Scan[T]) -> T:
    """Run a scan on the event loop, letting other ready work run after each slice."""
    while True:
        try:
            next(scan)
        except StopIteration as stop:
            return stop.value
        await asyncio.sleep(0)
