"""PrefixCache over L1 and a disk L3: hits, isolation, boundaries, corruption = miss."""

import dataclasses
import math

import pytest
import torch

from kvpool.cache import DiskBackend, Namespace, PrefixCache, max_reusable_pages, page_keys, store_key
from kvpool.errors import InvalidParams
from cache_helpers import lookup

PAGE = 4
SHAPE = (2, 2, 1, PAGE, 3)  # layers, K/V, kv heads, page_size, head_dim
NS = Namespace(model="tiny", weights_fingerprint="r1", dtype="float32", page_size=PAGE)


def kv(n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *SHAPE), generator=g).to(dtype)


def make(ns=NS, l3=None, l1_pages=64, dtype=torch.float32, async_backup=False):
    # synchronous L3 backups unless asked: a second cache reads L3 right after insert
    return PrefixCache(ns, SHAPE, dtype, l1_pages=l1_pages, l3=l3, async_backup=async_backup)


@pytest.fixture
def disk(tmp_path):
    return DiskBackend(tmp_path / "l3", max_bytes=1 << 20)




@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pages_round_trip_byte_exact_through_l1_and_l3(disk, dtype):
    tokens = list(range(1, 14))  # 3 full pages + 1 token
    pages = kv(3, dtype=dtype)
    writer = make(l3=disk, dtype=dtype)
    assert writer.insert(tokens, pages) == 3
    n, tiers, got = lookup(writer, tokens)
    assert (n, tiers) == (3, ["L1"] * 3) and torch.equal(got.view(torch.uint8), pages.view(torch.uint8))
    reader = make(l3=disk, dtype=dtype)  # a fresh process: only L3 has the pages
    n, tiers, got = lookup(reader, tokens)
    assert (n, tiers) == (3, ["L3"] * 3) and torch.equal(got.view(torch.uint8), pages.view(torch.uint8))
    assert lookup(reader, tokens)[1] == ["L1"] * 3  # loaded pages were adopted into L1


@pytest.mark.parametrize("change", [{"cache_salt": "B"}, {"lora": "b"},
                                    {"weights_fingerprint": "r2"}, {"tp_size": 4}])
def test_k13_no_hit_across_namespaces_in_l1_or_l3(disk, change):
    tokens = list(range(20))
    first = make(l3=disk)
    first.insert(tokens, kv(5))
    other_ns = dataclasses.replace(NS, **change)
    assert lookup(make(other_ns, l3=disk), tokens)[0] == 0
    # one process serving both namespaces: separate caches, shared L3
    assert lookup(make(other_ns, l3=disk), tokens)[0] == 0
    assert lookup(make(l3=disk), tokens)[0] == 5  # the same namespace still hits


def test_k13_a_page_copied_under_another_namespace_key_is_refused(disk):
    tokens = list(range(8))
    make(l3=disk).insert(tokens, kv(2))
    other = dataclasses.replace(NS, cache_salt="B")
    # plant A's page bytes under B's key, as a confused writer would
    key_a, key_b = page_keys(NS, tokens)[0], page_keys(other, tokens)[0]
    disk.put([store_key(key_b)], disk.get([store_key(key_a)]))
    cache = make(other, l3=disk)
    m = cache.match(tokens)
    assert m.num_pages == 1  # L3 says present...
    assert cache.load(m).shape[0] == 0 and m.num_pages == 0  # ...but the load refuses it
    cache.release(m)
    assert cache.metrics["page_rejects_namespace"] == 1


def test_k14_shorter_than_a_page_is_an_empty_match():
    cache = make()
    for tokens in ([], [1], [1, 2, 3]):
        m = cache.match(tokens)
        assert (m.num_pages, m.num_tokens, m.tiers) == (0, 0, [])
        assert cache.load(m).shape == (0, *SHAPE)
        cache.release(m)
        assert cache.insert(tokens, kv(0)) == 0
    assert cache.tree.num_nodes == 0


def test_k15_exact_page_boundary_keeps_one_token_to_compute(disk):
    tokens = list(range(3 * PAGE))
    cache = make(l3=disk)
    cache.insert(tokens, kv(3))
    full = cache.match(tokens)
    assert full.num_pages == 3  # the cache reports every cached page
    cache.release(full)
    reuse = max_reusable_pages(len(tokens), PAGE)
    m = cache.match(tokens, max_pages=reuse)
    assert m.num_pages == 2 and m.num_tokens < len(tokens)
    assert torch.equal(cache.load(m), kv(3)[:2])
    cache.release(m)
    cache.insert(tokens, kv(3))  # the engine inserts the recomputed tail again
    assert cache.tree.num_nodes == 3 and lookup(cache, tokens)[0] == 3


