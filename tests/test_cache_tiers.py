"""L2 host pool and write policies: where pages live, and that they come back exact."""

import hashlib
import subprocess
import sys
import threading

import pytest
import torch

from cache_helpers import lookup
from kvpool.cache import DiskBackend, Namespace, PrefixCache
from kvpool.cache.host_pool import HostPool

PAGE = 4
SHAPE = (3, 2, 2, PAGE, 5)  # L, K/V, H, P, D
NS = Namespace(model="tiny", page_size=PAGE)


def kv(n, seed=0):
    return torch.randn((n, *SHAPE), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def caches():
    made = []

    def make(**kw):
        kw.setdefault("l1_pages", 4)
        kw.setdefault("l2_pages", 8)
        made.append(PrefixCache(NS, SHAPE, torch.float32, **kw))
        return made[-1]

    yield make
    for cache in made:
        cache.close()


def seq(i, pages=2):
    return [1000 * i + t for t in range(pages * PAGE)]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_pages_evicted_from_l1_come_back_exact_from_l2(caches, layout):
    cache = caches(l2_layout=layout)
    cache.insert(seq(1), kv(2, 1))
    cache.insert(seq(2), kv(2, 2))
    cache.insert(seq(3), kv(2, 3))  # L1 holds 4 pages: seq 1 leaves L1, stays in L2
    assert cache.metrics["evictions_l1"] == 2
    _, tiers, got = lookup(cache, seq(1))
    assert tiers == ["L2", "L2"] and torch.equal(got, kv(2, 1))
    assert lookup(cache, seq(1))[1] == ["L1", "L1"]  # promoted back on load


@pytest.mark.parametrize("layout, dims", [
    ("layer_first", (2, 3, 8 * PAGE, 2, 5)),
    ("page_first", (2, 8 * PAGE, 3, 2, 5)),
    ("page_first_direct", (2, 8, 3, PAGE, 2, 5)),
])
def test_host_pool_layouts_have_sglang_shapes(layout, dims):
    with HostPool(8, SHAPE, torch.float32, layout) as pool:
        assert tuple(pool.kv.shape) == dims
        pool.write([3], kv(1))
        assert torch.equal(pool.page(3), kv(1)[0])


def test_another_process_reads_the_shared_l2(caches):
    cache = caches(write_policy="write_through")
    cache.insert(seq(1), kv(2, 7))
    node = cache.tree.match(*_keys(seq(1)))[0][1]
    script = ("import sys, hashlib, torch; from kvpool.cache.host_pool import HostPool; "
              f"p = HostPool(8, {SHAPE}, torch.float32, 'layer_first', name=sys.argv[1], create=False); "
              f"print(hashlib.sha256(p.page({node.l2}).contiguous().numpy().tobytes()).hexdigest()); p.close()")
    out = subprocess.run([sys.executable, "-c", script, cache.l2.name], capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip()
    assert out == hashlib.sha256(kv(2, 7)[1].numpy().tobytes()).hexdigest()


def _keys(tokens):
    from kvpool.cache.keys import page_keys, page_token_bytes
    return page_keys(NS, tokens), page_token_bytes(tokens, PAGE)


def test_write_through_copies_every_page_to_l2(caches):
    cache = caches(write_policy="write_through")
    cache.insert(seq(1), kv(2))
    assert all(n.l1 >= 0 and n.l2 >= 0 for n in cache.tree.nodes())


def test_write_through_selective_copies_after_the_second_hit(caches):
    cache = caches(write_policy="write_through_selective")
    cache.insert(seq(1), kv(2))
    lookup(cache, seq(1))
    assert all(n.l2 < 0 for n in cache.tree.nodes())
    lookup(cache, seq(1))
    assert all(n.l2 >= 0 for n in cache.tree.nodes())


def test_write_back_copies_to_l2_only_at_l1_eviction(caches):
    cache = caches(write_policy="write_back")
    cache.insert(seq(1), kv(2, 1))
    assert all(n.l2 < 0 for n in cache.tree.nodes())
    cache.insert(seq(2), kv(2, 2))
    cache.insert(seq(3), kv(2, 3))
    assert cache.metrics["l2_writes"] == 2  # seq 1, evicted from L1
    _, tiers, got = lookup(cache, seq(1))
    assert tiers == ["L2", "L2"] and torch.equal(got, kv(2, 1))


def test_without_room_in_l2_an_l1_eviction_drops_the_page(caches):
    cache = caches(l2_pages=2, write_policy="write_back")
    for i in range(1, 5):
        cache.insert(seq(i), kv(2, i))
    assert cache.tree.num_nodes <= 6  # 4 in L1 + 2 in L2
    assert lookup(cache, seq(1))[1] == []


def test_pages_of_a_running_request_stay_in_every_tier(caches):
    cache = caches(l1_pages=2, l2_pages=2, write_policy="write_through")
    cache.insert(seq(1), kv(2, 1))
    held = cache.match(seq(1))
    assert cache.insert(seq(2), kv(2, 2)) == 0  # L1 and L2 full of locked pages
    assert cache.metrics["l1_full"] == 1
    assert torch.equal(cache.load(held), kv(2, 1))
    cache.release(held)
    assert cache.insert(seq(2), kv(2, 2)) == 2


class GatedDisk(DiskBackend):
    """A real disk backend whose writes wait for a gate (to hold a backup in flight)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def put(self, keys, blobs):
        assert self.gate.wait(30)
        return super().put(keys, blobs)


def test_pages_waiting_for_their_backup_are_not_evicted(caches, tmp_path):
    disk = GatedDisk(tmp_path, max_bytes=1 << 20)
    cache = caches(l1_pages=2, l2_pages=0, l3=disk)
    cache.insert(seq(1), kv(2, 1))          # backup queued, blocked at the gate
    assert cache.insert(seq(2), kv(2, 2)) == 0
    disk.gate.set()
    cache.flush()
    assert cache.insert(seq(2), kv(2, 2)) == 2
    cache.flush()
    assert cache.metrics["pages_written_l3"] == 4


def test_reserved_l3_rows_take_the_first_read_without_growing(caches, tmp_path):
    # reserve() touches the rows an L3 read lands in at start; a read of up to that
    # many pages then uses them as they are (no fresh memory on a request's path)
    writer = caches(l1_pages=4, l2_pages=0, l3=DiskBackend(tmp_path, max_bytes=1 << 20))
    writer.insert(seq(1, pages=3), kv(3, 1))
    writer.flush()
    reader = caches(l1_pages=4, l2_pages=0, l3=DiskBackend(tmp_path, max_bytes=1 << 20))
    reader.reserve(3)
    rows = reader.l3_tier._load_rows._raw
    assert rows.shape[0] == 3 and not rows.any()  # touched: written with zeros
    m = reader.match(seq(1, pages=3))
    try:
        got = reader.load(m)
    finally:
        reader.release(m)
    assert m.num_pages == 3 and torch.equal(got, kv(3, 1))
    assert reader.l3_tier._load_rows._raw is rows
