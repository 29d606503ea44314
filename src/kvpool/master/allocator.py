"""Offset allocator for one segment: best-fit over a coalescing free list.

Free blocks are kept twice, sorted: by start offset (to find neighbours when freeing,
so adjacent blocks coalesce) and by (size, start) (best fit by bisection). Both are plain
sorted lists searched with :mod:`bisect`: O(log n) search, plus a memmove for insertion
that stays cheap for the block counts a segment sees. Sizes are rounded up to
``alignment`` bytes so copies start on cache-line boundaries; ``used`` counts the
rounded sizes, so freeing everything brings it back to exactly 0.
"""

from __future__ import annotations

import bisect


class OffsetAllocator:
    """Hands out ``[offset, offset + size)`` ranges of a segment of ``capacity`` bytes.

    Args:
        capacity: segment size in bytes (any non-negative int, 64-bit sizes included).
        alignment: every block starts on and is sized in multiples of this (bytes).
    """

    def __init__(self, capacity: int, alignment: int = 64):
        self.capacity = capacity
        self.alignment = alignment
        self.used = 0
        self._starts: list[int] = []
        self._size_at: dict[int, int] = {}
        self._by_size: list[tuple[int, int]] = []
        usable = capacity - capacity % alignment
        if usable:
            self._insert(0, usable)

    @classmethod
    def with_used(cls, capacity: int, alignment: int, ranges: list[tuple[int, int]]) -> "OffsetAllocator":
        """An allocator whose blocks ``ranges`` ((offset, size), sorted by offset, aligned,
        not overlapping once rounded up: the caller checks) are allocated, the rest free."""
        alloc = cls(0, alignment)
        alloc.capacity = capacity
        pos = 0
        for offset, size in ranges:
            if offset > pos:
                alloc._insert(pos, offset - pos)
            pos = offset + alloc.rounded(size)
            alloc.used += alloc.rounded(size)
        usable = capacity - capacity % alignment
        if usable > pos:
            alloc._insert(pos, usable - pos)
        return alloc

    def rounded(self, size: int) -> int:
        """Bytes a request of ``size`` occupies (at least one alignment unit)."""
        a = self.alignment
        return max(a, -(-size // a) * a)

    @property
    def largest_free(self) -> int:
        """Size of the largest free block in bytes (0 when full)."""
        return self._by_size[-1][0] if self._by_size else 0

    def allocate(self, size: int) -> int | None:
        """Offset of a new block of ``size`` bytes, or None when no free block fits."""
        need = self.rounded(size)
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        block, start = self._by_size[i]
        self._remove(start)
        if block > need:
            self._insert(start + need, block - need)
        self.used += need
        return start

    def free(self, offset: int, size: int) -> None:
        """Return the block at ``offset`` allocated with ``size``; coalesces neighbours."""
        need = self.rounded(size)
        i = bisect.bisect_left(self._starts, offset)
        # a block being freed must not overlap a free one: that would be a double free
        assert i == len(self._starts) or offset + need <= self._starts[i], "double free"
        start, length = offset, need
        if i < len(self._starts) and self._starts[i] == offset + need:
            length += self._remove(self._starts[i])
        if i > 0:
            prev = self._starts[i - 1]
            prev_end = prev + self._size_at[prev]
            assert prev_end <= offset, "double free"
            if prev_end == offset:
                start, length = prev, length + self._remove(prev)
        self._insert(start, length)
        self.used -= need
        assert self.used >= 0

    def _insert(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._size_at[start] = length
        bisect.insort(self._by_size, (length, start))

    def _remove(self, start: int) -> int:
        length = self._size_at.pop(start)
        del self._starts[bisect.bisect_left(self._starts, start)]
        del self._by_size[bisect.bisect_left(self._by_size, (length, start))]
        return length
