"""L1: an in-process page pool, one preallocated tensor and a free list of slots.

The pool only hands out and takes back slots; which slot to evict is the radix tree's
job (LRU over unlocked nodes), so allocation and freeing are O(1) and never scan.
"""

from __future__ import annotations

import math

import torch

from kvpool.errors import InvalidParams


class FreeSlots:
    """A LIFO free list of ``n`` slot numbers with a double-free check; O(1) both ways."""

    def __init__(self, n: int):
        # Pop from the end: slot 0 is handed out first, which makes dumps easy to read.
        self._free = list(range(n - 1, -1, -1))
        self._is_free = [True] * n

    def __len__(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """One free slot, or None when every slot is taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = False
        return slot

    def free(self, slot: int) -> None:
        assert not self._is_free[slot], f"double free of slot {slot}"
        self._is_free[slot] = True
        self._free.append(slot)


class SlotPool:
    """Slot bookkeeping of a page pool (L1 and L2): subclasses set ``self._slots``."""

    _slots: FreeSlots

    @property
    def num_free(self) -> int:
        return len(self._slots)

    def alloc(self) -> int | None:
        """One free slot, or None when the pool is full (the caller evicts first)."""
        return self._slots.alloc()

    def free(self, slot: int) -> None:
        """Return ``slot`` to the free list."""
        self._slots.free(slot)


class PagePool(SlotPool):
    """``num_pages`` pages of ``page_shape`` in one tensor.

    Args:
        num_pages: slots in the pool (> 0).
        page_shape: shape of one page, e.g. (layers, 2, kv_heads, page_size, head_dim).
        dtype: torch dtype of the KV.
        device: where the tensor lives ("cpu" or a CUDA device).

    Attributes:
        data: tensor [num_pages, *page_shape]; ``data[slot]`` is one page.
        page_bytes: bytes of one page.
    """

    def __init__(self, num_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype,
                 device: str | torch.device = "cpu"):
        if num_pages <= 0:
            raise InvalidParams(f"a page pool needs > 0 pages, got {num_pages}")
        self.page_shape = tuple(int(d) for d in page_shape)
        self.data = torch.zeros((num_pages, *self.page_shape), dtype=dtype, device=device)
        self.page_bytes = math.prod(self.page_shape) * self.data.element_size()
        self._slots = FreeSlots(num_pages)

    @property
    def num_pages(self) -> int:
        return self.data.shape[0]
