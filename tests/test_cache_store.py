"""PrefixCache with the real kvpool store as L3 (master + node processes on 127.0.0.1)."""

import dataclasses

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from kvpool.cache import Namespace, PrefixCache, StoreBackend, page_keys, store_key
from kvpool.cache.codec import HEADER_SIZE
from kvpool.cache.prometheus import CacheCollector
from kvpool.client import Client
from cache_helpers import lookup
from proc_helpers import wait_for

PAGE = 4
SHAPE = (2, 2, 1, PAGE, 3)
NS = Namespace(model="tiny", weights_fingerprint="r1", dtype="float32", page_size=PAGE)


def kv(n, seed=0):
    return torch.randn((n, *SHAPE), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def store(client):
    return StoreBackend(client)


def make(store, ns=NS):
    return PrefixCache(ns, SHAPE, torch.float32, l1_pages=32, l3=store, async_backup=False)




def test_pages_round_trip_byte_exact_through_the_store(store):
    tokens = list(range(13))
    pages = kv(3)
    make(store).insert(tokens, pages)
    n, tiers, got = lookup(make(store), tokens)
    assert (n, tiers) == (3, ["L3"] * 3) and torch.equal(got, pages)


@pytest.mark.parametrize("change", [{"cache_salt": "B"}, {"lora": "b"},
                                    {"weights_fingerprint": "r2"}, {"tp_size": 4}])
def test_k13_no_hit_across_namespaces_in_the_store(store, change):
    tokens = list(range(20))
    make(store).insert(tokens, kv(5))
    assert lookup(make(store, dataclasses.replace(NS, **change)), tokens)[0] == 0
    assert lookup(make(store), tokens)[0] == 5


def test_overwritten_store_object_is_a_miss_and_counted(store, client):
    tokens = list(range(12))
    make(store).insert(tokens, kv(3))
    key = store_key(page_keys(NS, tokens)[2])
    blob = bytearray(client.get(key))
    blob[HEADER_SIZE + 5] ^= 0x40
    client.upsert(key, bytes(blob))
    cache = make(store)
    n, tiers, got = lookup(cache, tokens)
    assert n == 2 and torch.equal(got, kv(3)[:2])
    assert cache.metrics["page_rejects_checksum"] == 1


def test_backup_writes_only_what_the_store_lacks(store):
    make(store).insert(list(range(8)), kv(2))
    second = make(store)
    second.insert(list(range(12)), kv(3))
    assert second.metrics["pages_dedup_l3"] == 2 and second.metrics["pages_written_l3"] == 1


def test_k17_a_page_split_in_objects_counts_only_when_every_object_is_there(store, client):
    ns = dataclasses.replace(NS, object_layout="kv")
    tokens = list(range(12))
    make(store, ns).insert(tokens, kv(3))
    keys = page_keys(ns, tokens)
    assert client.is_exist(store_key(keys[1], "k")) and client.is_exist(store_key(keys[1], "v"))
    client.remove(store_key(keys[1], "v"), force=True)  # as an eviction of one object would
    cache = make(store, ns)
    m = cache.match(tokens)
    assert m.num_pages == 1  # page 1 lacks its V object: it and everything after are misses
    assert torch.equal(cache.load(m), kv(3)[:1])
    cache.release(m)


def test_k17_swapped_k_and_v_objects_are_refused(store, client):
    ns = dataclasses.replace(NS, object_layout="kv")
    tokens = list(range(4))
    make(store, ns).insert(tokens, kv(1))
    key = page_keys(ns, tokens)[0]
    k_blob = client.get(store_key(key, "k"))
    client.upsert(store_key(key, "v"), k_blob)
    cache = make(store, ns)
    assert lookup(cache, tokens)[0] == 0
    assert cache.metrics["page_rejects_page_key"] == 1


def test_an_existing_object_counts_as_stored(store):
    assert store.put(["kvp/x"], [b"abc"]) == [True]
    assert store.put(["kvp/x"], [b"abc"]) == [True]
    assert store.exists(["kvp/x", "kvp/y"]) == [True, False]
    assert store.get(["kvp/x", "kvp/y"]) == [b"abc", None]


def test_prefetch_from_the_store_lands_in_l2_byte_exact(store):
    from kvpool.cache import PrefetchConfig
    tokens = list(range(8 * PAGE))
    make(store).insert(tokens, kv(8))
    with PrefixCache(NS, SHAPE, l1_pages=16, l2_pages=16, l3=store,
                     prefetch=PrefetchConfig(threshold_tokens=PAGE, policy="wait_complete")) as cache:
        h = cache.prefetch(tokens)
        m = cache.match(tokens, prefetch=h)
        assert h.done() and h.planned == 8 and m.tiers == ["L2"] * 8
        assert torch.equal(cache.load(m), kv(8))
        cache.release(m)


@pytest.mark.parametrize("gone", [0, 2])
def test_k21_l3_hits_count_only_pages_that_landed(store, client, gone):
    tokens = list(range(5 * PAGE))
    make(store).insert(tokens, kv(5))
    cache = make(store)
    m = cache.match(tokens)
    assert m.tiers == ["L3"] * 5 and cache.metrics["announced_tokens_l3"] == 5 * PAGE
    assert cache.metrics["hit_tokens_l3"] == 0  # announced, not landed yet
    client.remove(store_key(page_keys(NS, tokens)[gone]), force=True)  # as an eviction would
    got = cache.load(m)
    cache.release(m)
    assert m.num_pages == gone and torch.equal(got, kv(5)[:gone])
    metrics = cache.metrics.snapshot()
    assert metrics.get("hit_tokens_l3", 0) == gone * PAGE == metrics.get("pages_loaded_l3", 0) * PAGE
    assert metrics["lost_tokens_l3"] == (5 - gone) * PAGE and metrics["l3_vanished"] == 1
    # and so in the Prometheus export
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache))
    text = generate_latest(registry).decode()
    assert f'kvpool_cache_lost_tokens_total{{tier="L3"}} {float((5 - gone) * PAGE)}' in text
    assert (f'kvpool_cache_hit_tokens_total{{tier="L3"}} {float(gone * PAGE)}' in text) == bool(gone)


