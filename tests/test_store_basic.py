"""Put/get/remove through real processes, over shared memory and over TCP."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvpool.client import Client
from kvpool.errors import (
    BufferOverflow, ErrorCode, InvalidParams, ObjectExists, ObjectHasLease, ObjectNotFound,
)


@pytest.fixture(params=["shm", "tcp", "shm-put-start"])
def any_client(request, module_cluster):
    """A client over shm, over TCP, or over shm with every put through PutStart/PutEnd
    (no allocation leases)."""
    with Client(module_cluster.master_addr, force_tcp=request.param == "tcp",
                alloc_leases=request.param != "shm-put-start") as c:
        yield c
        c.remove_all(force=True)


def test_put_get_roundtrip_bytes_and_numpy(any_client):
    value = os.urandom(1 << 20)
    assert any_client.put("a", value) == 1
    assert any_client.get("a") == value
    arr = np.arange(1000, dtype=np.float32).reshape(10, 100)
    any_client.put("arr", arr)
    out = np.empty_like(arr)
    assert any_client.get_into("arr", out) == arr.nbytes
    assert np.array_equal(out, arr)
    assert any_client.get_size("arr") == arr.nbytes


def test_get_into_too_small_buffer_is_refused(any_client):
    any_client.put("k", b"x" * 100)
    with pytest.raises(BufferOverflow):
        any_client.get_into("k", bytearray(99))


def test_batch_put_get_is_exist_remove(any_client):
    keys = [f"page/{i}" for i in range(128)]
    values = [os.urandom(4096 + i) for i in range(128)]
    assert any_client.batch_put(keys, values) == [ErrorCode.OK] * 128
    assert any_client.batch_get(keys + ["missing"]) == values + [None]
    assert any_client.batch_is_exist(["missing", keys[5]]) == [False, True]
    bufs = [bytearray(8192) for _ in keys]
    sizes = any_client.batch_get_into(keys, bufs)
    assert sizes == [len(v) for v in values]
    assert all(bytes(b[:n]) == v for b, n, v in zip(bufs, sizes, values))
    codes = any_client.batch_remove(keys[:2] + ["missing"], force=True)
    assert codes == [ErrorCode.OK, ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND]


@pytest.mark.parametrize("leases", [True, False])
def test_batch_of_128_is_a_few_rpcs(module_cluster, leases):
    keys = [f"rpc/{i}" for i in range(128)]
    with Client(module_cluster.master_addr, alloc_leases=leases) as client:
        before = client.stats().counters
        client.batch_put(keys, [b"v" * 64] * 128)
        client.batch_get(keys)
        after = client.stats().counters
        client.remove_all(force=True)
    # one AllocLease and one PutCommit, or one BatchPutStart and one BatchPutEnd; one
    # BatchGetReplicaList: 128 puts, 128 read leases
    committed = "put_commit" if leases else "put_end"
    assert after[committed] - before.get(committed, 0) == 128
    assert after["leases_granted"] - before.get("leases_granted", 0) == 128


def test_k01_put_on_existing_key_raises_and_upsert_replaces(any_client):
    any_client.put("k", b"A" * 10)
    with pytest.raises(ObjectExists):
        any_client.put("k", b"B" * 10)
    assert any_client.get("k") == b"A" * 10
    any_client.upsert("k", b"C" * 20)
    assert any_client.get("k") == b"C" * 20


def test_k03_batch_get_duplicates_fill_both_slots(any_client):
    any_client.put("dup", b"V" * 1000)
    assert any_client.batch_get(["dup", "dup"]) == [b"V" * 1000] * 2
    bufs = [bytearray(1000), bytearray(1000)]
    assert any_client.batch_get_into(["dup", "dup"], bufs) == [1000, 1000]
    assert bufs[0] == bufs[1] == b"V" * 1000


def test_k09_empty_value_and_empty_key_are_refused_missing_key_is_not_found(any_client):
    with pytest.raises(InvalidParams):
        any_client.put("empty", b"")
    with pytest.raises(InvalidParams):
        any_client.put("", b"x")
    with pytest.raises(ObjectNotFound):
        any_client.get("empty")
    assert any_client.batch_put(["e1", "", "e2"], [b"", b"x", b"y"]) == [
        ErrorCode.INVALID_PARAMS, ErrorCode.INVALID_PARAMS, ErrorCode.OK]



def test_one_key_string_where_a_list_of_keys_belongs_is_refused_not_split(any_client):
    """``batch_get("ab")`` would otherwise read keys "a" and "b"; nothing is stored."""
    for call in (lambda: any_client.batch_put("ab", [b"1", b"2"], upsert=True),
                 lambda: any_client.batch_get("ab"), lambda: any_client.batch_is_exist("ab"),
                 lambda: any_client.batch_remove("ab"), lambda: any_client.batch_query("ab")):
        with pytest.raises(InvalidParams, match="keys must be a list of str"):
            call()
    assert not any_client.is_exist("a") and not any_client.is_exist("b")


@pytest.mark.parametrize("keys", [None, 7])
def test_keys_that_are_not_a_list_at_all_are_invalid_params(any_client, keys):
    for call in (lambda: any_client.batch_get(keys), lambda: any_client.batch_is_exist(keys),
                 lambda: any_client.batch_remove(keys), lambda: any_client.batch_query(keys),
                 lambda: any_client.batch_put(keys, [b"1"]), lambda: any_client.batch_get_into(keys, [bytearray(1)]),
                 lambda: any_client.batch_put_from(keys, [b"1"], [1])):
        with pytest.raises(InvalidParams, match="keys must be a list of str, not "):
            call()
    with pytest.raises(InvalidParams, match="as many buffers and sizes as keys"):
        any_client.batch_put_from(["k"], keys, [1])


def test_a_generator_of_keys_is_read_once_and_acted_on(any_client):
    """A batch call takes any iterable of keys; a generator is not read twice (a second
    pass, empty, would answer [] and touch nothing)."""
    assert any_client.batch_put((k for k in ["g1", "g2"]), [b"1", b"2"]) == [ErrorCode.OK] * 2
    assert any_client.batch_is_exist(k for k in ["g1", "nope"]) == [True, False]
    assert [h.size for h in any_client.batch_query(k for k in ["g1", "g2"])] == [1, 1]
    assert any_client.batch_get(k for k in ["g1", "g2"]) == [b"1", b"2"]
    assert any_client.batch_remove((k for k in ["g1", "g2"]), force=True) == [ErrorCode.OK] * 2
    assert not any_client.is_exist("g1")


def test_remove_refuses_leased_object_unless_forced(any_client):
    any_client.put("leased", b"x" * 10)
    any_client.get("leased")
    with pytest.raises(ObjectHasLease):
        any_client.remove("leased")
    any_client.remove("leased", force=True)
    assert not any_client.is_exist("leased")
    with pytest.raises(ObjectNotFound):
        any_client.remove("leased")


def test_put_grants_no_lease_so_remove_works(any_client):
    any_client.put("fresh", b"x" * 10)
    any_client.remove("fresh")
    assert not any_client.is_exist("fresh")
