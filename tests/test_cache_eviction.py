"""Eviction that cannot make progress (K20): tiers too small for the victim to be written
back or freed. Every operation must return: another victim, or an allocation that fails
cleanly (fewer pages stored, counted), never a loop holding the cache's lock."""

import pytest
import torch

from cache_helpers import lookup, within
from kvpool.cache import DiskBackend, Namespace, PrefixCache, PrefetchConfig

PAGE = 4
SHAPE = (1, 2, 1, PAGE, 2)  # L, K/V, H, P, D
NS = Namespace(model="tiny", page_size=PAGE)
DEADLINE_S = 30  # a cache operation takes milliseconds; this only bounds a livelock


def kv(n, seed=0):
    return torch.randn((n, *SHAPE), generator=torch.Generator().manual_seed(seed))


def seq(i, pages):
    return [1000 * i + t for t in range(pages * PAGE)]


@pytest.fixture
def cache():
    c = PrefixCache(NS, SHAPE, torch.float32, l1_pages=2, l2_pages=1, write_policy="write_back")
    yield c
    c.close()


def where(cache, tokens):
    """(l1 slot >= 0, l2 slot >= 0) per cached page of ``tokens``, root side first."""
    nodes = cache.tree.match(*cache._keys(tokens, None))[0]
    return [(n.l1 >= 0, n.l2 >= 0) for n in nodes]


def build_l1_l2_l1_chain(cache):
    """p0 (L1 only) -> p1 (L2 only) -> p2 (L1 only), with L1 and L2 full."""
    p = seq(0, 3)
    pages = kv(3)
    cache.insert(p[:2 * PAGE], pages[:2])       # p0, p1 in L1
    cache.insert(seq(1, 1), kv(1, seed=1))      # evicts p1 L1 -> L2 (write back)
    cache.insert(p, pages)                      # p2 in L1, seq 1 dropped (L2 full)
    assert where(cache, p) == [(True, False), (False, True), (True, False)]
    return p, pages


def test_k20_insert_under_a_chain_that_cannot_be_written_back_returns(cache):
    p, pages = build_l1_l2_l1_chain(cache)
    # p0 is the LRU L1 page; its write-back finds L2 full of p1 (needed: p2 hangs below)
    stored = within(DEADLINE_S, cache.insert, seq(2, 1), kv(1, seed=2))
    assert stored == 1
    assert within(DEADLINE_S, lookup, cache, seq(2, 1))[0] == 1
    n, _, got = within(DEADLINE_S, lookup, cache, p)
    assert torch.equal(got, pages[:n])


def test_k20_a_full_l1_of_pages_that_cannot_move_fails_the_insert_cleanly(cache):
    p, pages = build_l1_l2_l1_chain(cache)
    m = cache.match(p)                          # locks the whole chain
    try:
        assert within(DEADLINE_S, cache.insert, seq(3, 2), kv(2, seed=3)) == 0
        assert cache.metrics["l1_full"] >= 1 and cache.metrics["l2_full"] >= 1
    finally:
        cache.release(m)


def test_k20_prefetch_below_l1_only_pages_then_eviction_returns(tmp_path):
    disk = DiskBackend(tmp_path / "l3", max_bytes=1 << 20)
    cfg = PrefetchConfig(threshold_tokens=0, policy="wait_complete")
    writer = PrefixCache(NS, SHAPE, torch.float32, l1_pages=8, l3=disk, async_backup=False)
    p, pages = seq(0, 3), kv(3)
    writer.insert(p[:2 * PAGE], pages[:2])
    writer.close()
    c = PrefixCache(NS, SHAPE, torch.float32, l1_pages=2, l2_pages=1, l3=disk,
                    write_policy="write_back", prefetch=cfg, async_backup=False)
    try:
        c.insert(p[:PAGE], pages[:1])           # p0 in L1 only
        h = c.prefetch(p)                       # p1 lands in L2 below it (L2 now full)
        c.release(within(DEADLINE_S, c.match, p, prefetch=h))
        c.insert(p, pages)                      # p2 in L1 below p1
        assert where(c, p) == [(True, False), (False, True), (True, False)]
        # L1 evicts p0 first, whose write-back finds L2 full of its own child
        assert within(DEADLINE_S, c.insert, seq(4, 1), kv(1, seed=4)) == 1
        n, _, got = within(DEADLINE_S, lookup, c, p)
        assert torch.equal(got, pages[:n])
    finally:
        c.close()
