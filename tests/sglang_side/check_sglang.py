"""kvpool's HiCache backend against SGLang 0.5.23's own classes, on a real kvpool cluster.

Run by tests/test_integration_sglang.py in a process of its own (SGLang patches
transformers on import and needs the torchvision placeholder of harness.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import harness  # noqa: F401  (installs the placeholder before SGLang is imported)
from harness import backend, correct, empty_slots, fill, host_pool
from sglang.srt.mem_cache.hicache_storage import (STORAGE_BATCH_SIZE, HiCacheStorageFailureInjector,
                                                  PoolHitPolicy, PoolName, PoolTransfer)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str

from kvpool.cache.compat import sglang_page_hashes
from kvpool.client import Client
from kvpool.errors import InvalidParams
from kvpool.integrations.sglang import KVPoolHiCacheStorage

HERE = Path(__file__).parent
MHA_LAYOUTS = ["page_first", "page_first_direct", "page_head", "layer_first"]
MLA_LAYOUTS = ["page_first", "page_first_direct", "layer_first"]


def keys_for(tag: int, pages: int) -> list[str]:
    """SGLang's own page hashes (get_hash_str) of a token sequence."""
    tokens = [(tag * 7919 + i) % 50_000 for i in range(pages * harness.PAGE_SIZE)]
    return get_hash_str(tokens, None, page_size=harness.PAGE_SIZE)