def test_corrupted_disk_page_is_a_miss_and_counted(disk):
    tokens = list(range(12))
    make(l3=disk).insert(tokens, kv(3))
    path = disk._file(store_key(page_keys(NS, tokens)[1]))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    cache = make(l3=disk)
    m = cache.match(tokens)
    assert m.num_pages == 3
    got = cache.load(m)
    assert m.num_pages == 1 and m.tiers == ["L3"] and torch.equal(got, kv(3)[:1])
    cache.release(m)
    assert cache.metrics["page_rejects"] == 1 and cache.metrics["page_rejects_checksum"] == 1


def test_an_l3_load_in_chunks_lands_every_page_in_a_strided_out_and_stops_at_a_bad_one(disk):
    tokens = list(range(7 * PAGE))
    make(l3=disk).insert(tokens, kv(7))
    cache = make(l3=disk)
    cache.l3_tier._chunk_pages = 2  # 7 pages: chunks of 2, 2, 2, 1
    # the engine's layout: tokens along a dim of their own, pages a permuted view of it
    seq = torch.zeros((SHAPE[0], SHAPE[1], SHAPE[2], 7 * PAGE, SHAPE[4]))
    out = seq.unflatten(3, (7, PAGE)).permute(3, 0, 1, 2, 4, 5)
    m = cache.match(tokens)
    cache.load(m, out=out, adopt=False)
    assert m.num_pages == 7 and torch.equal(out, kv(7))
    cache.release(m)
    assert cache.metrics["pages_loaded_l3"] == 7 and cache.l3_tier._load_rows.rows(0).shape[0] == 2

    path = disk._file(store_key(page_keys(NS, tokens)[5]))  # in the third chunk
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    cache = make(l3=disk)
    cache.l3_tier._chunk_pages = 2
    m = cache.match(tokens)
    got = cache.load(m)
    assert m.num_pages == 5 and torch.equal(got, kv(7)[:5])
    cache.release(m)
    assert cache.metrics["page_rejects_checksum"] == 1 and cache.metrics["pages_loaded_l3"] == 5
    n, tiers, _ = lookup(cache, tokens)  # the good pages were adopted into L1
    assert n == 5 and tiers == ["L1"] * 5


def test_a_page_evicted_between_match_and_load_cuts_the_match(disk):
    tokens = list(range(8))
    make(l3=disk).insert(tokens, kv(2))
    cache = make(l3=disk)
    m = cache.match(tokens)
    disk._file(store_key(page_keys(NS, tokens)[1])).unlink()
    assert cache.load(m).shape[0] == 1 and m.num_pages == 1
    cache.release(m)
    assert cache.metrics["l3_vanished"] == 1


def test_backup_writes_only_pages_l3_lacks(disk):
    a, b = list(range(8)), list(range(4)) + [9, 9, 9, 9]
    first = make(l3=disk)
    first.insert(a, kv(2))
    assert first.metrics["pages_written_l3"] == 2
    second = make(l3=disk)
    second.insert(b, kv(2))  # shares page 0 with a
    assert second.metrics["pages_written_l3"] == 1 and second.metrics["pages_dedup_l3"] == 1
    second.insert(b, kv(2))  # already known to be backed up: L3 is not even asked
    assert second.metrics["pages_written_l3"] == 1 and second.metrics["pages_dedup_l3"] == 1


def test_async_backup_reaches_l3_after_flush(disk):
    tokens = list(range(16))
    with make(l3=disk, async_backup=True) as writer:
        writer.insert(tokens, kv(4))
        writer.flush()
        assert writer.metrics["pages_written_l3"] == 4
        assert all(n.lock_ref == 0 for n in writer.tree.nodes())  # backup locks dropped
    assert lookup(make(l3=disk), tokens)[1] == ["L3"] * 4


def test_l1_evicts_least_recently_used_unlocked_pages():
    cache = make(l1_pages=4)
    a, b, c = ([i] * 8 for i in (1, 2, 3))
    cache.insert(a, kv(2, 1))
    cache.insert(b, kv(2, 2))
    held = cache.match(a)  # a is used by a running request
    assert cache.insert(c, kv(2, 3)) == 2  # evicts b, never a
    assert cache.metrics["evictions_l1"] == 2
    assert lookup(cache, b)[0] == 0
    # a is still locked: only c's two pages can make room for a new 4-page sequence
    assert cache.insert(list(range(40, 56)), kv(4)) == 2
    assert lookup(cache, a)[0] == 2
    cache.release(held)


def test_a_full_pool_of_locked_pages_cuts_the_insert():
    cache = make(l1_pages=2)
    cache.insert(list(range(8)), kv(2))
    held = cache.match(list(range(8)))
    assert cache.insert(list(range(100, 108)), kv(2)) == 0
    assert cache.metrics["l1_full"] == 1
    cache.release(held)
    assert cache.insert(list(range(100, 108)), kv(2)) == 2


