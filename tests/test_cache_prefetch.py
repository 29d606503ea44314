"""Prefetch L3 -> L2: completion (K12), policies, and what landed is kept and locked."""

import threading

import pytest
import torch

from kvpool.cache import DiskBackend, Namespace, PrefixCache
from kvpool.cache.policies import PrefetchConfig
from proc_helpers import poll_until

PAGE = 4
SHAPE = (2, 2, 1, PAGE, 3)
NS = Namespace(model="tiny", page_size=PAGE)
TOKENS = list(range(6 * PAGE))  # 6 pages


def kv(n, seed=0):
    return torch.randn((n, *SHAPE), generator=torch.Generator().manual_seed(seed))


class GatedDisk(DiskBackend):
    """A real disk backend whose prefetch lookups wait for a gate and whose prefetch reads
    are released one batch at a time, so a test can look at a prefetch in each state
    (calls from the test's own thread pass straight through)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.exists_gate = threading.Event()
        self.reads = threading.Semaphore(0)
        self.gated = False

    def _from_prefetch(self):
        return self.gated and threading.current_thread().name == "kvpool-prefetch"

    def exists(self, keys):
        if self._from_prefetch():
            assert self.exists_gate.wait(30)
        return super().exists(keys)

    def get_into(self, keys, bufs):
        if self._from_prefetch():
            assert self.reads.acquire(timeout=30)
        return super().get_into(keys, bufs)


@pytest.fixture
def disk(tmp_path):
    d = GatedDisk(tmp_path, max_bytes=1 << 20)
    with PrefixCache(NS, SHAPE, l1_pages=16, l3=d, async_backup=False) as writer:
        writer.insert(TOKENS, kv(6))
    d.gated = True
    return d


@pytest.fixture
def caches():
    made = []

    def make(disk, **cfg):
        cfg.setdefault("threshold_tokens", PAGE)
        cfg.setdefault("batch_pages", 2)
        made.append(PrefixCache(NS, SHAPE, l1_pages=16, l2_pages=16, l3=disk,
                                prefetch=PrefetchConfig(**cfg)))
        return made[-1]

    yield make
    for cache in made:
        cache.close()


def test_k12_not_done_before_the_plan_nor_before_every_planned_page(caches, disk):
    cache = caches(disk, policy="wait_complete")
    h = cache.prefetch(TOKENS)
    assert h.planned is None and not h.done()  # the plan is not known yet
    disk.exists_gate.set()
    assert h.wait_plan(30) and h.planned == 6
    assert not h.done()  # planned, but nothing landed
    disk.reads.release()  # the first of three batches
    poll_until(lambda: h.landed >= 2, 30)
    assert h.landed == 2 and not h.done()  # some planned pages landed, not all
    disk.reads.release()
    disk.reads.release()
    assert h.wait(30) and h.done() and h.outcome == "complete" and h.landed == 6
    m = cache.match(TOKENS, prefetch=h)
    assert m.tiers == ["L2"] * 6 and torch.equal(cache.load(m), kv(6))
    cache.release(m)


def test_k12_zero_planned_pages_is_a_reported_outcome(caches, disk, tmp_path):
    cache = caches(disk)
    disk.exists_gate.set()
    h = cache.prefetch([7] * (6 * PAGE))  # nothing of this in L3
    assert h.wait(30) and h.planned == 0 and h.done() and h.outcome == "complete"
    m = cache.match([7] * (6 * PAGE), prefetch=h)
    assert m.num_pages == 0
    cache.release(m)


def test_a_tail_below_the_threshold_is_not_prefetched(caches, disk):
    cache = caches(disk, threshold_tokens=256)
    h = cache.prefetch(TOKENS)
    assert h.finished and h.planned == 0 and h.done() and h.outcome == "skipped"
    cache.cancel_prefetch(h)


def test_timeout_keeps_the_batches_that_landed(caches, disk):
    cache = caches(disk, policy="timeout", timeout_base_s=0.2, timeout_per_1k_tokens_s=0.0)
    disk.exists_gate.set()
    disk.reads.release()  # only the first batch of 2 pages can be read
    h = cache.prefetch(TOKENS)
    m = cache.match(TOKENS, prefetch=h)
    assert m.tiers[:2] == ["L2", "L2"]
    assert m.tiers[2:] == ["L3"] * 4  # the rest is still found in L3, live
    assert torch.equal(cache.load(m), kv(6))
    cache.release(m)
    for _ in range(3):
        disk.reads.release()
    assert h.wait(30) and h.outcome == "cancelled" and h.landed == 2


def test_best_effort_takes_what_landed_without_waiting(caches, disk):
    cache = caches(disk, policy="best_effort")
    h = cache.prefetch(TOKENS)
    m = cache.match(TOKENS, prefetch=h)  # the plan is not even known: nothing landed
    assert "L2" not in m.tiers
    cache.release(m)
    disk.exists_gate.set()
    for _ in range(4):
        disk.reads.release()
    assert h.wait(30) and h.outcome == "cancelled" and h.landed == 0
    assert all(n.lock_ref == 0 for n in cache.tree.nodes())


def test_landed_pages_stay_locked_until_the_request_is_scheduled(caches, disk):
    cache = caches(disk, policy="wait_complete")
    disk.exists_gate.set()
    for _ in range(3):
        disk.reads.release()
    h = cache.prefetch(TOKENS)
    assert h.wait(30) and h.landed == 6
    assert all(n.lock_ref > 0 for n in cache.tree.nodes())
    cache.cancel_prefetch(h)
    assert all(n.lock_ref == 0 for n in cache.tree.nodes())


def test_a_corrupted_page_stops_the_prefetch_before_it(caches, disk):
    from kvpool.cache import page_keys, store_key
    path = disk._file(store_key(page_keys(NS, TOKENS)[3]))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    cache = caches(disk, policy="wait_complete")
    disk.exists_gate.set()
    for _ in range(3):
        disk.reads.release()
    h = cache.prefetch(TOKENS)
    assert h.wait(30) and h.outcome == "failed" and h.landed == 3 and not h.done()
    assert cache.metrics["page_rejects_checksum"] == 1
    cache.cancel_prefetch(h)
