"""Hit counts across tensor-parallel ranks.

Each TP rank caches its own head slice under its own namespace, so one rank may hold a
page that another evicted. A prefix is usable only if every rank has it: the cache
applies a reduction (the minimum over ranks, as SGLang HiCache all-reduces its storage
hit count) to every match's hit count. It is a collective: every rank must make the
same matches in the same order, from one thread.
"""

from __future__ import annotations

from collections.abc import Callable


def local_hits(pages: int) -> int:
    """Single process: the hit count as it is."""
    return pages


def min_across_ranks(group=None) -> Callable[[int], int]:
    """A reduction taking the minimum over the ranks of a ``torch.distributed`` group.

    The process group must be initialised (any backend that supports MIN, e.g. gloo).
    """
    import torch
    import torch.distributed as dist

    def reduce(pages: int) -> int:
        t = torch.tensor([pages], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t.item())

    return reduce