class EngineB:
    """A second SGLang-side process (harness.py as a worker) with its own backend."""

    def __init__(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "harness.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"engine B exited with {self.proc.wait()}"
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def engine_b():
    b = EngineB()
    yield b
    b.close()


@pytest.fixture
def store(module_cluster):
    with Client(module_cluster.master_addr) as c:
        yield c
        c.remove_all(force=True)


def test_factory_builds_the_backend_from_the_users_json(module_cluster, store):
    pool = host_pool("mha", "page_first")
    b = backend(module_cluster.master_addr, pool)
    assert type(b) is KVPoolHiCacheStorage
    assert b.ns.tp_size == 1 and b.ns.kv_layout == "sglang-mha-page_first" and b.ns.dtype == "float32"
    b.close()


def test_sglang_page_hash_is_kvpools_compat_hash():
    tokens = list(range(1000, 1000 + 3 * harness.PAGE_SIZE))
    assert get_hash_str(tokens, None, page_size=harness.PAGE_SIZE) == sglang_page_hashes(tokens, harness.PAGE_SIZE)


@pytest.mark.parametrize("kind,layout", [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS])
def test_round_trip_between_two_engines(module_cluster, store, engine_b, kind, layout):
    pool = host_pool(kind, layout)
    a = backend(module_cluster.master_addr, pool, kind)
    keys = keys_for(1, 6)
    assert a.batch_set_v1(keys, fill(pool, keys)) == [True] * 6
    assert engine_b.ask(op="open", master=module_cluster.master_addr, kind=kind, layout=layout) == {"ok": True}
    assert engine_b.ask(op="exists", keys=keys + keys_for(2, 2))["hit"] == 6
    got = engine_b.ask(op="load", keys=keys)
    assert got["loaded"] == [True] * 6 and got["correct"] == [True] * 6
    # and back: B writes, A loads into its own slots
    more = keys_for(3, 3)
    assert engine_b.ask(op="store", keys=more)["stored"] == [True] * 3
    idx = empty_slots(pool, 3)
    assert a.batch_get_v1(more, idx) == [True] * 3
    assert correct(pool, more, idx) == [True] * 3
    a.close()


def test_batch_exists_counts_the_leading_run_in_sglangs_batches(module_cluster, store):
    pool = host_pool("mha", "page_first", host_tokens=4 * STORAGE_BATCH_SIZE * harness.PAGE_SIZE)
    a = backend(module_cluster.master_addr, pool)
    keys = keys_for(4, STORAGE_BATCH_SIZE)
    assert all(a.batch_set_v1(keys[:100], fill(pool, keys[:100])))
    assert a.batch_exists(keys) == 100
    assert a.batch_exists(keys[100:]) == 0
    a.close()


def test_set_writes_only_the_pages_the_store_lacks(module_cluster, store):
    pool = host_pool("mha", "page_first")
    a = backend(module_cluster.master_addr, pool)
    keys = keys_for(5, 5)
    assert a.batch_set_v1(keys[:3], fill(pool, keys[:3])) == [True] * 3
    before = {k: store.get(a.store_key(k)) for k in keys[:3]}
    # the same keys now in slots that hold other bytes: a rewrite would change the objects
    idx = empty_slots(pool, 5)
    for j in (3, 4):
        pool.set_from_flat_data_page(int(idx[j * harness.PAGE_SIZE]), harness.page_data(pool, keys[j]))
    assert a.batch_set_v1(keys, idx) == [True] * 5
    assert store.stats().object_count == 5
    assert {k: store.get(a.store_key(k)) for k in keys[:3]} == before
    a.close()


def test_tp_size_is_part_of_the_namespace(module_cluster, store):
    """SGLang's Mooncake backend keys MHA pages "<hash>_<tp_rank>_k": rank 0 of TP2 and
    rank 0 of TP4 would share keys for different head slices. kvpool's do not."""
    pool2, pool4 = host_pool("mha", "page_first"), host_pool("mha", "page_first")
    tp2 = backend(module_cluster.master_addr, pool2, tp_rank=0, tp_size=2)
    tp4 = backend(module_cluster.master_addr, pool4, tp_rank=0, tp_size=4)
    keys = keys_for(6, 4)
    assert all(tp2.batch_set_v1(keys, fill(pool2, keys)))
    assert tp4.store_key(keys[0]) != tp2.store_key(keys[0])
    assert tp4.batch_exists(keys) == 0
    assert tp4.batch_get_v1(keys, empty_slots(pool4, 4)) == [False] * 4
    rank1 = backend(module_cluster.master_addr, host_pool("mha", "page_first"), tp_rank=1, tp_size=2)
    assert rank1.batch_exists(keys) == 0
    for b in (tp2, tp4, rank1):
        b.close()


def test_mla_only_the_storage_writer_writes_and_every_rank_reads(module_cluster, store):
    writer_pool, other_pool = host_pool("mla", "page_first"), host_pool("mla", "page_first")
    writer = backend(module_cluster.master_addr, writer_pool, "mla", tp_rank=0, tp_size=2)
    other = backend(module_cluster.master_addr, other_pool, "mla", tp_rank=1, tp_size=2)
    assert writer.storage_config.is_storage_writer and not other.storage_config.is_storage_writer
    keys = keys_for(7, 3)
    assert other.batch_set_v1(keys, fill(other_pool, keys)) == [True] * 3
    assert store.stats().object_count == 0
    assert writer.batch_set_v1(keys, fill(writer_pool, keys)) == [True] * 3
    assert store.stats().object_count == 3
    idx = empty_slots(other_pool, 3)
    assert other.batch_get_v1(keys, idx) == [True] * 3 and correct(other_pool, keys, idx) == [True] * 3
    writer.close()
    other.close()


def test_corrupted_page_is_a_miss_and_is_stored_again(module_cluster, store):
    pool = host_pool("mha", "page_head")
    a = backend(module_cluster.master_addr, pool)
    keys = keys_for(8, 4)
    assert all(a.batch_set_v1(keys, fill(pool, keys)))
    name = a.store_key(keys[2])
    blob = bytearray(store.get(name))
    blob[-5] ^= 0x40  # one bit of the last V element
    store.upsert(name, bytes(blob))
    idx = empty_slots(pool, 4)
    assert a.batch_get_v1(keys, idx) == [True, True, False, True]
    assert correct(pool, keys[:2], idx[:2 * harness.PAGE_SIZE]) == [True, True]
    assert a.rejects["checksum"] == 1
    assert a.batch_exists(keys) == 2  # the bad page was removed ...
    assert all(a.batch_set_v1(keys, fill(pool, keys)))  # ... so a writer stores it again
    idx = empty_slots(pool, 4)
    assert a.batch_get_v1(keys, idx) == [True] * 4 and all(correct(pool, keys, idx))
    a.close()


def test_generic_interface_reads_what_the_zero_copy_one_wrote(module_cluster, store):
    pool = host_pool("mha", "layer_first")
    a = backend(module_cluster.master_addr, pool)
    keys = keys_for(9, 3)
    assert all(a.batch_set_v1(keys, fill(pool, keys)))
    got = a.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(g, harness.page_data(pool, k)) for g, k in zip(got, keys))
    new = keys_for(10, 2)
    assert a.batch_set(new, [harness.page_data(pool, k) for k in new])
    assert a.exists(new[1]) and not a.exists(keys_for(11, 1)[0])
    idx = empty_slots(pool, 2)
    assert a.batch_get_v1(new, idx) == [True, True] and all(correct(pool, new, idx))
    assert a.get(keys_for(11, 1)[0], pool.get_dummy_flat_data_page()) is None
    a.close()