def test_k21_an_l3_match_counts_once_however_often_it_is_loaded(store):
    tokens = list(range(3 * PAGE))
    make(store).insert(tokens, kv(3))
    cache = make(store)
    m = cache.match(tokens)
    cache.load(m, adopt=False)
    cache.load(m, adopt=False)
    cache.release(m)
    assert cache.metrics["hit_tokens_l3"] == 3 * PAGE and cache.metrics["lost_tokens_l3"] == 0


def strided_out(pages):
    """The engine's layout: tokens along a dim of their own, pages a permuted view of it."""
    seq = torch.zeros((SHAPE[0], SHAPE[1], SHAPE[2], pages * PAGE, SHAPE[4]))
    return seq.unflatten(3, (pages, PAGE)).permute(3, 0, 1, 2, 4, 5)


@pytest.mark.parametrize("layout", ["page", "kv"])
def test_mapped_pages_are_copied_once_straight_into_a_strided_out(store, client, layout):
    ns = dataclasses.replace(NS, object_layout=layout)
    tokens = list(range(7 * PAGE))
    make(store, ns).insert(tokens, kv(7))
    cache = make(store, ns)
    cache.l3_tier._copy_pages = 2  # 7 pages: chunks of 2, 2, 2, 1 on two threads
    out = strided_out(7)
    m = cache.match(tokens)
    cache.load(m, out=out, adopt=False)
    cache.release(m)
    assert m.num_pages == 7 and torch.equal(out, kv(7))
    assert cache.metrics["pages_loaded_l3"] == 7
    assert cache.metrics["bytes_loaded_l3"] == kv(7).numel() * 4
    assert cache.l3_tier._load_rows.rows(0).shape[0] == 0  # no staging row: one copy
    wait_for(lambda: client.stats().open_grants == 0, 5, "every read grant returned")
    cache.close()


