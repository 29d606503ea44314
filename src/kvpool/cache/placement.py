"""Placement of pages in the tree tiers L1 (device pool) and L2 (host pool).

Where a new page goes, which page is evicted to make room (least recently used and
unlocked first; under write_back an L1 victim is copied to L2 first), copies between
the tiers, and reading tree pages out. Every method expects the caller to hold the
cache's lock: this class has no lock of its own for the tree (its copier's lock only
keeps one copy at a time).
"""

from __future__ import annotations

import torch

from kvpool.cache.host_pool import HostPool
from kvpool.cache.metrics import CacheMetrics
from kvpool.cache.pool import PagePool
from kvpool.cache.prefetch import PrefetchHandle
from kvpool.cache.tree import Node, RadixTree, Tier
from kvpool.cache.viewcopy import CheckedCopier, PageCopy, chunk_pages


class Placement:
    """The radix tree with its L1 pool and optional L2 pool.

    Args:
        pool: the L1 pool.
        l2: the L2 host pool, or None.
        write_policy: "write_through", "write_through_selective" or "write_back".
        metrics: counters (l1_full, l2_full, l2_writes, l2_promotions, evictions_*,
            key_collisions).
    """

    def __init__(self, pool: PagePool, l2: HostPool | None, write_policy: str,
                 metrics: CacheMetrics):
        self.pool, self.l2 = pool, l2
        self.write_policy = write_policy
        self.metrics = metrics
        self.tree = RadixTree(write_back=l2 is not None and write_policy == "write_back")
        self.copier = CheckedCopier()  # L1 pages out to a caller's layout (no checksum: our memory)
        self._copy_pages = chunk_pages(pool.page_bytes)

    def close(self) -> None:
        """Stop the copier's helper thread."""
        self.copier.close()

    def extend(self, start: Node, keys: list[bytes], toks: list[bytes], pages: torch.Tensor,
               tier: Tier, backed_up: bool) -> list[Node]:
        """Make ``keys`` (a chain below ``start``) present in the tree; new pages go to
        ``tier`` (what L1 cannot take, to L2), and to L2 as well under write_through.

        ``pages[i]`` is the KV of ``keys[i]``. Slots are allocated before any node is
        added, with the existing path locked, so eviction never takes a page of this
        chain. Returns the chain's nodes (short when the tier is full of locked pages).
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
            for where in (Tier.L1, Tier.L2):
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
                self.copy_to_l2(nodes)
                self.tree.unlock(nodes[-1])
        finally:
            self.tree.unlock(tail)
        return nodes

    def extend_held(self, held: Node | None, keys: list[bytes], toks: list[bytes],
                    pages: torch.Tensor, tier: Tier) -> list[Node]:
        """:meth:`extend` below ``held`` (a node its caller holds locked; None: the root)
        with pages just read from L3, and move that lock to the chain's new tail.
        Returns the chain's nodes; the caller holds ``nodes[-1]`` from now on when there
        are any (and still ``held`` when there are none)."""
        nodes = self.extend(held or self.tree.root, keys, toks, pages, tier, backed_up=True)
        if nodes:
            self.tree.lock(nodes[-1])
            if held is not None:
                self.tree.unlock(held)
        return nodes

    def land(self, h: PrefetchHandle, lo: int, pages: torch.Tensor) -> int:
        """Put prefetched pages ``h.keys[lo:lo + len(pages)]`` into the tree below
        ``h.tail`` (in L2, or L1 without L2); ``h`` then holds the new tail. Returns the
        pages the tree took."""
        tier = Tier.L2 if self.l2 is not None else Tier.L1
        hi = lo + pages.shape[0]
        added = self.extend_held(h.tail, h.keys[lo:hi], h.tokens[lo:hi], pages, tier)
        h.tail = added[-1] if added else h.tail
        h.landed += len(added)
        return len(added)

    def _place(self, tier: Tier, n: int) -> list[tuple[Tier, int]]:
        """Up to ``n`` (tier, slot) places for new pages, in chain order: ``tier`` first;
        pages that L1 cannot take (full of locked pages) go to L2 when there is one."""
        placed = []
        for _ in range(n):
            slot = self.alloc(tier)
            if slot is None:
                self.metrics.inc(f"{tier.lower()}_full")
                break
            placed.append((tier, slot))
        if tier == Tier.L1 and self.l2 is not None:
            for _ in range(n - len(placed)):
                slot = self.alloc(Tier.L2)
                if slot is None:
                    self.metrics.inc("l2_full")
                    break
                placed.append((Tier.L2, slot))
        return placed

    def _pool(self, tier: Tier) -> PagePool | HostPool:
        return self.pool if tier == Tier.L1 else self.l2

    def alloc(self, tier: Tier) -> int | None:
        """A free slot of ``tier``, evicting least recently used unlocked pages if needed;
        None when no page can go (every page locked, or stuck: see :meth:`_evict`).

        A victim that cannot go is skipped for the rest of this allocation and queued
        again after it (K20): each turn of the loop either frees a slot or skips a node
        for good, so the loop ends, and never retries the same node while holding the lock.
        """
        pool = self._pool(tier)
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

    def _evict(self, node: Node, tier: Tier) -> bool:
        """Drop ``tier``'s copy of ``node`` (write_back: copy an L1 page to L2 first).

        Returns False when the page cannot go now: under write_back, an L1 page that has
        children (all in L2 only) and finds no L2 slot (L2 full of locked pages, or of
        pages that its own children need) must stay in L1, or they would hang below a node
        that holds nothing.
        """
        if tier == Tier.L1 and self.tree.write_back and not node.holds(Tier.L2):
            self.tree.lock(node)
            self.copy_to_l2([node])
            self.tree.unlock(node)
            if not node.holds(Tier.L2) and node.children:
                self.metrics.inc("evictions_stuck_l1")
                return False
        self._pool(tier).free(self.tree.drop(node, tier))
        self.metrics.inc(f"evictions_{tier.lower()}")
        return True

    def _write(self, tier: Tier, slots: list[int], pages: torch.Tensor) -> None:
        if tier == Tier.L1:
            index = torch.tensor(slots, device=self.pool.data.device)
            self.pool.data[index] = pages.to(self.pool.data.device)
        else:
            self.l2.write(slots, pages)

    def copy_to_l2(self, nodes: list[Node]) -> None:
        """Copy the L1 pages of ``nodes`` that L2 lacks into L2 (stops when L2 is full).
        The caller keeps ``nodes`` locked."""
        for node in nodes:
            if node.holds(Tier.L2) or not node.holds(Tier.L1):
                continue
            slot = self.alloc(Tier.L2)
            if slot is None:
                self.metrics.inc("l2_full")
                return
            self.l2.write([slot], self.pool.data[node.l1].unsqueeze(0))
            self.tree.set_slot(node, Tier.L2, slot)
            self.metrics.inc("l2_writes")

    def read(self, nodes: list[Node], out: torch.Tensor) -> None:
        """Copy the KV of tree ``nodes`` into ``out``; L2-only pages are promoted to L1."""
        held = [i for i, node in enumerate(nodes) if node.holds(Tier.L1)]
        data = self.pool.data
        if data.device.type == out.device.type == "cpu":
            # page by page (one copy into any layout: a gather would copy twice), on two
            # threads: the demo's 138 L1 pages into the engine's layout 12.6-15.2 -> 8.7-9.3 ms
            self.copier.copy(len(held), lambda j: PageCopy(
                [out[held[j]]], [data[nodes[held[j]].l1]], (), ()), self._copy_pages)
        else:
            for i in held:
                out[i].copy_(data[nodes[i].l1])
        for i, node in enumerate(nodes):
            if node.holds(Tier.L1):
                continue
            self.l2.read([node.l2], out[i:i + 1])
            slot = self.alloc(Tier.L1)
            if slot is not None:
                self.pool.data[slot].copy_(out[i])
                self.tree.set_slot(node, Tier.L1, slot)
                self.metrics.inc("l2_promotions")

    def gather(self, nodes: list[Node]) -> torch.Tensor:
        """A CPU copy of the pages of ``nodes`` (from L2 when held there, else L1)."""
        out = torch.empty((len(nodes), *self.pool.page_shape), dtype=self.pool.data.dtype)
        for i, node in enumerate(nodes):
            if node.holds(Tier.L2):
                self.l2.read([node.l2], out[i:i + 1])
            else:
                out[i].copy_(self.pool.data[node.l1])
        return out
