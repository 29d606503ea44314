"""Stateful property test of the tiered prefix cache on tiny tiers (K20, K21).

Hypothesis drives insert / match (held: its pages stay locked) / load / release / lookup /
prefetch (then scheduled by a match, or cancelled) / eviction pressure / loss of an L3
page, on a real PrefixCache with L1 of 1-4 pages, L2 of 0-3 pages (every layout), an
optional L3 on a real DiskBackend in a temporary folder with a budget of a few pages, under
each write policy. Every operation runs on a worker thread with a deadline (a livelock
fails the test instead of hanging it). After every step the tree's invariants hold:

- structure: every node is alive, its parent's child under its key, one page deeper than
  its parent; ``tree.num_nodes`` counts the nodes;
- slots: each node holds a valid slot of L1 and/or L2 (a node with neither is gone), no
  two nodes share a slot of a tier, and the slots held are exactly the slots the pool
  does not list as free (no leak, no double use);
- locks: ``lock_ref`` minus the children's lock counts is the number of direct locks, and
  it equals what the test holds: one per held match's tail and per pending prefetch's tail
  (plus one on the root); nothing is locked once everything is released;
- LRU: every page a tier may evict has a current entry in that tier's heap (else it could
  never be evicted and inserts would fail with pages free for the taking);
- content: the bytes in every slot are the bytes inserted for that node's token prefix;
- counters (K21): L3 tokens hit plus lost never exceed those announced.

Each load and lookup also checks that the pages returned are the bytes inserted for
their token prefix, only of prefixes ever inserted, and that its L3 hits and losses
moved the counters by exactly what it returned and cut.

Page bytes are a function of the token prefix (as real KV is), so every insert of a
prefix stores the same bytes and any page served can be checked. Runs derandomized (a
fixed example sequence, no example database) for CI stability.
"""

from __future__ import annotations

import shutil
import tempfile
import zlib
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from cache_helpers import within
from kvpool.cache import DiskBackend, Namespace, PrefetchConfig, PrefixCache, store_key
from kvpool.cache.codec import HEADER_SIZE
from kvpool.cache.host_pool import LAYOUTS
from kvpool.cache.policies import WRITE_POLICIES

PAGE = 2
SHAPE = (1, 2, 1, PAGE, 2)  # L, K/V, H, P, D
PAGE_BYTES = 1 * 2 * 1 * PAGE * 2 * 4
NS = Namespace(model="stateful", page_size=PAGE)
DEADLINE_S = 10  # each operation takes milliseconds; this only bounds a livelock
# examples per write policy: write_back, where a page must find room in L2 to leave L1,
# gets more (the K20 livelock needs a rare state; without the fix these find it)
MAX_EXAMPLES = {"write_through": 80, "write_through_selective": 80, "write_back": 200}
STEPS = 50

# prompts of 1-4 pages over 2 page "letters" (30 distinct chains, sharing prefixes); half
# of them along one chain, so that deep chains form and split across tiers
# swarm testing (Groce et al., ISSTA 2012): each example leaves out some kinds of operation,
# so that the rest run often enough to build rare states (a chain split L1 / L2 / L1)
SWARM = ("serve", "lookup", "hold", "prefetch", "evict", "lose")
PROMPTS = st.one_of(st.integers(1, 4).map(lambda n: (0,) * n),
                    st.lists(st.integers(0, 1), min_size=1, max_size=4).map(tuple))


def page_tokens(letter: int) -> list[int]:
    return [10 * letter + t for t in range(PAGE)]


def prompt_tokens(prompt: tuple[int, ...]) -> list[int]:
    return [t for letter in prompt for t in page_tokens(letter)]