def test_mapped_pages_land_in_an_inference_tensor_under_inference_mode(store):
    """An engine makes its KV and loads into it under torch.inference_mode, which holds
    per thread: the helper thread copies in that mode too."""
    tokens = list(range(7 * PAGE))
    make(store).insert(tokens, kv(7))
    cache = make(store)
    cache.l3_tier._copy_pages = 2  # both threads copy
    with torch.inference_mode():
        out = strided_out(7)
        m = cache.match(tokens)
        cache.load(m, out=out, adopt=False)
        cache.release(m)
        assert m.num_pages == 7 and torch.equal(out, kv(7))
        cache.placement._copy_pages = 2
        cache.insert(tokens, kv(7))  # now from L1, on two threads as well
        out = strided_out(7)
        m = cache.match(tokens)
        cache.load(m, out=out)
        cache.release(m)
        assert m.tiers == ["L1"] * 7 and torch.equal(out, kv(7))
    cache.close()


def _damage(client, key, how):
    """Change the stored object ``key`` as a faulty writer, a remount or an eviction would."""
    if how == "vanished":
        client.remove(key, force=True)
        return
    blob = bytearray(client.get(key))
    if how == "checksum":
        blob[HEADER_SIZE + 5] ^= 0x40
    elif how == "length":
        blob += b"x"
    elif how == "truncated":
        del blob[-1]
    client.upsert(key, bytes(blob))


@pytest.mark.parametrize("how", ["checksum", "length", "truncated", "vanished", "page_key"])
def test_a_bad_mapped_page_in_a_later_chunk_cuts_the_load_there(store, client, how):
    tokens = list(range(7 * PAGE))
    make(store).insert(tokens, kv(7))
    keys = [store_key(k) for k in page_keys(NS, tokens)]
    cache = make(store)
    cache.l3_tier._copy_pages = 2  # page 5 is in the third chunk
    m = cache.match(tokens)
    assert m.num_pages == 7
    if how == "page_key":  # another page's bytes under page 5's key
        client.upsert(keys[5], client.get(keys[4]))
    else:  # between the match and the load
        _damage(client, keys[5], how)
    got = cache.load(m, out=strided_out(m.num_pages), adopt=False)
    cache.release(m)
    assert m.num_pages == 5 and torch.equal(got, kv(7)[:5])
    assert cache.metrics["pages_loaded_l3"] == 5 and cache.metrics["hit_tokens_l3"] == 5 * PAGE
    if how == "vanished":  # no view: the staging path reads from page 5 on and finds it gone
        assert cache.metrics["l3_vanished"] == 1
    else:
        assert cache.metrics["page_rejects"] == 1 and cache.metrics[f"page_rejects_{how}"] == 1
    wait_for(lambda: client.stats().open_grants == 0, 5, "every read grant returned")
    cache.close()


@pytest.mark.parametrize("corrupt", [False, True])
@pytest.mark.parametrize("stale", [2, 5])  # chunks of 2 pages: the second and third chunk
def test_pages_whose_grant_did_not_hold_through_the_copy_are_cut(store, client, corrupt, stale):
    """A segment mounted again or a read lease run out while the pages were copied: the
    bytes may be another object's, so the load stops at the first such page ("stale"),
    whatever its own check said (a checksum failure there is the remount's doing)."""
    tokens = list(range(7 * PAGE))
    make(store).insert(tokens, kv(7))
    bad = store_key(page_keys(NS, tokens)[stale])
    if corrupt:
        _damage(client, bad, "checksum")
    cache = make(store)
    cache.l3_tier._copy_pages = 2  # both copy threads at work
    open_views = store.open_views

    def lapsing(keys):
        opened = open_views(keys)
        close = opened.close
        opened.close = lambda: [ok and k != bad for k, ok in zip(keys, close())]
        return opened

    store.open_views = lapsing
    m = cache.match(tokens)
    got = cache.load(m)
    cache.release(m)
    assert m.num_pages == stale and torch.equal(got, kv(7)[:stale])
    assert cache.metrics["page_rejects_stale"] == 1 and cache.metrics["pages_loaded_l3"] == stale
    assert cache.metrics["page_rejects"] == 1  # and not also a checksum reject
    wait_for(lambda: client.stats().open_grants == 0, 5, "every read grant returned")
    cache.close()


