"""The tiered prefix cache: find cached pages of a prompt, load them, add new ones.

Flow (SGLang HiCache's model):

    h = cache.prefetch(tokens)             # optional, at arrival: L3 -> L2 in the background
    m = cache.match(tokens, prefetch=h)    # tree (L1/L2), then L3 asked live for the rest
    kv = cache.load(m)                     # [m.num_pages, *page_shape]; L3 pages checked
    ...prefill the tokens after m.num_tokens...
    cache.release(m)                       # the matched pages may be evicted again
    cache.insert(tokens, kv_pages)         # L1 (+ L2 by the write policy), L3 backup queued

A stored page that fails its header check (namespace, key, index, length, checksum,
version) is never used: the match is cut at that page and the reason counted. Pages that
a match, a queued backup or a prefetch holds are locked: no tier evicts them.

This module orchestrates; the parts live below it: ``placement`` (L1/L2 slots and
eviction in the radix tree), ``l3_tier`` (what L3 holds, checked reads, backups,
prefetch reads), ``match`` (the Match record).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from kvpool.cache.host_pool import HostPool
from kvpool.cache.keys import PageChain, page_chain
from kvpool.cache.l3 import L3Backend
from kvpool.cache.l3_tier import Backup, L3Tier
from kvpool.cache.match import Match
from kvpool.cache.metrics import CacheMetrics
from kvpool.cache.namespace import Namespace
from kvpool.cache.placement import Placement
from kvpool.cache.policies import SELECTIVE_HITS, PrefetchConfig, check_write_policy
from kvpool.cache.pool import PagePool
from kvpool.cache.prefetch import PrefetchHandle
from kvpool.cache.tree import Node, Tier
from kvpool.errors import InvalidParams

__all__ = ["Match", "PrefixCache"]


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
        self.metrics = CacheMetrics()
        pool = PagePool(l1_pages, tuple(page_shape), dtype, device)
        l2 = HostPool(l2_pages, pool.page_shape, dtype, l2_layout) if l2_pages else None
        self.placement = Placement(pool, l2, self.write_policy, self.metrics)
        self.pool, self.l2, self.tree = pool, l2, self.placement.tree
        self.l3 = l3
        self.l3_tier = (L3Tier(l3, ns, pool.page_shape, dtype, self.metrics, async_backup,
                               backup_queue, self.prefetch_config.batch_pages,
                               land=self._land_prefetch)
                        if l3 is not None else None)
        self._ns_digest = ns.digest()
        self._lock = threading.RLock()

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
            prefetch.stop(self.prefetch_config, self.page_size)
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
        if self.l3_tier is not None and not collision and len(nodes) < len(keys):
            try:
                n_l3 = self.l3_tier.present(keys[len(nodes):])
            except BaseException:  # a bug below (not a miss): leave no page locked
                with self._lock:
                    if locked is not None:
                        self.tree.unlock(locked)
                raise
        m = Match(len(nodes) + n_l3, self.page_size, [], nodes,
                  keys[len(nodes):len(nodes) + n_l3], toks[len(nodes):len(nodes) + n_l3], locked)
        # a collective across ranks: called without the lock, the match's pages stay locked
        agreed = self.reduce_hits(m.num_pages) if self.reduce_hits is not None else m.num_pages
        with self._lock:
            self._reduce(m, agreed)
            m.tiers = ([Tier.L1 if n.holds(Tier.L1) else Tier.L2 for n in m.nodes]
                       + [Tier.L3] * len(m.l3_keys))
            if self.write_policy == "write_through_selective" and self.l2 is not None:
                self.placement.copy_to_l2([n for n in m.nodes if n.hits >= SELECTIVE_HITS])
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
        instead of a new tensor (each page copied once into it); the result is then
        ``out[:m.num_pages]``. The first load of a match counts its L3 part: ``hit_tokens_l3`` for the pages
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
            self.placement.read(m.nodes, out[:n_tree])
        announced = m.num_pages - n_tree
        if announced:
            got = self.l3_tier.read_into(m.l3_keys, n_tree, out[n_tree:])
            if got < announced:
                m.truncate(n_tree + got)
            if adopt:
                self._adopt(m, out[n_tree:n_tree + got])
        if not m.loaded:
            m.loaded = True
            if announced:
                self.l3_tier.count_load(announced, m.num_pages - n_tree)
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
            nodes = self.placement.extend(self.tree.root, keys[:n], toks[:n], pages, Tier.L1,
                                          backed_up=False)
            job = self._backup_job(nodes)
        if job is not None:
            self.l3_tier.backup(job)
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
        return self.l3_tier.backup_queue_depth if self.l3_tier is not None else 0

    def reserve(self, pages: int) -> None:
        """Make the first L3 read of up to ``pages`` pages land in memory touched now
        (:meth:`L3Tier.reserve`); nothing without L3."""
        if self.l3_tier is not None:
            self.l3_tier.reserve(pages)

    def flush(self) -> None:
        """Wait until every L3 backup queued so far is written."""
        if self.l3_tier is not None:
            self.l3_tier.flush()

    def close(self) -> None:
        """Finish queued backups, stop the background threads, unmap and remove L2."""
        if self.l3_tier is not None:
            self.l3_tier.close()
        if self.l2 is not None:
            self.l2.close()
        self.placement.close()

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
        if (self.l3_tier is None or len(h.keys) * self.page_size < cfg.threshold_tokens
                or not self.l3_tier.prefetch(h)):
            self.metrics.inc("prefetch_skipped")
            h.set_plan(0)
            h.finish("skipped")
        return h

    def cancel_prefetch(self, h: PrefetchHandle) -> None:
        """Stop ``h`` (pages landed stay cached) and drop its locks, without a match."""
        h.cancel()
        with self._lock:
            self._release_prefetch(h)

    def _land_prefetch(self, h: PrefetchHandle, lo: int, pages: torch.Tensor) -> int | None:
        """Land a prefetched batch (the L3 tier's callback, on its prefetch thread); None
        when ``h`` was cancelled meanwhile (scheduled: its locks may be gone already)."""
        with self._lock:
            return None if h.cancelled() else self.placement.land(h, lo, pages)

    def _release_prefetch(self, h: PrefetchHandle) -> None:
        if h.tail is not None:
            self.tree.unlock(h.tail)
            h.tail = None

    # -- internals --------------------------------------------------------------------
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

    def _reduce(self, m: Match, pages: int) -> None:
        """Cut ``m`` to ``pages`` (the cross-rank hit count). Caller holds the lock."""
        if pages >= m.num_pages:
            return
        if pages < len(m.nodes):
            m.nodes = m.nodes[:pages]
            new_lock = m.nodes[-1] if m.nodes else None
            if new_lock is not None:
                self.tree.lock(new_lock)  # first: the shared path stays held
            self.tree.unlock(m.locked)
            m.locked = new_lock
        m.truncate(pages)

    def _adopt(self, m: Match, pages: torch.Tensor) -> None:
        """Put pages just read from L3 into the tree: they join ``m.nodes`` (so a second
        load reads them there) and ``m``'s lock moves to the new tail."""
        if not pages.shape[0]:
            return
        n = pages.shape[0]
        with self._lock:
            added = self.placement.extend_held(m.locked, m.l3_keys[:n], m.l3_tokens[:n], pages,
                                               Tier.L1)
            if not added:
                return
            m.locked = added[-1]
            m.nodes = m.nodes + added
            m.l3_keys, m.l3_tokens = m.l3_keys[len(added):], m.l3_tokens[len(added):]

    def _backup_job(self, nodes: list[Node]) -> Backup | None:
        """Lock the pages of ``nodes`` that need an L3 backup. Caller holds the lock."""
        if self.l3_tier is None:
            return None
        todo = [n for n in nodes if not n.backed_up and not n.backup_pending]
        if not todo:
            return None
        for node in todo:
            node.backup_pending = True
        tail = todo[-1]
        self.tree.lock(tail)  # a chain: locking the deepest locks them all

        def gather() -> torch.Tensor:
            with self._lock:
                return self.placement.gather(todo)

        def done(stored: list[bool]) -> None:
            with self._lock:
                for node, ok in zip(todo, stored):
                    node.backed_up = ok
                    node.backup_pending = False
                self.tree.unlock(tail)

        return Backup([n.key for n in todo], [n.index for n in todo], gather, done)

    def _count_match(self, num_tokens: int, m: Match) -> None:
        """Count a match: its tree pages are hits now (locked until released, so load
        serves every one of them); its L3 pages are only announced, counted as hits by
        the L3 tier once their bytes landed and passed their check (K21)."""
        self.metrics.inc("lookups")
        self.metrics.inc("lookup_tokens", num_tokens)
        for tier, tokens in m.tokens_by_tier().items():
            if tier == Tier.L3:
                self.l3_tier.count_announced(tokens // self.page_size)
            else:
                self.metrics.inc(f"hit_tokens_{tier.lower()}", tokens)