def test_a_wrongly_sized_target_is_a_miss_and_the_page_stays(module_cluster, store):
    """A caller's target or value of the wrong size says nothing about the stored page,
    which other ranks and instances use: ``get`` misses and leaves it, ``set`` answers
    False (SGLang's interface: a bool, not an exception)."""
    pool = host_pool("mha", "page_first")
    a = backend(module_cluster.master_addr, pool)
    keys = keys_for(12, 2)
    assert all(a.batch_set_v1(keys, fill(pool, keys)))
    assert a.get(keys[0], torch.zeros(10)) is None
    assert a.exists(keys[0]) and not a.rejects
    got = a.get(keys[0], pool.get_dummy_flat_data_page())
    assert got is not None and torch.equal(got, harness.page_data(pool, keys[0]))
    new = keys_for(13, 1)[0]
    assert a.set(new, torch.zeros(3)) is False
    assert a.batch_set([keys[1], new], [harness.page_data(pool, keys[1]), torch.zeros(3)]) is False
    assert not a.exists(new)
    a.close()


def test_salted_requests_get_their_own_pages(module_cluster, store):
    class Key(list):
        extra_key, cache_salt = None, "tenant-a"

    tokens = list(range(2 * harness.PAGE_SIZE))
    salted = get_storage_hash_str(Key(tokens), None, page_size=harness.PAGE_SIZE)
    plain = get_storage_hash_str(tokens, None, page_size=harness.PAGE_SIZE)
    assert salted != plain
    pool = host_pool("mha", "page_first")
    a = backend(module_cluster.master_addr, pool)
    assert all(a.batch_set_v1(plain, fill(pool, plain)))
    assert a.batch_exists(salted) == 0
    a.close()


def hybrid_backend(master):
    """An MHA backend with a Mamba pool and a sliding-window KV pool registered (v2)."""
    kv, swa, mamba = host_pool("mha", "page_first"), host_pool("mha", "page_first"), harness.mamba_pool()
    a = backend(master, kv)
    a.register_mem_host_pool_v2(kv, PoolName.KV)  # the KV anchor again: accepted
    a.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    a.register_mem_host_pool_v2(swa, PoolName.SWA)
    return a, kv, swa, mamba


def transfer(name, keys, idx=None, policy=PoolHitPolicy.ALL_PAGES):
    return PoolTransfer(name=name, keys=keys, host_indices=idx, hit_policy=policy)