def test_views_close_per_key_in_key_order():
    """ObjectViews.close gives each key the flag of its own grant, also when a key
    before it was granted without a view (a page on another host)."""
    from kvpool.cache.l3 import ObjectViews

    class Granted:  # the client's ValueViews: one flag per granted handle, in order
        def close(self):
            return [False, True, False]

    views = ObjectViews([None, memoryview(b"b"), memoryview(b"c"), None], [0, 1, 2], Granted())
    assert views.close() == [False, True, False, False]
    assert views.close() == [False] * 4 and views.views == [None] * 4


def test_a_copy_that_raises_stops_both_threads_and_raises():
    from kvpool.cache.codec import payload_checksum
    from kvpool.cache.viewcopy import CheckedCopier, PageCopy

    prepared, empty = [], payload_checksum([b""])

    def prepare(j):
        prepared.append(j)
        if j == 2:
            raise RuntimeError("bug")
        return PageCopy([torch.zeros(1)], [torch.ones(1)], [memoryview(b"")], [empty])

    copier = CheckedCopier()
    with pytest.raises(RuntimeError, match="bug"):
        copier.copy(1000, prepare, 1)
    assert len(prepared) < 1000  # the other thread stopped claiming pages
    copier.close()


@pytest.mark.parametrize("raising", [False, True])
def test_copy_each_copies_every_page_and_names_each_that_failed(raising):
    """Blocks of several requests form no prefix: every page is copied and checked on
    both threads, and each failed one is named, not only the first (vLLM's whole loads).
    A prepare that raises stops both threads and raises."""
    import threading

    from kvpool.cache.codec import payload_checksum
    from kvpool.cache.viewcopy import CheckedCopier, PageCopy

    src = [np.full(4, j, np.float32) for j in range(40)]
    dst = torch.zeros(40, 4)
    threads, prepared = set(), []
    both = threading.Barrier(2, timeout=10)  # the first two chunks' first pages meet here

    def prepare(j):
        threads.add(threading.current_thread().name)
        prepared.append(j)
        if not raising and j in (0, 3):
            both.wait()
        if raising and j == 2:
            raise RuntimeError("bug")
        stored = payload_checksum([src[j]]) ^ (j in (5, 17, 33))  # three bad checksums
        return PageCopy([dst[j]], [torch.from_numpy(src[j])], [memoryview(src[j])], [stored])

    copier = CheckedCopier()
    if raising:
        with pytest.raises(RuntimeError, match="bug"):
            copier.copy_each(40, prepare, 1)
        assert len(prepared) < 40  # the other thread stopped claiming pages
    else:
        assert copier.copy_each(40, prepare, 3) == [5, 17, 33]
        assert torch.equal(dst, torch.from_numpy(np.stack(src)))  # after a failure too
        assert len(threads) == 2
    copier.close()


def test_the_helper_thread_copies_in_the_callers_grad_mode_and_not_after_close():
    from kvpool.cache.viewcopy import CheckedCopier, PageCopy

    leaf = torch.zeros(8, 4, requires_grad=True)  # in-place writes only under no_grad
    copier = CheckedCopier()
    with torch.no_grad():
        good, why = copier.copy(8, lambda j: PageCopy([leaf[j]], [torch.ones(4)], (), ()), 1)
    assert (good, why) == (8, None) and bool((leaf == 1).all())
    copier.close()
    got = copier.copy(8, lambda j: PageCopy([torch.zeros(1)], [torch.ones(1)], (), ()), 1)
    assert got == (8, None) and copier._helper is None  # the calling thread alone


