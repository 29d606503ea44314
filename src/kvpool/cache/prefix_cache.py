"""The tiered prefix cache: find cached pages of a prompt, load them, add new ones.

Flow (SGLang HiCache's model, DESIGN.md "Tiered prefix cache"):

    h = cache.prefetch(tokens)             # optional, at arrival: L3 -> L2 in the background
    m = cache.match(tokens, prefetch=h)    # tree (L1/L2), then L3 asked live for the rest
    kv = cache.load(m)                     # [m.num_pages, *page_shape]; L3 pages checked
    ...prefill the tokens after m.num_tokens...
    cache.release(m)                       # the matched pages may be evicted again
    cache.insert(tokens, kv_pages)         # L1 (+ L2 by the write policy), L3 backup queued

A stored page that fails its header check (namespace, key, index, length, checksum,
version) is never used: the match is cut at that page and the reason counted. Pages that
a match, a queued backup or a prefetch holds are locked: no tier evicts them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvpool.cache.codec import HEADER_SIZE
from kvpool.cache.host_pool import HostPool
from kvpool.cache.keys import PageChain, page_chain
from kvpool.cache.l3 import L3Backend
from kvpool.cache.metrics import CacheMetrics
from kvpool.cache.namespace import Namespace
from kvpool.cache.pagestore import PageStore
from kvpool.cache.policies import SELECTIVE_HITS, PrefetchConfig, check_write_policy
from kvpool.cache.pool import PagePool
from kvpool.cache.prefetch import PrefetchHandle
from kvpool.cache.tree import Node, RadixTree
from kvpool.cache.worker import JobThread
from kvpool.errors import InvalidParams, KVPoolError


@dataclasses.dataclass(eq=False)
class Match:
    """The cached prefix of one prompt, as found by :meth:`PrefixCache.match`.

    Attributes:
        num_pages: full pages usable from the start of the prompt.
        page_size: tokens per page.
        tiers: "L1", "L2" or "L3" per page: where that page was found.
        nodes: the radix-tree part (locked until :meth:`PrefixCache.release`).
        l3_keys, l3_tokens: page keys and token bytes of the pages found only in L3.
        loaded: :meth:`PrefixCache.load` ran (its L3 hits and losses are counted).
    """

    num_pages: int
    page_size: int
    tiers: list[str]
    nodes: list[Node]
    l3_keys: list[bytes]
    l3_tokens: list[bytes]
    locked: Node | None = None
    released: bool = False
    loaded: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens covered by the match (``num_pages * page_size``)."""
        return self.num_pages * self.page_size

    def tokens_by_tier(self) -> dict[str, int]:
        """Tokens per tier the pages were found in, e.g. ``{"L1": 32, "L3": 16}``; after
        :meth:`PrefixCache.load`, only the pages it returned (the cut ones are gone)."""
        by_tier: dict[str, int] = {}
        for tier in self.tiers[:self.num_pages]:
            by_tier[tier] = by_tier.get(tier, 0) + self.page_size
        return by_tier

    def _truncate(self, num_pages: int) -> None:
        """Cut the L3 part so that only ``num_pages`` pages remain."""
        keep = num_pages - len(self.nodes)
        assert keep >= 0
        self.num_pages = num_pages
        self.tiers = self.tiers[:num_pages]
        self.l3_keys = self.l3_keys[:keep]
        self.l3_tokens = self.l3_tokens[:keep]


@dataclasses.dataclass
class _Backup:
    nodes: list[Node]   # one chain, root side first
    tail: Node          # locked until written