def test_v2_pools_store_their_pages_and_hit_by_their_policies(module_cluster, store):
    a, kv, swa, mamba = hybrid_backend(module_cluster.master_addr)
    keys = keys_for(20, 6)
    # KV for 6 pages, Mamba states after pages 4 and 6, window KV of pages 2..5 only
    written = a.batch_set_v2([transfer(PoolName.KV, keys, fill(kv, keys)),
                              transfer(PoolName.MAMBA, [keys[3], keys[5]], fill(mamba, [keys[3], keys[5]])),
                              transfer(PoolName.SWA, keys[2:], fill(swa, keys[2:]))])
    assert written == {PoolName.KV: [True] * 6, PoolName.MAMBA: [True] * 2, PoolName.SWA: [True] * 4}
    trailing = [transfer(PoolName.MAMBA, keys[-1:], policy=PoolHitPolicy.TRAILING_PAGES),
                transfer(PoolName.SWA, keys[-2:], policy=PoolHitPolicy.TRAILING_PAGES)]
    r = a.batch_exists_v2(keys, trailing)
    # a stop point needs its Mamba state and the 2 window pages before it: 4 and 6
    assert r.restorable_prefix_pages == [4, 6] and r.kv_hit_pages == 6
    assert r.extra_pool_hit_pages[PoolName.MAMBA] == 6
    r = a.batch_exists_v2(keys[:5], trailing)   # a prompt that leaves after page 5
    assert r.kv_hit_pages == 4
    r = a.batch_exists_v2(keys, [transfer(PoolName.SWA, keys, policy=PoolHitPolicy.ALL_PAGES)])
    assert r.kv_hit_pages == 0                  # window pages 0, 1 were never stored
    a.close()


def test_v2_reads_land_checked_in_the_pools_slots(module_cluster, store):
    a, kv, swa, mamba = hybrid_backend(module_cluster.master_addr)
    keys = keys_for(21, 4)
    a.batch_set_v2([transfer(PoolName.KV, keys, fill(kv, keys)),
                    transfer(PoolName.MAMBA, keys[-1:], fill(mamba, keys[-1:]))])
    b, kv_b, _, mamba_b = hybrid_backend(module_cluster.master_addr)
    kv_idx, state_idx = empty_slots(kv_b, 4), empty_slots(mamba_b, 1)
    got = b.batch_get_v2([transfer(PoolName.KV, keys, kv_idx), transfer(PoolName.MAMBA, keys[-1:], state_idx)])
    assert got == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True]}
    assert all(correct(kv_b, keys, kv_idx)) and correct(mamba_b, keys[-1:], state_idx) == [True]
    # the state of page 4 stored under page 3's name is refused: its header names page 4
    name = a._object_name(keys[2], PoolName.MAMBA)
    store.upsert(name, store.get(a._object_name(keys[3], PoolName.MAMBA)))
    assert b.batch_get_v2([transfer(PoolName.MAMBA, [keys[2]], empty_slots(mamba_b, 1))]) == {
        PoolName.MAMBA: [False]}
    assert b.rejects["page_key"] == 1
    a.close()
    b.close()


def test_v2_refuses_what_it_cannot_store(module_cluster, store):
    pool = host_pool("mla", "page_first")
    a = backend(module_cluster.master_addr, pool, "mla")
    with pytest.raises(NotImplementedError, match="MLA"):
        a.register_mem_host_pool_v2(harness.mamba_pool(), PoolName.MAMBA)
    a.close()
    b, *_ = hybrid_backend(module_cluster.master_addr)
    with pytest.raises(NotImplementedError, match="block_groups"):
        b.batch_exists_v2(["k"], [transfer(PoolName.MAMBA, ["k"], policy=PoolHitPolicy.BLOCK_GROUPS)])
    with pytest.raises(InvalidParams, match="not registered"):
        b.batch_exists_v2(["k"], [transfer(PoolName.INDEXER, ["k"])])
    b.close()


def test_missing_master_is_a_clear_error():
    cfg = harness.storage_config("x:1")
    cfg.extra_config.pop("master")
    with pytest.raises(ValueError, match='needs "master"'):
        StorageBackendFactory.create_backend("dynamic", cfg, None)


@pytest.mark.parametrize("key, value, why", [
    ("master", "127.0.0.1", "needs a port"), ("replica_num", 0, "replica_num must be an integer >= 1"),
    ("timeout_s", "ten", "timeout_s must be a number"), ("retry_s", "nan", "retry_s must be a finite number"),
])
def test_a_setting_that_cannot_work_is_refused_at_start_naming_its_key(key, value, why):
    """Found by a trial: replica_num 0 was accepted and then every write failed."""
    cfg = harness.storage_config("x:1")
    cfg.extra_config[key] = value
    with pytest.raises(ValueError, match=why):
        StorageBackendFactory.create_backend("dynamic", cfg, None)


