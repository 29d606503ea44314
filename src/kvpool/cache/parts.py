"""Objects a hybrid model keeps beside its KV pages: window pages and state checkpoints.

One :class:`PartStore` holds one part, keyed by page key: the sliding-window layers' KV of
a page (part ``"window"``), or the recurrent + convolution state of every linear layer at
a checkpoint boundary (part ``"state"``). Unlike the KV pages of the radix tree, these
are needed only near a hit point (the window before it, the checkpoint at it), so they
live in a flat map: any entry may go whatever its prefix still holds, least recently
used first. Older window pages, never touched by a hit beyond the window, are therefore
the first to go.

L1 is a pool of slots in the process with LRU eviction of unlocked entries; L3 is the
cache's backend through an :class:`~kvpool.cache.l3_tier.L3Tier` whose objects are
``kvp/<hex>/<part>``, with the page header and checks of every stored page (codec):
a part that fails its check is a miss, never a hit.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence

import torch

from kvpool.cache.l3 import BACKEND_ERRORS, L3Backend
from kvpool.cache.l3_tier import Backup, L3Tier
from kvpool.cache.metrics import CacheMetrics
from kvpool.cache.namespace import Namespace
from kvpool.cache.pool import PagePool
from kvpool.cache.tree import Tier


@dataclasses.dataclass(eq=False)
class _Entry:
    slot: int
    tokens: bytes     # the page's token ids (uint32-LE): a key collision is never a hit
    locks: int = 0
    backed_up: bool = False


class PrefixedMetrics:
    """A view of a :class:`CacheMetrics` that prefixes every name it counts (so one part's
    L3 counters, e.g. ``pages_loaded_l3``, read ``state_pages_loaded_l3``)."""

    def __init__(self, base: CacheMetrics, prefix: str):
        self.base, self.prefix = base, prefix

    def inc(self, name: str, n: int = 1) -> None:
        self.base.inc(self.prefix + name, n)

    def __getitem__(self, name: str) -> int:
        return self.base[self.prefix + name]


class PartStore:
    """One part of a hybrid model's pages, by page key, in L1 and optionally L3.

    Args:
        ns: the namespace (digest in every header).
        part: the object suffix, "window" or "state".
        shape: shape of one entry (a window page ``(L_w, 2, H, P, D)``, a checkpoint
            ``(elements,)``).
        dtype: torch dtype of an entry.
        slots: entries L1 holds (> 0).
        l3: the L3 backend or None.
        metrics: counters (L3 names prefixed by ``part + "_"``; ``<part>_evictions_l1``).
        async_backup: write L3 backups on a background thread.

    Thread safe (one lock; L3 I/O outside it).
    """

    def __init__(self, ns: Namespace, part: str, shape: Sequence[int], dtype: torch.dtype,
                 slots: int, l3: L3Backend | None, metrics: CacheMetrics,
                 async_backup: bool = True):
        self.part = part
        self.pool = PagePool(slots, tuple(shape), dtype)
        self.metrics = PrefixedMetrics(metrics, part + "_")
        self._entries: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.l3_tier = (L3Tier(l3, ns, self.pool.page_shape, dtype, self.metrics, async_backup,
                               part=part) if l3 is not None else None)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.pool.page_shape

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    # -- lookup -----------------------------------------------------------------------
    def find(self, keys: Sequence[bytes], toks: Sequence[bytes]) -> list[Tier | None]:
        """Where each entry is now: Tier.L1, Tier.L3 or None (absent; a key whose token ids
        differ is absent). L3 is asked once, for the entries L1 lacks."""
        with self._lock:
            where: list[Tier | None] = [
                Tier.L1 if (e := self._entries.get(k)) is not None and e.tokens == t else None
                for k, t in zip(keys, toks, strict=True)]
        ask = [i for i, w in enumerate(where) if w is None]
        if ask and self.l3_tier is not None:
            try:
                missing = self.l3_tier.store.missing([keys[i] for i in ask])
            except BACKEND_ERRORS:
                self.metrics.inc("l3_errors")
                missing = [True] * len(ask)
            for i, miss in zip(ask, missing):
                where[i] = None if miss else Tier.L3
        return where

    def lock(self, keys: Sequence[bytes]) -> list[bytes]:
        """Lock the L1 entries of ``keys`` against eviction; returns the keys locked
        (unlock exactly those)."""
        with self._lock:
            held = [k for k in keys if k in self._entries]
            for key in held:
                self._entries[key].locks += 1
                self._entries.move_to_end(key)
            return held

    def unlock(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                entry = self._entries[key]
                assert entry.locks > 0, f"unlock of an unlocked {self.part} entry"
                entry.locks -= 1

    def read(self, keys: Sequence[bytes], indices: Sequence[int], out: torch.Tensor) -> bool:
        """Copy entries ``keys`` (page numbers ``indices``) into ``out[i]``; locked L1
        entries are copied, the others read from L3 and checked. False at the first that
        is gone or fails its check (``out`` then holds garbage)."""
        with self._lock:
            in_l1 = {k: self._entries[k].slot for k in keys if k in self._entries}
            for i, key in enumerate(keys):
                if key in in_l1:
                    out[i].copy_(self.pool.data[in_l1[key]])
        for lo, hi in _runs([i for i, k in enumerate(keys) if k not in in_l1], indices):
            if self.l3_tier is None:
                return False
            if self.l3_tier.read_into(keys[lo:hi], indices[lo], out[lo:hi]) < hi - lo:
                return False
        return True

    # -- insertion --------------------------------------------------------------------
    def insert(self, keys: Sequence[bytes], toks: Sequence[bytes], indices: Sequence[int],
               entries: torch.Tensor) -> int:
        """Add ``entries[i]`` (``[n, *shape]``) under ``keys[i]`` (page ``indices[i]``) to
        L1, evicting LRU unlocked entries; queue an L3 backup of the ones L3 may lack.
        Returns the entries L1 holds now (fewer when every slot is locked)."""
        held, todo = 0, []
        with self._lock:
            for key, tok, index, value in zip(keys, toks, indices, entries, strict=True):
                entry = self._entries.get(key)
                if entry is None:
                    slot = self._alloc()
                    if slot is None:
                        self.metrics.inc("l1_full")
                        break
                    self.pool.data[slot].copy_(value)
                    entry = self._entries[key] = _Entry(slot, tok)
                elif entry.tokens != tok:
                    self.metrics.inc("key_collisions")
                    continue
                self._entries.move_to_end(key)
                held += 1
                if not entry.backed_up and self.l3_tier is not None:
                    entry.locks += 1  # until the backup is written
                    entry.backed_up = True
                    todo.append((key, index))
        if todo:
            self.l3_tier.backup(self._backup_job(todo))
        return held

    def _alloc(self) -> int | None:
        """A free slot, evicting the least recently used unlocked entry if needed."""
        slot = self.pool.alloc()
        if slot is not None:
            return slot
        victim = next((k for k, e in self._entries.items() if not e.locks), None)
        if victim is None:
            return None
        self.pool.free(self._entries.pop(victim).slot)
        self.metrics.inc("evictions_l1")
        return self.pool.alloc()

    def _backup_job(self, todo: list[tuple[bytes, int]]) -> Backup:
        keys = [k for k, _ in todo]

        def gather() -> torch.Tensor:
            with self._lock:
                return torch.stack([self.pool.data[self._entries[k].slot] for k in keys]).cpu()

        def done(stored: list[bool]) -> None:
            with self._lock:
                for key, ok in zip(keys, stored):
                    entry = self._entries[key]
                    entry.backed_up = ok
                    entry.locks -= 1

        return Backup(keys, [i for _, i in todo], gather, done)


def _runs(positions: list[int], indices: Sequence[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of consecutive ``positions`` whose page numbers are consecutive
    too (one L3 read each: the tier reads pages ``first, first + 1, ...``)."""
    runs: list[tuple[int, int]] = []
    for pos in positions:
        if runs and runs[-1][1] == pos and indices[pos] == indices[pos - 1] + 1:
            runs[-1] = (runs[-1][0], pos + 1)
        else:
            runs.append((pos, pos + 1))
    return runs