def test_disk_backend_survives_a_restart_and_keeps_its_budget(tmp_path):
    budget = 3 * (128 + math.prod(SHAPE) * 4)  # three float32 pages with their headers
    cache = make(l3=DiskBackend(tmp_path, max_bytes=budget))
    cache.insert(list(range(16)), kv(4))
    restarted = DiskBackend(tmp_path, max_bytes=budget)
    assert restarted.used_bytes <= budget
    assert sum(restarted.exists([store_key(k) for k in page_keys(NS, list(range(16)))])) == 3


def test_bad_input_is_refused():
    cache = make()
    with pytest.raises(InvalidParams):
        cache.insert(list(range(8)), torch.zeros((2, 1, 1)))
    with pytest.raises(InvalidParams):
        cache.insert(list(range(8)), kv(3))  # more pages than the tokens fill
    with pytest.raises(InvalidParams):
        cache.insert(list(range(8)), kv(2, dtype=torch.float16))
    m = cache.match(list(range(8)))
    cache.release(m)
    with pytest.raises(InvalidParams):
        cache.release(m)
    with pytest.raises(InvalidParams):
        cache.load(m)


def test_a_page_chain_computed_once_serves_match_insert_and_peek():
    from kvpool.cache import page_chain
    tokens = list(range(10))
    chain = page_chain(NS, tokens)
    assert list(chain.keys) == page_keys(NS, tokens) and chain.num_tokens == 10
    cache = make()
    cache.insert(chain, kv(2))
    assert cache.peek(chain) == 2 and cache.metrics["lookups"] == 0  # peek counts nothing
    assert lookup(cache, chain)[0] == 2 and lookup(cache, tokens)[0] == 2
    with pytest.raises(InvalidParams):
        cache.match(page_chain(dataclasses.replace(NS, cache_salt="x"), tokens))


def test_loading_a_match_twice_gives_the_same_pages_and_a_sound_tree(disk):
    tokens = list(range(12))
    make(l3=disk).insert(tokens, kv(3))
    cache = make(l3=disk)
    m = cache.match(tokens)
    first, second = cache.load(m), cache.load(m)
    cache.release(m)
    assert torch.equal(first, kv(3)) and torch.equal(second, kv(3))
    assert m.tiers == ["L3"] * 3 and cache.tree.num_nodes == 3
    assert sorted(n.index for n in cache.tree.nodes()) == [0, 1, 2]
    assert all(n.lock_ref == 0 for n in cache.tree.nodes())


class FailingDisk(DiskBackend):
    """A real disk backend whose calls raise ``error`` once ``failing`` is set."""

    def __init__(self, path, error):
        super().__init__(path, max_bytes=1 << 20)
        self.error, self.failing = error, False

    def _maybe_fail(self):
        if self.failing:
            raise self.error

    def exists(self, keys):
        self._maybe_fail()
        return super().exists(keys)

    def get_into(self, keys, bufs):
        self._maybe_fail()
        return super().get_into(keys, bufs)

    def put(self, keys, blobs):
        self._maybe_fail()
        return super().put(keys, blobs)


def test_an_l3_medium_failure_is_a_miss_and_counted(tmp_path):
    tokens = list(range(12))
    disk = FailingDisk(tmp_path, OSError(5, "I/O error"))
    make(l3=disk).insert(tokens, kv(3))
    disk.failing = True
    reader = make(l3=disk)
    assert lookup(reader, tokens)[:2] == (0, [])  # exists failed: nothing announced
    disk.failing = False
    m = reader.match(tokens)
    disk.failing = True  # present at match, unreadable at load
    assert m.num_pages == 3 and reader.load(m).shape[0] == 0 and m.num_pages == 0
    reader.release(m)
    assert reader.insert(list(range(16)), kv(4)) == 4  # the backup fails, the insert stands
    assert reader.metrics["l3_errors"] == 3 and reader.metrics["lost_tokens_l3"] == 3 * PAGE


def test_invalid_params_from_an_l3_backend_is_raised_not_a_miss(tmp_path):
    """A programming error (a malformed key or buffer list) must surface, not read as
    "L3 does not have it"."""
    tokens = list(range(12))
    disk = FailingDisk(tmp_path, InvalidParams("malformed call"))
    make(l3=disk).insert(tokens, kv(3))
    reader = make(l3=disk)
    reader.insert(tokens[:4], kv(1))  # page 0 in the tree: the match locks it first
    disk.failing = True
    with pytest.raises(InvalidParams):
        reader.match(tokens)
    assert not any(n.lock_ref for n in reader.tree.nodes())
    disk.failing = False
    m = reader.match(tokens)
    disk.failing = True
    with pytest.raises(InvalidParams):
        reader.load(m)
    reader.release(m)
    with pytest.raises(InvalidParams):
        reader.insert(list(range(16)), kv(4))  # synchronous backup: raised from insert
    assert reader.metrics["l3_errors"] == 0
    disk.failing = False
    assert lookup(reader, list(range(16)))[0] == 4  # the tree and its locks stayed sound