def test_a_client_on_another_host_than_the_pages_stops_asking_for_views(store, client):
    """Pages that are not mapped here (a client on another host): their grant query for
    views is wasted, so later loads skip views for a while (VIEW_RETRY_LOADS)."""
    from kvpool.cache.l3_tier import VIEW_RETRY_LOADS

    class Elsewhere(StoreBackend):
        asked = 0

        def open_views(self, keys):
            Elsewhere.asked += 1
            opened = super().open_views(keys)
            opened.close()
            opened.views = [None] * len(keys)  # as though every object were on another host
            return opened

    tokens = list(range(3 * PAGE))
    make(store).insert(tokens, kv(3))
    cache = make(Elsewhere(client))
    for _ in range(3):
        m = cache.match(tokens)
        got = cache.load(m, adopt=False)  # L3 every time
        cache.release(m)
        assert m.tiers == ["L3"] * 3 and torch.equal(got, kv(3))
    assert Elsewhere.asked == 1 and cache.l3_tier._skip_views == VIEW_RETRY_LOADS - 2
    wait_for(lambda: client.stats().open_grants == 0, 5, "every read grant returned")
    cache.close()


def test_a_client_without_mapped_segments_reads_through_staging_rows(module_cluster):
    tokens = list(range(3 * PAGE))
    with Client(module_cluster.master_addr, force_tcp=True) as tcp:
        make(StoreBackend(tcp)).insert(tokens, kv(3))
        cache = make(StoreBackend(tcp))
        n, tiers, got = lookup(cache, tokens)
        assert (n, tiers) == (3, ["L3"] * 3) and torch.equal(got, kv(3))
        assert cache.l3_tier._load_rows.rows(0).shape[0] == 3  # read into staging, no view
        assert StoreBackend(tcp).open_views(["x"]) is None  # and no grant query for views
        cache.close()
        tcp.remove_all(force=True)


@pytest.mark.cluster(extra_master_args=["--client-ttl", "2"])
def test_a_node_killed_during_a_mapped_load_gives_its_own_bytes_then_misses(cluster):
    """kill -9 of the node between the views' opening and the copy: the reader's mapping
    outlives the node and nobody can write the segment any more, so the load is byte
    exact (and counted as such); once the master has dropped the dead node's segment
    the same prefix is a miss, not an error, and no page of it is served from L3."""
    tokens = list(range(7 * PAGE))
    with Client(cluster.master_addr) as writer, Client(cluster.master_addr) as reader:
        make(StoreBackend(writer)).insert(tokens, kv(7))
        store = StoreBackend(reader)
        cache, after = make(store), make(store)
        try:
            cache.l3_tier._copy_pages = 2  # both copy threads read the dead node's pages
            open_views = store.open_views
            killed = []

            def killing(keys):
                opened = open_views(keys)
                killed.append(cluster.stop_node(0, kill=True))
                return opened

            store.open_views = killing
            m = cache.match(tokens)
            got = cache.load(m, out=strided_out(m.num_pages), adopt=False)
            cache.release(m)
            assert killed, "the load opened no views"
            assert m.num_pages == 7 and torch.equal(got, kv(7))
            assert cache.metrics["pages_loaded_l3"] == 7 and cache.metrics["page_rejects"] == 0
            store.open_views = open_views
            wait_for(lambda: not reader.stats().segments, 30, "the master drops the dead node's segment")
            assert lookup(after, tokens)[0] == 0
            assert after.metrics["pages_loaded_l3"] == 0 and after.metrics["l3_errors"] == 0
        finally:
            cache.close()
            after.close()
