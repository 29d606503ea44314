"""L2: a host page pool in POSIX shared memory, in one of SGLang HiCache's layouts.

The pool is one shared-memory block, so other processes of the host (TP ranks, a
sidecar) can map the same pages by name. Layouts (SGLang's ``--hicache-mem-layout``
names; MHA KV; ``N`` pages of ``P`` tokens, ``L`` layers, ``H`` KV heads, ``D`` head dim):

    layer_first        [2, L, N*P, H, D]   one contiguous run per (K/V, layer)
    page_first         [2, N*P, L, H, D]   one token's layers together
    page_first_direct  [2, N, L, P, H, D]  one page's layers together, page-major

A page moves to or from the engine's page layout ``[L, 2, H, P, D]`` (kvpool's reference
engine) in one strided copy. Slots are handed out by the owning process only; another
process that attaches reads and writes the slots it is told about.
"""

from __future__ import annotations

import math
from multiprocessing import resource_tracker, shared_memory

import torch

from kvpool.cache.pool import FreeSlots, SlotPool
from kvpool.errors import InvalidParams

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class HostPool(SlotPool):
    """``num_pages`` KV pages in shared memory.

    Args:
        num_pages: pages in the pool (> 0).
        page_shape: the engine page shape ``(L, 2, H, P, D)``.
        dtype: torch dtype of the KV.
        layout: one of LAYOUTS.
        name: shared-memory name; None picks a fresh one (see ``.name``).
        create: True to create (and own: unlinked by :meth:`close`), False to attach.

    Raises InvalidParams for another page shape, an unknown layout or a size mismatch on
    attach; FileNotFoundError when attaching a name that does not exist.
    """

    def __init__(self, num_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype,
                 layout: str = "layer_first", name: str | None = None, create: bool = True):
        if layout not in LAYOUTS:
            raise InvalidParams(f"L2 layout must be one of {LAYOUTS}, got {layout!r}")
        if len(page_shape) != 5 or page_shape[1] != 2 or num_pages <= 0:
            raise InvalidParams(f"L2 needs pages of shape (L, 2, H, P, D) and > 0 pages, "
                                f"got {tuple(page_shape)} x {num_pages}")
        self.num_pages, self.layout, self.owner = num_pages, layout, create
        self.page_shape = tuple(int(d) for d in page_shape)
        L, _, H, P, D = self.page_shape
        dims = {"layer_first": (2, L, num_pages * P, H, D),
                "page_first": (2, num_pages * P, L, H, D),
                "page_first_direct": (2, num_pages, L, P, H, D)}[layout]
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(dims) * itemsize
        self.page_bytes = nbytes // num_pages
        self._shm = shared_memory.SharedMemory(name=name, create=create, size=nbytes)
        if not create:
            # Python 3.11 registers attached blocks too and would unlink the owner's block
            # when this process exits; only the owner may unlink.
            resource_tracker.unregister(self._shm._name, "shared_memory")
            if self._shm.size < nbytes:
                self._shm.close()
                raise InvalidParams(f"shared memory {name!r} is smaller than this pool")
        self.kv = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes).view(dtype).view(dims)
        self._slots = FreeSlots(num_pages if create else 0)  # only the owner hands out slots

    @property
    def name(self) -> str:
        return self._shm.name

    def page(self, slot: int) -> torch.Tensor:
        """A view of page ``slot`` in the engine layout ``[L, 2, H, P, D]`` (strided)."""
        P = self.page_shape[3]
        if self.layout == "layer_first":
            return self.kv[:, :, slot * P:(slot + 1) * P].permute(1, 0, 3, 2, 4)
        if self.layout == "page_first":
            return self.kv[:, slot * P:(slot + 1) * P].permute(2, 0, 3, 1, 4)
        return self.kv[:, slot].permute(1, 0, 3, 2, 4)

    def write(self, slots: list[int], pages: torch.Tensor) -> None:
        """Copy ``pages`` [n, L, 2, H, P, D] into ``slots`` (one strided copy per page)."""
        for slot, page in zip(slots, pages, strict=True):
            self.page(slot).copy_(page)

    def read(self, slots: list[int], out: torch.Tensor) -> None:
        """Copy pages ``slots`` into ``out`` [n, L, 2, H, P, D] (any device)."""
        for i, slot in enumerate(slots):
            out[i].copy_(self.page(slot))

    def close(self) -> None:
        """Unmap; the owner also removes the shared-memory name."""
        if self._shm is None:
            return
        del self.kv
        self._shm.close()
        if self.owner:
            self._shm.unlink()
        self._shm = None

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
