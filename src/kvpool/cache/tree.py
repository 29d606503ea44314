"""Radix tree over pages: which prefixes are cached, in which tier, and who uses them.

One node per full page. Children are keyed by the page's chain key; since the key
already stands for the whole prefix, a walk from the root is a prefix match. Each node
also keeps the page's token ids (uint32-LE bytes) and the walk compares them, so a key
collision can never become a wrong hit (nano-vllm's check).

A node's KV lives in L1 (device pool slot ``l1``), L2 (host pool slot ``l2``) or both;
a node with neither is removed, so every node in the tree is loadable. L3 is not tracked
here (it is asked live). Locks follow SGLang's radix cache: locking a node adds one to
the lock count of it and every ancestor, so a locked node's whole prefix stays.

Eviction is per tier, least recently used first, through a lazy min-heap: entries are
``(last_access, seq, node)`` pushed whenever a node may have become evictable; a popped
entry is used only if it is still current and the node is still evictable.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Collection, Iterator, Sequence


class Tier(enum.StrEnum):
    """Where a page is held: L1 (device pool), L2 (host shared memory), L3 (store/disk).

    A StrEnum: ``Tier.L1 == "L1"``, and it formats as "L1", so metric labels, JSON and
    ``Match.tiers`` compare equal to the plain names callers already use.
    """

    L1 = "L1"
    L2 = "L2"
    L3 = "L3"


TIERS = (Tier.L1, Tier.L2)  # the tiers a tree node can hold a slot in
NO_SLOT = -1                # Node.l1 / Node.l2 when the page is not held in that tier


class Node:
    """One cached page. ``l1``/``l2`` are pool slots (NO_SLOT when absent)."""

    __slots__ = ("key", "tokens", "parent", "index", "children", "l1", "l2", "lock_ref",
                 "last_access", "hits", "backed_up", "backup_pending", "alive")

    def __init__(self, key: bytes, tokens: bytes, parent: Node | None):
        self.key = key
        self.tokens = tokens
        self.parent = parent
        self.index = parent.index + 1 if parent is not None else -1  # page number
        self.children: dict[bytes, Node] = {}
        self.l1 = NO_SLOT
        self.l2 = NO_SLOT
        self.lock_ref = 0
        self.last_access = 0
        self.hits = 0            # times this page was matched (write_through_selective)
        self.backed_up = False   # known to be in L3: no need to ask or write again
        self.backup_pending = False  # queued for the L3 writer
        self.alive = True

    def slot(self, tier: Tier) -> int:
        return self.l1 if tier == Tier.L1 else self.l2

    def holds(self, tier: Tier) -> bool:
        return self.slot(tier) != NO_SLOT

    def __repr__(self) -> str:
        return f"Node({self.key.hex()[:8]}, l1={self.l1}, l2={self.l2}, lock={self.lock_ref})"


class RadixTree:
    """Pages of one namespace, with per-tier LRU eviction of unlocked nodes.

    ``write_back``: L1 eviction copies a page to L2 first, so a node may give up L1 even
    when it has no L2 copy yet and still has children.
    """

    def __init__(self, write_back: bool = False):
        self.write_back = write_back
        self.root = Node(b"", b"", None)
        self.root.lock_ref = 1  # the root is never evicted
        self.num_nodes = 0
        self._clock = itertools.count(1)
        self._seq = itertools.count()
        self._heaps: dict[Tier, list] = {t: [] for t in TIERS}

    def match(self, keys: Sequence[bytes], tokens: Sequence[bytes],
              start: Node | None = None) -> tuple[list[Node], bool]:
        """Walk the longest cached prefix of ``keys`` below ``start`` (default: the root).

        Returns ``(nodes, collision)``: the matched nodes in page order, and whether the
        walk stopped at a node whose key matched but whose token ids did not.
        """
        nodes, node = [], start or self.root
        for key, toks in zip(keys, tokens):
            child = node.children.get(key)
            if child is None:
                return nodes, False
            if child.tokens != toks:
                return nodes, True
            nodes.append(child)
            node = child
        return nodes, False

    def add(self, parent: Node, key: bytes, tokens: bytes, tier: Tier, slot: int) -> Node:
        """Add the child page ``key`` under ``parent`` holding ``slot`` of ``tier``."""
        assert key not in parent.children, "page already in the tree"
        assert parent is self.root or parent.alive
        node = Node(key, tokens, parent)
        self._set(node, tier, slot)
        parent.children[key] = node
        self.num_nodes += 1
        self.touch(node)
        self._changed(parent)
        return node

    def set_slot(self, node: Node, tier: Tier, slot: int) -> None:
        """Record that ``node``'s KV now also lives in ``slot`` of ``tier``."""
        assert not node.holds(tier), f"{node} already holds {tier}"
        self._set(node, tier, slot)
        self._changed(node)

    def drop(self, node: Node, tier: Tier) -> int:
        """Forget ``node``'s copy in ``tier`` and return its slot; a node left with no
        copy is removed from the tree (it must then have no children)."""
        slot = node.slot(tier)
        assert slot >= 0 and node.lock_ref == 0, f"cannot drop {tier} of {node}"
        self._set(node, tier, NO_SLOT)
        if node.l1 < 0 and node.l2 < 0:
            assert not node.children, "a node without KV cannot keep children"
            del node.parent.children[node.key]
            node.alive = False
            self.num_nodes -= 1
        self._changed(node.parent)
        self._changed(node)
        return slot

    def touch(self, node: Node) -> None:
        """Mark ``node`` as used now (LRU order)."""
        node.last_access = next(self._clock)
        self._changed(node)

    def lock(self, node: Node) -> None:
        """Protect ``node`` and all its ancestors from eviction (counted)."""
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Undo one :meth:`lock` of ``node``."""
        while node is not None:
            assert node.lock_ref > 0, f"unlock of unlocked {node}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._changed(node)
            node = node.parent

    def evictable(self, node: Node, tier: Tier) -> bool:
        """Whether ``tier``'s copy of ``node`` may go: it is held, unlocked, no child
        holds that tier, and the node keeps another copy or has no children."""
        if not node.alive or node.lock_ref:
            return False
        # Hot path (every touch and every eviction): plain fields, no helper calls.
        if tier == Tier.L1:
            if node.l1 < 0:
                return False
            for child in node.children.values():
                if child.l1 >= 0:
                    return False
            return self.write_back or node.l2 >= 0 or not node.children
        if node.l2 < 0:
            return False
        for child in node.children.values():
            if child.l2 >= 0:
                return False
        return node.l1 >= 0 or not node.children

    def pop_lru(self, tier: Tier, skip: Collection[Node] = ()) -> Node | None:
        """The least recently used node evictable from ``tier`` and not in ``skip``, or
        None when there is none. Entries of ``skip`` nodes are dropped: give them back
        with :meth:`requeue` once they may be tried again."""
        heap = self._heaps[tier]
        while heap:
            stamp, _, node = heapq.heappop(heap)
            if stamp == node.last_access and node not in skip and self.evictable(node, tier):
                return node
        return None

    def requeue(self, node: Node) -> None:
        """Offer ``node`` for eviction again in each tier it may be evicted from (after a
        :meth:`pop_lru` that skipped it), keeping its place in the LRU order."""
        self._changed(node)

    def nodes(self) -> Iterator[Node]:
        """Every node except the root (depth first)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _set(self, node: Node, tier: Tier, slot: int) -> None:
        if tier == Tier.L1:
            node.l1 = slot
        else:
            node.l2 = slot

    def _changed(self, node: Node | None) -> None:
        """Queue ``node`` for eviction in each tier it may now be evicted from."""
        if node is None or node is self.root or not node.alive or node.lock_ref:
            return
        for tier in TIERS:
            if node.slot(tier) >= 0 and self.evictable(node, tier):
                heap = self._heaps[tier]
                heapq.heappush(heap, (node.last_access, next(self._seq), node))
                if len(heap) > 4 * self.num_nodes + 1024:
                    self._rebuild(tier)

    def _rebuild(self, tier: Tier) -> None:
        """Drop stale heap entries (bounded memory under many touches)."""
        heap = [(n.last_access, next(self._seq), n) for n in self.nodes()
                if self.evictable(n, tier)]
        heapq.heapify(heap)
        self._heaps[tier] = heap