def test_a_misspelt_key_is_named(caplog):
    cfg = harness.storage_config("127.0.0.1:1")
    cfg.extra_config["forcetcp"] = True
    with caplog.at_level(logging.WARNING), contextlib.suppress(Exception):  # no master there
        StorageBackendFactory.create_backend("dynamic", cfg, None)
    assert "'forcetcp' is not one kvpool reads: ignored (did you mean 'force_tcp'?)" in caplog.text


def test_stats_are_sglangs_storage_metrics(module_cluster, store):
    pool = host_pool("mha", "page_first")
    a = backend(module_cluster.master_addr, pool, metrics=True)
    keys = keys_for(12, 3)
    a.batch_set_v1(keys, fill(pool, keys))
    a.batch_get_v1(keys, empty_slots(pool, 3))
    stats = a.get_stats()
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert a.get_stats().backup_pgs == []
    a.close()


def test_clear_removes_only_this_namespace(module_cluster, store):
    pool = host_pool("mha", "page_first")
    a = backend(module_cluster.master_addr, pool)
    store.put("someone-else", b"x")
    keys = keys_for(13, 2)
    a.batch_set_v1(keys, fill(pool, keys))
    a.clear()
    assert a.batch_exists(keys) == 0 and store.is_exist("someone-else")
    a.close()


def test_fault_injection_leaves_every_loaded_page_correct(module_cluster, store, monkeypatch):
    """SGLang's own injector (SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE / _DELAY, read
    by StorageBackendFactory.create_backend) fails and delays storage calls at random."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.005")
    pool = host_pool("mha", "page_first_direct")
    b = backend(module_cluster.master_addr, pool)
    assert isinstance(b, HiCacheStorageFailureInjector)
    injected, loaded_pages = 0, 0
    for r in range(16):
        keys = keys_for(100 + r % 5, 4)  # rounds share sequences: hits and misses mix
        src = fill(pool, keys)
        stored = b.batch_set_v1(keys, src)
        pool.free(src)
        hit = b.batch_exists(keys)
        idx = empty_slots(pool, 4)
        loaded = b.batch_get_v1(keys[:hit], idx[:hit * harness.PAGE_SIZE]) if hit else []
        ok = correct(pool, keys[:hit], idx[:hit * harness.PAGE_SIZE])
        assert all(o for o, got in zip(ok, loaded) if got), f"round {r}: a loaded page is wrong"
        pool.free(idx)
        # kvpool itself fails none of these calls here: every failure is the injector's
        injected += (not all(stored)) + (all(stored) and hit < 4) + (False in loaded)
        loaded_pages += sum(loaded)
    assert injected and loaded_pages
    b.close()


def test_gather_and_scatter_over_tcp(module_cluster, store, engine_b):
    """MHA layer_first pages are 2 x layers regions: each is written and read in place,
    here over the node's TCP port instead of the shared-memory mapping."""
    pool = host_pool("mha", "layer_first")
    a = backend(module_cluster.master_addr, pool, force_tcp=True)
    keys = keys_for(14, 5)
    assert a.batch_set_v1(keys, fill(pool, keys)) == [True] * 5
    idx = empty_slots(pool, 5)
    assert a.batch_get_v1(keys, idx) == [True] * 5 and correct(pool, keys, idx) == [True] * 5
    a.close()


def test_a_layout_without_page_regions_is_refused(module_cluster, store):
    """SGLang's page_unified layout interleaves K and V per head group: its host pool has
    no byte-region description of a page (get_page_buffer_meta), so it is refused."""
    pool = host_pool("mha", "page_unified")
    with pytest.raises(NotImplementedError, match="page_unified"):
        backend(module_cluster.master_addr, pool)