def page_kv(prefix: tuple[int, ...]) -> torch.Tensor:
    """The KV page of the last page of ``prefix`` (a function of the whole prefix)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(prefix).encode()))
    return torch.randn(SHAPE, generator=g)


def prompt_kv(prompt: tuple[int, ...]) -> torch.Tensor:
    return torch.stack([page_kv(prompt[:i + 1]) for i in range(len(prompt))])


def node_prefix(cache: PrefixCache, node) -> tuple[int, ...]:
    """The page letters from the root down to ``node`` (from each node's token bytes)."""
    letters = []
    while node is not cache.tree.root:
        letters.append(int.from_bytes(node.tokens[:4], "little") // 10)
        node = node.parent
    return tuple(reversed(letters))


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None
        self.l3_dir = None
        self.held: list[tuple[tuple[int, ...], object]] = []        # (prompt, Match)
        self.prefetches: list[tuple[tuple[int, ...], object]] = []  # (prompt, handle)
        self.inserted: set[tuple[int, ...]] = set()
        self.off: set[str] = set()  # operation kinds left out of this example (swarm)

    policy = "write_through"  # set per test

    @initialize(l1=st.sampled_from([1, 2, 3, 4]), l2=st.sampled_from([0, 1, 2, 3]),
                layout=st.sampled_from(LAYOUTS), l3_pages=st.sampled_from([0, 3, 6]),
                batch=st.integers(1, 2), off=st.sets(st.sampled_from(SWARM)))
    def start(self, l1, l2, layout, l3_pages, batch, off):
        self.off = off
        l3 = None
        if l3_pages:
            self.l3_dir = tempfile.mkdtemp(prefix="kvpool-stateful-")
            l3 = DiskBackend(self.l3_dir, max_bytes=l3_pages * (HEADER_SIZE + PAGE_BYTES))
        self.cache = PrefixCache(
            NS, SHAPE, torch.float32, l1_pages=l1, l2_pages=l2, l2_layout=layout,
            write_policy=self.policy, l3=l3, async_backup=False,
            prefetch=PrefetchConfig(threshold_tokens=0, policy="wait_complete", batch_pages=batch))

    def teardown(self):
        if self.cache is not None:
            for _, m in self.held:
                self.cache.release(m)
            for _, h in self.prefetches:
                self.cache.cancel_prefetch(h)
            self.cache.close()
        if self.l3_dir is not None:
            shutil.rmtree(self.l3_dir, ignore_errors=True)

    # -- checks of what an operation returned ---------------------------------------------
    def check_pages(self, prompt: tuple[int, ...], pages: torch.Tensor) -> None:
        """Page i served for ``prompt`` is the page inserted for ``prompt[:i+1]``."""
        for i in range(pages.shape[0]):
            assert prompt[:i + 1] in self.inserted, f"page of {prompt[:i + 1]} never inserted"
            assert torch.equal(pages[i], page_kv(prompt[:i + 1])), f"wrong bytes for {prompt[:i + 1]}"

    def checked_load(self, prompt, m, adopt: bool = True) -> None:
        """Load ``m`` and check its bytes, and that its L3 counters moved by what it got."""
        first = not m.loaded
        announced = m.tiers.count("L3")
        before = self.cache.metrics.snapshot()
        pages = within(DEADLINE_S, self.cache.load, m, adopt=adopt)
        assert pages.shape[0] == m.num_pages
        self.check_pages(prompt, pages)
        after = self.cache.metrics.snapshot()
        got = m.tiers.count("L3") if first else 0
        lost = announced - m.tiers.count("L3") if first else 0
        assert after.get("hit_tokens_l3", 0) - before.get("hit_tokens_l3", 0) == got * PAGE
        assert after.get("lost_tokens_l3", 0) - before.get("lost_tokens_l3", 0) == lost * PAGE

    # -- operations -------------------------------------------------------------------------
    @rule(prompt=PROMPTS, data=st.data())
    def insert(self, prompt, data):
        n = data.draw(st.one_of(st.just(len(prompt)), st.integers(0, len(prompt))), label="pages")
        stored = within(DEADLINE_S, self.cache.insert, prompt_tokens(prompt), prompt_kv(prompt)[:n])
        self.inserted.update(prompt[:i + 1] for i in range(n))
        assert 0 <= stored <= n
        assert self.cache.peek(prompt_tokens(prompt)) >= stored

    @precondition(lambda self: "serve" not in self.off)
    @rule(prompt=PROMPTS)
    def serve(self, prompt):
        """A request as an engine makes it: match, load, release, insert every page."""
        self.lookup(prompt)
        stored = within(DEADLINE_S, self.cache.insert, prompt_tokens(prompt), prompt_kv(prompt))
        self.inserted.update(prompt[:i + 1] for i in range(len(prompt)))
        assert 0 <= stored <= len(prompt)

    @precondition(lambda self: "lookup" not in self.off)
    @rule(prompt=PROMPTS)
    def lookup(self, prompt):
        m = within(DEADLINE_S, self.cache.match, prompt_tokens(prompt))
        try:
            self.checked_load(prompt, m)
        finally:
            self.cache.release(m)

    @precondition(lambda self: "hold" not in self.off and len(self.held) < 3)
    @rule(prompt=PROMPTS)
    def hold(self, prompt):
        self.held.append((prompt, within(DEADLINE_S, self.cache.match, prompt_tokens(prompt))))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 2), adopt=st.booleans())
    def load_held(self, i, adopt):
        prompt, m = self.held[i % len(self.held)]
        self.checked_load(prompt, m, adopt)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 2))
    def release_held(self, i):
        _, m = self.held.pop(i % len(self.held))
        within(DEADLINE_S, self.cache.release, m)

    @precondition(lambda self: "prefetch" not in self.off and self.l3_dir is not None
                  and len(self.prefetches) < 2)
    @rule(prompt=PROMPTS)
    def prefetch(self, prompt):
        h = within(DEADLINE_S, self.cache.prefetch, prompt_tokens(prompt))
        # landed before the next step: the machine stays deterministic (hypothesis replays it)
        assert h.wait(DEADLINE_S), "prefetch did not finish"
        self.prefetches.append((prompt, h))

    @precondition(lambda self: self.prefetches)
    @rule(i=st.integers(0, 1))
    def schedule_prefetched(self, i):
        prompt, h = self.prefetches.pop(i % len(self.prefetches))
        m = within(DEADLINE_S, self.cache.match, prompt_tokens(prompt), prefetch=h)
        try:
            self.checked_load(prompt, m)
        finally:
            self.cache.release(m)

    @precondition(lambda self: self.prefetches)
    @rule(i=st.integers(0, 1))
    def cancel_prefetch(self, i):
        _, h = self.prefetches.pop(i % len(self.prefetches))
        within(DEADLINE_S, self.cache.cancel_prefetch, h)

    @precondition(lambda self: "evict" not in self.off)
    @rule(tier=st.sampled_from(["L1", "L2"]), n=st.integers(1, 4))
    def evict(self, tier, n):
        """Pressure from another request: take ``n`` slots of ``tier`` (evicting as the
        cache would for an insert), then give them back."""
        pool = self.cache.pool if tier == "L1" else self.cache.l2
        if pool is None:
            return

        def take_and_give_back():
            with self.cache._lock:
                slots = [s for s in (self.cache.placement.alloc(tier) for _ in range(n)) if s is not None]
                for slot in slots:
                    pool.free(slot)

        within(DEADLINE_S, take_and_give_back)

    @precondition(lambda self: "lose" not in self.off and self.l3_dir is not None)
    @rule(prompt=PROMPTS)
    def lose_l3_page(self, prompt):
        """The last page of ``prompt`` leaves L3 (evicted or removed by someone else)."""
        key = self.cache._keys(prompt_tokens(prompt), None)[0][-1]
        self.cache.l3._file(store_key(key)).unlink(missing_ok=True)

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def tree_is_consistent(self):
        if self.cache is None:
            return
        cache, tree = self.cache, self.cache.tree
        pools = {"L1": cache.pool, "L2": cache.l2}
        used = {"L1": [], "L2": []}
        direct = Counter(id(m.locked) for _, m in self.held if m.locked is not None)
        direct.update(id(h.tail) for _, h in self.prefetches if h.tail is not None)
        root_direct = tree.root.lock_ref - sum(c.lock_ref for c in tree.root.children.values())
        assert root_direct == 1 + direct[id(tree.root)], "root lock count"
        nodes = list(tree.nodes())
        assert len(nodes) == tree.num_nodes
        for node in nodes:
            assert node.alive and node.parent.children.get(node.key) is node
            assert node.index == node.parent.index + 1
            assert node.l1 >= 0 or node.l2 >= 0, f"{node} holds no page"
            for tier, pool in pools.items():
                slot = node.slot(tier)
                if slot >= 0:
                    assert pool is not None and slot < pool.num_pages, f"{node}: bad {tier} slot"
                    used[tier].append(slot)
            assert node.lock_ref >= 0
            own = node.lock_ref - sum(c.lock_ref for c in node.children.values())
            assert own == direct[id(node)], f"{node}: {own} direct locks, test holds {direct[id(node)]}"
            self.check_node_bytes(node)
            self.check_lru_entry(node)
        for tier, pool in pools.items():
            if pool is None:
                continue
            free = list(pool._slots._free)
            assert len(set(used[tier])) == len(used[tier]), f"{tier} slot shared"
            assert len(set(free)) == len(free) and not set(free) & set(used[tier])
            assert len(free) + len(used[tier]) == pool.num_pages, f"{tier} slot leaked"
        for _, m in self.held:
            assert all(n.alive for n in m.nodes), "a held match lost a page"

    def check_node_bytes(self, node):
        want = page_kv(node_prefix(self.cache, node))
        if node.l1 >= 0:
            assert torch.equal(self.cache.pool.data[node.l1], want), f"{node}: L1 bytes"
        if node.l2 >= 0:
            got = torch.empty((1, *SHAPE))
            self.cache.l2.read([node.l2], got)
            assert torch.equal(got[0], want), f"{node}: L2 bytes"

    def check_lru_entry(self, node):
        tree = self.cache.tree
        for tier in ("L1", "L2"):
            if tree.evictable(node, tier):
                assert any(n is node and stamp == node.last_access
                           for stamp, _, n in tree._heaps[tier]), f"{node} not evictable from {tier}"

    @invariant()
    def l3_counters_add_up(self):
        if self.cache is None:
            return
        c = self.cache.metrics.snapshot()
        assert c.get("hit_tokens_l3", 0) + c.get("lost_tokens_l3", 0) <= c.get("announced_tokens_l3", 0)


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_k20_k21_prefix_cache_under_random_operations_on_tiny_tiers(policy):
    machine = type(f"CacheMachine_{policy}", (CacheMachine,), {"policy": policy})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=MAX_EXAMPLES[policy], stateful_step_count=STEPS, deadline=None, derandomize=True,
        database=None, suppress_health_check=[HealthCheck.too_slow]))