class PrefixCache:
    """Tiered prefix cache of one namespace.

    Args:
        ns: the namespace; every key chain starts from ``ns.digest()``.
        page_shape: shape of one page tensor; with L2 it must be ``(L, 2, H, P, D)``.
        dtype: torch dtype of the KV.
        l1_pages: pages in the L1 pool (preallocated on ``device``).
        l3: an L3 backend (StoreBackend, DiskBackend) or None.
        device: device of the L1 pool and of tensors returned by :meth:`load`.
        l2_pages: pages in the L2 host pool (shared memory; 0 = no L2).
        l2_layout: "layer_first", "page_first" or "page_first_direct" (see host_pool).
        write_policy: "write_through", "write_through_selective" or "write_back" (L1->L2).
        prefetch: when and how long to prefetch from L3 (PrefetchConfig).
        reduce_hits: ``f(pages) -> pages`` applied to every match's hit count, e.g. the
            minimum across TP ranks (``ranks.min_across_ranks``); called once per match,
            on the caller's thread, so every rank must make the same matches in order.
        async_backup: write L3 backups on a background thread (else inside insert).
        backup_queue: backups (one per insert) that may wait; beyond, a backup is dropped
            and counted (the pages stay un-backed-up and are offered again later).

    Thread safe: one lock guards the tree and the pools; L3 I/O runs outside it.
    """

    def __init__(self, ns: Namespace, page_shape: Sequence[int], dtype: torch.dtype = torch.float32,
                 l1_pages: int = 4096, l3: L3Backend | None = None,
                 device: str | torch.device = "cpu", l2_pages: int = 0,
                 l2_layout: str = "layer_first", write_policy: str = "write_through",
                 prefetch: PrefetchConfig | None = None,
                 reduce_hits: Callable[[int], int] | None = None,
                 async_backup: bool = True, backup_queue: int = 256):
        self.ns = ns
        self.page_size = ns.page_size
        self.write_policy = check_write_policy(write_policy)
        self.prefetch_config = prefetch or PrefetchConfig()
        self.reduce_hits = reduce_hits
        self.pool = PagePool(l1_pages, tuple(page_shape), dtype, device)
        self.l2 = HostPool(l2_pages, self.pool.page_shape, dtype, l2_layout) if l2_pages else None
        self.tree = RadixTree(write_back=self.l2 is not None and write_policy == "write_back")
        self.l3 = l3
        self.store = (PageStore(l3, ns.digest(), ns.page_size, self.pool.page_shape, dtype,
                                ns.object_layout) if l3 is not None else None)
        self.metrics = CacheMetrics()
        self._ns_digest = ns.digest()
        self._lock = threading.RLock()
        # L3 pages straight into staging rows (Client.batch_get_into), checked there
        self._direct_l3 = (self.store is not None and hasattr(l3, "get_into")
                           and len(self.store.parts) == 1)
        self._staging = np.empty((0, 0), dtype=np.uint8)
        self._staging_lock = threading.Lock()
        self._backups = (JobThread("kvpool-backup", self._run_backup, backup_queue)
                         if l3 is not None and async_backup else None)
        self._prefetcher = (JobThread("kvpool-prefetch", self._run_prefetch, 64)
                            if l3 is not None else None)

    @property
    def page_shape(self) -> tuple[int, ...]:
        return self.pool.page_shape

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.data.dtype

    # -- lookup ---------------------------------------------------------------------
    def match(self, token_ids: Sequence[int] | PageChain, max_pages: int | None = None,
              prefetch: PrefetchHandle | None = None) -> Match:
        """Longest cached prefix of ``token_ids``, in whole pages (at most ``max_pages``).

        ``token_ids`` may also be a PageChain (keys computed once, see keys.page_chain).
        With ``prefetch`` (from :meth:`prefetch` on the same tokens), that prefetch is first
        ended by its policy; the pages it landed are then found in the tree. Tree pages are
        locked until :meth:`release`; the rest of the chain is asked of L3 (longest
        prefix whose every object is present). Fewer tokens than a page: an empty match.
        Raises InvalidParams for token ids outside [0, 2**32).
        """
        keys, toks = self._keys(token_ids, max_pages)
        if prefetch is not None:
            self._end_prefetch(prefetch)
        with self._lock:
            nodes, collision = self.tree.match(keys, toks)
            for node in nodes:
                node.hits += 1
                self.tree.touch(node)
            locked = nodes[-1] if nodes else None
            if locked is not None:
                self.tree.lock(locked)
            if prefetch is not None:
                self._release_prefetch(prefetch)
        if collision:
            self.metrics.inc("key_collisions")
        n_l3 = 0
        if self.store is not None and not collision and len(nodes) < len(keys):
            n_l3 = self._l3_present(keys[len(nodes):])
        m = Match(len(nodes) + n_l3, self.page_size, [], nodes,
                  keys[len(nodes):len(nodes) + n_l3], toks[len(nodes):len(nodes) + n_l3], locked)
        # a collective across ranks: called without the lock, the match's pages stay locked
        agreed = self.reduce_hits(m.num_pages) if self.reduce_hits is not None else m.num_pages
        with self._lock:
            self._reduce(m, agreed)
            m.tiers = ["L1" if n.l1 >= 0 else "L2" for n in m.nodes] + ["L3"] * len(m.l3_keys)
            if self.write_policy == "write_through_selective" and self.l2 is not None:
                self._copy_to_l2([n for n in m.nodes if n.hits >= SELECTIVE_HITS])
        self._count_match(token_ids.num_tokens if isinstance(token_ids, PageChain)
                          else len(token_ids), m)
        return m

    def load(self, m: Match, out: torch.Tensor | None = None, adopt: bool = True) -> torch.Tensor:
        """The KV of the matched pages: tensor [m.num_pages, *page_shape], page order.

        L2 and L3 pages are copied into L1 too (so the next match finds them there);
        ``adopt=False`` leaves the L3 pages out of the tree, for a caller that inserts
        them itself later (the engine does after decoding: the copy into L1 is then off
        the time to first token). L3 pages are checked against their headers first; at
        the first page that is missing or fails, ``m`` is cut to the pages before it:
        use ``m.num_pages`` after this call.

        ``out``: optional destination ``[m.num_pages, *page_shape]`` of this cache's dtype,
        with any strides (e.g. a permuted view of the engine's own KV layout), filled
        instead of a new tensor; the result is then ``out[:m.num_pages]``. Each page is
        copied once into it: L1 pages straight from the pool, L3 pages from where the
        store's bytes landed (and checked).
        The first load of a match counts its L3 part: ``hit_tokens_l3`` for the pages
        that landed and passed their check, ``lost_tokens_l3`` for those L3 announced at
        :meth:`match` that did not (K21).
        Raises InvalidParams for a released match or an ``out`` of another shape or dtype.
        """
        if m.released:
            raise InvalidParams("load of a released match")
        if out is None:
            out = torch.empty((m.num_pages, *self.page_shape), dtype=self.dtype,
                              device=self.pool.data.device)
        elif tuple(out.shape) != (m.num_pages, *self.page_shape) or out.dtype != self.dtype:
            raise InvalidParams(f"out is {tuple(out.shape)} {out.dtype}, expected "
                                f"{(m.num_pages, *self.page_shape)} {self.dtype}")
        n_tree = len(m.nodes)
        with self._lock:
            self._read_tree(m.nodes, out[:n_tree])
        announced = m.num_pages - n_tree
        if announced:
            with self._staging_lock:  # the staging rows are reused: one L3 load at a time
                got, pages = self._read_l3(m.l3_keys, n_tree, self._staging_rows(len(m.l3_keys)))
                out[n_tree:n_tree + got].copy_(pages)
                if got < announced:
                    m._truncate(n_tree + got)
                if adopt:
                    self._adopt(m, pages)
        if not m.loaded:
            m.loaded = True
            self._count_l3_load(announced, m.num_pages - n_tree)
        return out[:m.num_pages]

    def release(self, m: Match) -> None:
        """Drop the lock references taken by :meth:`match` (once per match)."""
        with self._lock:
            if m.released:
                raise InvalidParams("match released twice")
            m.released = True
            if m.locked is not None:
                self.tree.unlock(m.locked)

    # -- insertion ------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int] | PageChain, pages: torch.Tensor) -> int:
        """Cache the first ``pages.shape[0]`` full pages of ``token_ids``.

        Args:
            token_ids: the whole sequence (its full pages are the keys), or its PageChain.
            pages: tensor [n, *page_shape] of this cache's dtype, n <= full pages.
        Returns: pages of the sequence now in the tree (the prefix that fit).
        Pages go to L1 (evicting least recently used unlocked pages), to L2 under
        write_through, and pages not known to be in L3 are queued for a backup that
        writes only those L3 lacks. Raises InvalidParams on a shape or dtype mismatch.
        """
        keys, toks = self._keys(token_ids, None)
        self._check_pages(pages, len(keys))
        n = pages.shape[0]
        with self._lock:
            nodes = self._extend(self.tree.root, keys[:n], toks[:n], pages, "L1", backed_up=False)
            job = self._backup_job(nodes)
        if job is not None:
            self._submit_backup(job)
        return len(nodes)

    def peek(self, token_ids: Sequence[int] | PageChain) -> int:
        """Pages of ``token_ids`` cached in L1/L2 now, without locking, touching or counting
        (for a router choosing the instance with the longest cached prefix)."""
        keys, toks = self._keys(token_ids, None)
        with self._lock:
            return len(self.tree.match(keys, toks)[0])

    @property
    def backup_queue_depth(self) -> int:
        """L3 backups (one per insert) queued or being written; 0 without a backup
        thread (no L3, synchronous backups, or closed)."""
        return self._backups.depth if self._backups is not None else 0

    def flush(self) -> None:
        """Wait until every L3 backup queued so far is written."""
        if self._backups is not None:
            self._backups.join()

    def close(self) -> None:
        """Finish queued backups, stop the background threads, unmap and remove L2."""
        for worker in (self._backups, self._prefetcher):
            if worker is not None:
                worker.close()
        self._backups = self._prefetcher = None
        if self.l2 is not None:
            self.l2.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- prefetch -------------------------------------------------------------------
    def prefetch(self, token_ids: Sequence[int] | PageChain, policy: str | None = None) -> PrefetchHandle:
        """Start loading the page-aligned tail of ``token_ids`` that the tree lacks from
        L3 into L2 (L1 without L2), in the background.

        The tail must be at least ``prefetch.threshold_tokens`` long, else the handle is
        finished at once with ``planned == 0`` and outcome "skipped". Pass the handle to
        :meth:`match` when the request is scheduled (or to :meth:`cancel_prefetch`).
        """
        cfg = self.prefetch_config
        policy = PrefetchConfig(policy=policy).policy if policy else cfg.policy
        keys, toks = self._keys(token_ids, None)
        with self._lock:
            nodes, _ = self.tree.match(keys, toks)
            tail = nodes[-1] if nodes else self.tree.root
            self.tree.lock(tail)
        h = PrefetchHandle(keys[len(nodes):], toks[len(nodes):], len(nodes), tail, policy)
        self.metrics.inc("prefetch_requests")
        if (self._prefetcher is None or len(h.keys) * self.page_size < cfg.threshold_tokens
                or not self._prefetcher.submit(h)):
            self.metrics.inc("prefetch_skipped")
            h.set_plan(0)
            h.finish("skipped")
        return h

    def cancel_prefetch(self, h: PrefetchHandle) -> None:
        """Stop ``h`` (pages landed stay cached) and drop its locks, without a match."""
        h.cancel()
        with self._lock:
            self._release_prefetch(h)

    # -- internals: tree and pools --------------------------------------------------
    def _keys(self, seq: Sequence[int] | PageChain, max_pages: int | None):
        """(page keys, page token bytes) of ``seq``: token ids or a PageChain."""
        chain = seq if isinstance(seq, PageChain) else page_chain(self.ns, seq)
        if chain.ns_digest != self._ns_digest:
            raise InvalidParams("page chain of another namespace")
        keys, toks = list(chain.keys), list(chain.tokens)
        if max_pages is not None:
            keys, toks = keys[:max(0, max_pages)], toks[:max(0, max_pages)]
        return keys, toks

    def _check_pages(self, pages: torch.Tensor, full_pages: int) -> None:
        if not isinstance(pages, torch.Tensor):
            raise InvalidParams("pages must be a torch.Tensor")
        if tuple(pages.shape[1:]) != self.page_shape or pages.dtype != self.dtype:
            raise InvalidParams(f"pages are {tuple(pages.shape)} {pages.dtype}, expected "
                                f"[n, *{self.page_shape}] {self.dtype}")
        if pages.shape[0] > full_pages:
            raise InvalidParams(f"{pages.shape[0]} pages given for {full_pages} full pages")

    def _extend(self, start: Node, keys: list[bytes], toks: list[bytes],
                pages: torch.Tensor, tier: str, backed_up: bool) -> list[Node]:
        """Make ``keys`` (a chain below ``start``) present in the tree; new pages go to
        ``tier`` (what L1 cannot take, to L2), and to L2 as well under write_through.

        ``pages[i]`` is the KV of ``keys[i]``. Slots are allocated before any node is
        added, with the existing path locked, so eviction never takes a page of this
        chain. Returns the chain's nodes (short when the tier is full of locked pages).
        Caller holds ``self._lock``.
        """
        nodes, collision = self.tree.match(keys, toks, start)
        if collision:
            self.metrics.inc("key_collisions")
            return nodes
        for node in nodes:
            self.tree.touch(node)
        tail = nodes[-1] if nodes else start
        self.tree.lock(tail)
        try:
            placed = self._place(tier, len(keys) - len(nodes))
            first = len(nodes)
            for where in ("L1", "L2"):
                idx = [i for i, (t, _) in enumerate(placed) if t == where]
                if idx:
                    # chain order puts each tier's pages in one run: a slice, no gather copy
                    lo = first + idx[0]
                    src = (pages[lo:lo + len(idx)] if idx[-1] - idx[0] + 1 == len(idx)
                           else pages[[first + i for i in idx]])
                    self._write(where, [placed[i][1] for i in idx], src)
            node = tail
            for i, (where, slot) in enumerate(placed, start=first):
                node = self.tree.add(node, keys[i], toks[i], where, slot)
                node.backed_up = backed_up
                nodes.append(node)
            if self.write_policy == "write_through" and self.l2 is not None and nodes:
                self.tree.lock(nodes[-1])
                self._copy_to_l2(nodes)
                self.tree.unlock(nodes[-1])
        finally:
            self.tree.unlock(tail)
        return nodes

    def _place(self, tier: str, n: int) -> list[tuple[str, int]]:
        """Up to ``n`` (tier, slot) places for new pages, in chain order: ``tier`` first;
        pages that L1 cannot take (full of locked pages) go to L2 when there is one."""
        placed = []
        for _ in range(n):
            slot = self._alloc(tier)
            if slot is None:
                self.metrics.inc(f"{tier.lower()}_full")
                break
            placed.append((tier, slot))
        if tier == "L1" and self.l2 is not None:
            for _ in range(n - len(placed)):
                slot = self._alloc("L2")
                if slot is None:
                    self.metrics.inc("l2_full")
                    break
                placed.append(("L2", slot))
        return placed

    def _alloc(self, tier: str) -> int | None:
        """A free slot of ``tier``, evicting least recently used unlocked pages if needed;
        None when no page can go (every page locked, or stuck: see :meth:`_evict`).

        A victim that cannot go is skipped for the rest of this allocation and queued
        again after it (K20): each turn of the loop either frees a slot or skips a node
        for good, so the loop ends, and never retries the same node while holding the lock.
        """
        pool = self.pool if tier == "L1" else self.l2
        slot = pool.alloc()
        stuck: set[Node] = set()
        while slot is None:
            victim = self.tree.pop_lru(tier, skip=stuck)
            if victim is None:
                break
            if not self._evict(victim, tier):
                stuck.add(victim)
            slot = pool.alloc()
        for node in stuck:
            self.tree.requeue(node)
        return slot

    def _evict(self, node: Node, tier: str) -> bool:
        """Drop ``tier``'s copy of ``node`` (write_back: copy an L1 page to L2 first).

        Returns False when the page cannot go now: under write_back, an L1 page that has
        children (all in L2 only) and finds no L2 slot (L2 full of locked pages, or of
        pages that its own children need) must stay in L1, or they would hang below a node
        that holds nothing.
        """
        if tier == "L1" and self.tree.write_back and node.l2 < 0:
            self.tree.lock(node)
            self._copy_to_l2([node])
            self.tree.unlock(node)
            if node.l2 < 0 and node.children:
                self.metrics.inc("evictions_stuck_l1")
                return False
        pool = self.pool if tier == "L1" else self.l2
        pool.free(self.tree.drop(node, tier))
        self.metrics.inc(f"evictions_{tier.lower()}")
        return True

    def _write(self, tier: str, slots: list[int], pages: torch.Tensor) -> None:
        if not slots:
            return
        if tier == "L1":
            index = torch.tensor(slots, device=self.pool.data.device)
            self.pool.data[index] = pages.to(self.pool.data.device)
        else:
            self.l2.write(slots, pages)

    def _copy_to_l2(self, nodes: list[Node]) -> None:
        """Copy the L1 pages of ``nodes`` that L2 lacks into L2 (stops when L2 is full).
        Caller holds ``self._lock`` and keeps ``nodes`` locked."""
        for node in nodes:
            if node.l2 >= 0 or node.l1 < 0:
                continue
            slot = self._alloc("L2")
            if slot is None:
                self.metrics.inc("l2_full")
                return
            self.l2.write([slot], self.pool.data[node.l1].unsqueeze(0))
            self.tree.set_slot(node, "L2", slot)
            self.metrics.inc("l2_writes")

    def _read_tree(self, nodes: list[Node], out: torch.Tensor) -> None:
        """Copy the KV of tree ``nodes`` into ``out``; L2-only pages are promoted to L1.
        Caller holds ``self._lock``."""
        for i, node in enumerate(nodes):
            if node.l1 >= 0:
                # page by page: one copy into any layout (a gather would copy twice)
                out[i].copy_(self.pool.data[node.l1])
        in_l2 = [i for i, n in enumerate(nodes) if n.l1 < 0]
        for i in in_l2:
            self.l2.read([nodes[i].l2], out[i:i + 1])
            slot = self._alloc("L1")
            if slot is not None:
                self.pool.data[slot].copy_(out[i])
                self.tree.set_slot(nodes[i], "L1", slot)
                self.metrics.inc("l2_promotions")

    def _reduce(self, m: Match, pages: int) -> None:
        """Cut ``m`` to ``pages`` (the cross-rank hit count). Caller holds the lock."""
        if pages >= m.num_pages:
            return
        if pages < len(m.nodes):
            m.nodes = m.nodes[:pages]
            new_lock = m.nodes[-1] if m.nodes else None
            if new_lock is not None:
                self.tree.lock(new_lock)
            self.tree.unlock(m.locked)
            m.locked = new_lock
        m._truncate(pages)

    def _adopt(self, m: Match, pages: torch.Tensor) -> None:
        """Put pages just read from L3 into the tree: they join ``m.nodes`` (so a second
        load reads them there) and ``m``'s lock moves to the new tail."""
        if not pages.shape[0]:
            return
        n = pages.shape[0]
        with self._lock:
            start = m.locked or self.tree.root
            added = self._extend(start, m.l3_keys[:n], m.l3_tokens[:n], pages, "L1",
                                 backed_up=True)
            if not added:
                return
            self.tree.lock(added[-1])
            if m.locked is not None:
                self.tree.unlock(m.locked)
            m.locked = added[-1]
            m.nodes = m.nodes + added
            m.l3_keys, m.l3_tokens = m.l3_keys[len(added):], m.l3_tokens[len(added):]

    # -- internals: L3 ----------------------------------------------------------------
    def _l3_present(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` L3 holds whole now (0 when L3 cannot answer)."""
        try:
            return self.store.present(keys)
        except KVPoolError:
            self.metrics.inc("l3_errors")
            return 0

    def _staging_rows(self, n: int) -> np.ndarray | None:
        """``n`` rows of the staging array that :meth:`load` reads L3 pages into (kept and
        grown to the largest load: fresh memory costs a page fault per 4 KiB on first
        touch, ~10 ms per 100 MB here); None when L3 pages are not read into buffers."""
        if not self._direct_l3:
            return None
        if self._staging.shape[0] < n:
            self._staging = None  # free the old rows first
            self._staging = np.empty((n, HEADER_SIZE + self.store.part_bytes), dtype=np.uint8)
        return self._staging[:n]

    def _read_l3(self, keys: list[bytes], first_index: int, raw: np.ndarray | None = None
                 ) -> tuple[int, torch.Tensor]:
        """Read and check L3 pages ``keys`` (page numbers from ``first_index``).

        Returns (how many leading pages are good, a tensor ``[good, *page_shape]`` of
        them). With a backend that reads into buffers and one object per page, the
        objects land in staging rows (``raw`` or new ones), header and payload
        together, are checked there, and the result is a view of their payloads: one
        copy out of the store.
        """
        try:
            if self._direct_l3:
                good, reason, nbytes, pages = self._read_l3_direct(keys, first_index, raw)
            else:
                pages = torch.empty((len(keys), *self.page_shape), dtype=self.dtype)
                result = self.store.read(keys, first_index, pages)
                good, reason, nbytes = result.good, result.reason, result.nbytes
        except KVPoolError:
            self.metrics.inc("l3_errors")
            return 0, torch.empty((0, *self.page_shape), dtype=self.dtype)
        if reason == "vanished":
            self.metrics.inc("l3_vanished")
        elif reason is not None:
            self.metrics.inc("page_rejects")
            self.metrics.inc(f"page_rejects_{reason}")
        self.metrics.inc("pages_loaded_l3", good)
        self.metrics.inc("bytes_loaded_l3", nbytes)
        return good, pages[:good]

    def _read_l3_direct(self, keys: list[bytes], first_index: int, raw: np.ndarray | None):
        """(good, reason, payload bytes, pages view) through ``PageStore.read_into``."""
        if raw is None:
            raw = np.empty((len(keys), HEADER_SIZE + self.store.part_bytes), dtype=np.uint8)
        result = self.store.read_into(keys, first_index, raw)
        # [n, header + payload] bytes -> [n, *page_shape] payloads: a view, rows strided
        pages = (torch.from_numpy(raw)[:, HEADER_SIZE:].view(self.dtype)
                 .view(len(keys), *self.page_shape))
        return result.good, result.reason, result.nbytes, pages

    def _backup_job(self, nodes: list[Node]) -> _Backup | None:
        """Lock the pages of ``nodes`` that need an L3 backup. Caller holds the lock."""
        if self.store is None:
            return None
        todo = [n for n in nodes if not n.backed_up and not n.backup_pending]
        if not todo:
            return None
        for node in todo:
            node.backup_pending = True
        self.tree.lock(todo[-1])  # a chain: locking the deepest locks them all
        return _Backup(todo, todo[-1])

    def _submit_backup(self, job: _Backup) -> None:
        if self._backups is None:
            self._run_backup(job)
        elif not self._backups.submit(job):
            self.metrics.inc("backup_dropped", len(job.nodes))
            self._end_backup(job, [False] * len(job.nodes))

    def _run_backup(self, job: _Backup) -> None:
        """Write the pages of ``job`` that L3 lacks (runs on the backup thread)."""
        stored = [False] * len(job.nodes)
        try:
            with self._lock:
                pages = self._gather(job.nodes)
            keys = [n.key for n in job.nodes]
            missing = self.store.missing(keys)
            todo = [j for j, miss in enumerate(missing) if miss]
            self.metrics.inc("pages_dedup_l3", len(keys) - len(todo))
            ok, nbytes = self.store.write([keys[j] for j in todo],
                                          [job.nodes[j].index for j in todo],
                                          [pages[j] for j in todo])
            stored = [not miss for miss in missing]
            for j, good in zip(todo, ok):
                stored[j] = good
            self.metrics.inc("pages_written_l3", sum(ok))
            self.metrics.inc("bytes_written_l3", nbytes)
        except KVPoolError:
            self.metrics.inc("l3_errors")
        finally:
            self._end_backup(job, stored)

    def _end_backup(self, job: _Backup, stored: list[bool]) -> None:
        with self._lock:
            for node, ok in zip(job.nodes, stored):
                node.backed_up = ok
                node.backup_pending = False
            self.tree.unlock(job.tail)

    def _gather(self, nodes: list[Node]) -> torch.Tensor:
        """A CPU copy of the pages of ``nodes`` (from L2 when held there, else L1)."""
        out = torch.empty((len(nodes), *self.page_shape), dtype=self.dtype)
        for i, node in enumerate(nodes):
            if node.l2 >= 0:
                self.l2.read([node.l2], out[i:i + 1])
            else:
                out[i].copy_(self.pool.data[node.l1])
        return out

    # -- internals: prefetch ----------------------------------------------------------
    def _run_prefetch(self, h: PrefetchHandle) -> None:
        """Plan, then land ``h``'s pages batch by batch (runs on the prefetch thread)."""
        if not h.claim():
            return
        outcome = "failed"
        try:
            # per rank: the cross-rank minimum is taken by the match that uses these pages
            # (a collective from this thread could interleave with the engine thread's)
            planned = self.store.present(h.keys)
            self.metrics.inc("prefetch_pages_planned", planned)
            h.set_plan(planned)
            outcome = self._land(h, planned)
        except KVPoolError:
            self.metrics.inc("l3_errors")
            if h.planned is None:
                h.set_plan(0)
        finally:
            self.metrics.inc(f"prefetch_{outcome}")
            h.finish(outcome)

    def _land(self, h: PrefetchHandle, planned: int) -> str:
        """Read planned pages in batches into the tree; returns the outcome."""
        tier = "L2" if self.l2 is not None else "L1"
        batch = self.prefetch_config.batch_pages
        while h.landed < planned:
            if h.cancelled():
                return "cancelled"
            lo, hi = h.landed, min(planned, h.landed + batch)
            good, buf = self._read_l3(h.keys[lo:hi], h.first_index + lo)
            with self._lock:
                if h.cancelled():  # scheduled meanwhile: its locks may be gone already
                    return "cancelled"
                added = self._extend(h.tail, h.keys[lo:lo + good], h.tokens[lo:lo + good],
                                     buf[:good], tier, backed_up=True)
                if added:
                    self.tree.lock(added[-1])
                    self.tree.unlock(h.tail)
                    h.tail = added[-1]
                h.landed += len(added)
            self.metrics.inc("prefetch_pages_landed", len(added))
            if len(added) < hi - lo:
                return "failed"
        return "complete"

    def _end_prefetch(self, h: PrefetchHandle) -> None:
        """Stop ``h`` as its policy says when its request is scheduled."""
        if h.policy == "wait_complete":
            h.wait()
        elif h.policy == "timeout":
            tokens = (h.planned if h.planned is not None else len(h.keys)) * self.page_size
            budget = self.prefetch_config.timeout_s(tokens)
            h.wait(max(0.0, h.started + budget - time.monotonic()))
        # No wait after cancel: a batch still in flight is dropped when it arrives
        # (the prefetch thread checks under the lock), so scheduling never blocks on it.
        h.cancel()

    def _release_prefetch(self, h: PrefetchHandle) -> None:
        if h.tail is not None:
            self.tree.unlock(h.tail)
            h.tail = None

    def _count_match(self, num_tokens: int, m: Match) -> None:
        """Count a match: its tree pages are hits now (locked until released, so load
        serves every one of them); its L3 pages are only announced, counted as hits by
        :meth:`_count_l3_load` once their bytes landed and passed their check (K21)."""
        self.metrics.inc("lookups")
        self.metrics.inc("lookup_tokens", num_tokens)
        for tier, tokens in m.tokens_by_tier().items():
            name = "announced_tokens_l3" if tier == "L3" else f"hit_tokens_{tier.lower()}"
            self.metrics.inc(name, tokens)

    def _count_l3_load(self, announced: int, got: int) -> None:
        """Count the L3 part of a match's first load: ``got`` of ``announced`` pages."""
        if got:
            self.metrics.inc("hit_tokens_l3", got * self.page_size)
        if announced > got:
            self.metrics.inc("lost_tokens_l3", (announced - got) * self.page_size)
