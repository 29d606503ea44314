"""Eviction order: objects by lease deadline (oldest first), as a heap with lazy deletion.

Mooncake evicts in lease-deadline order, an approximate LRU: every read extends the
deadline, and a put counts as a use. Rather than sorting every object on each eviction
(O(n log n), ~150 ms at 100k objects), each deadline change pushes a heap entry; entries
whose object is gone or whose deadline has changed since are stale and skipped when
popped. The heap is rebuilt when stale entries outnumber live objects, so memory stays
O(objects). A pass costs O(k log n) for k popped entries.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator

from kvpool.master.objects import ObjectMeta


class EvictionQueue:
    """Visible, not hard-pinned objects in lease-deadline order (see module docstring)."""

    def __init__(self, objects: dict[str, ObjectMeta]):
        self._objects = objects
        self._heap: list[tuple[float, int, ObjectMeta]] = []
        self._seq = itertools.count()  # tie-break: equal deadlines keep push order

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, obj: ObjectMeta) -> None:
        """Record ``obj`` at its current ``lease_deadline`` (call after every change)."""
        if obj.hard_pin:
            return  # never evicted; pushed again if unpinned
        heapq.heappush(self._heap, (obj.lease_deadline, next(self._seq), obj))
        if len(self._heap) > 2 * len(self._objects) + 1024:
            self._rebuild()

    def _current(self, deadline: float, obj: ObjectMeta) -> bool:
        return (self._objects.get(obj.key) is obj and obj.visible and not obj.hard_pin
                and obj.lease_deadline == deadline)

    def pop_due(self, now: float) -> Iterator[ObjectMeta]:
        """Pop and yield current objects whose lease ended by ``now``, oldest first.

        Stops at the first leased entry (all later ones are leased too). Objects the
        caller does not evict must be :meth:`push`-ed back.
        """
        seen: set[int] = set()
        while self._heap:
            deadline, _, obj = self._heap[0]
            if deadline > now and self._current(deadline, obj):
                return
            heapq.heappop(self._heap)
            if self._current(deadline, obj) and id(obj) not in seen:
                seen.add(id(obj))
                yield obj

    def _rebuild(self) -> None:
        self._heap = [(o.lease_deadline, next(self._seq), o) for o in self._objects.values()
                      if o.visible and not o.hard_pin]
        heapq.heapify(self._heap)
