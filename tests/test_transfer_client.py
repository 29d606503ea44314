"""The client's data path: registered buffers (numpy, bytearray, torch), zero-copy
put_from / get_into and batch forms over shared memory, TCP and this process's own
segment; destinations too small; one master RPC per batch step."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvpool.client import Client
from kvpool.client.pipeline import get_spans, put_spans
from kvpool.errors import BufferOverflow, ErrorCode, InvalidParams
from kvpool.rpc import RpcChannel
from proc_helpers import in_threads

MODES = ["shm", "tcp", "local"]


@pytest.fixture(scope="module", params=MODES)
def store(request, module_cluster):
    """A client per transport: mapped shared memory, forced TCP, or a segment it hosts
    itself (objects placed on it with preferred_segment, read by local memcpy)."""
    own = 8 << 20 if request.param == "local" else 0
    with Client(module_cluster.master_addr, force_tcp=request.param == "tcp", global_segment_size=own) as c:
        c.mode = request.param
        yield c


def _put_kw(c: Client) -> dict:
    return {"preferred_segment": c.segment.info.name} if c.mode == "local" else {}


def _route(c: Client, key: str) -> str:
    return c._ranked(c.query(key).replicas)[0][1].name


def test_registered_numpy_bytearray_and_torch_buffers_round_trip(store):
    torch = pytest.importorskip("torch")
    rng = random.Random(11)
    sources = [
        np.frombuffer(rng.randbytes(50_001), np.uint8),
        bytearray(rng.randbytes(4096)),
        torch.randn(3, 257, dtype=torch.float32),
        torch.randn(2, 1000).to(torch.bfloat16),
    ]
    for i, src in enumerate(sources):
        key = f"reg-{store.mode}-{i}"
        reg = store.register_buffer(src)
        assert store.put_from(key, reg, reg.nbytes, **_put_kw(store)) == 1
        assert _route(store, key) == store.mode
        out = torch.zeros_like(src) if isinstance(src, torch.Tensor) else np.zeros(reg.nbytes, np.uint8)
        dst = store.register_buffer(out)
        assert store.get_into(key, dst) == reg.nbytes
        if isinstance(src, torch.Tensor):
            assert torch.equal(out, src)
        else:
            assert bytes(out) == bytes(src)
        assert store.get(key) == bytes(reg.view)
        assert store.unregister_buffer(reg) and store.unregister_buffer(dst)
    store.remove_all(force=True)


def test_put_from_offsets_and_unaligned_views_are_byte_exact(store):
    rng = random.Random(5)
    base = np.frombuffer(rng.randbytes(1 << 20), np.uint8)
    reg = store.register_buffer(base)
    for j in range(20):
        off, size = rng.randint(0, 4095), rng.randint(1, 200_000)
        key = f"off-{store.mode}-{j}"
        store.put_from(key, reg, size, offset=off, **_put_kw(store))
        landing = np.zeros(size + 7, np.uint8)
        assert store.get_into(key, landing[7:]) == size  # a destination at an odd address
        assert np.array_equal(landing[7:], base[off : off + size]) and not landing[:7].any()
    with pytest.raises(InvalidParams):
        store.put_from("too-far", reg, 2, offset=(1 << 20) - 1)
    with pytest.raises(InvalidParams):
        store.put_from("empty", reg, 0)
    store.remove_all(force=True)


def test_destination_too_small_is_refused_and_nothing_is_written_past_it(store):
    key = f"small-dst-{store.mode}"
    store.put(key, b"x" * 1000, **_put_kw(store))
    arena = bytearray(b"G" * 2000)
    with pytest.raises(BufferOverflow):
        store.get_into(key, memoryview(arena)[:999])
    assert arena == b"G" * 2000
    codes = store.batch_get_into([key, key], [memoryview(arena)[:10], memoryview(arena)[1000:2000]])
    assert codes == [ErrorCode.BUFFER_OVERFLOW, 1000]
    assert arena[:1000] == b"G" * 1000 and arena[1000:] == b"x" * 1000
    with pytest.raises(InvalidParams):
        store.get_into(key, store.register_buffer(b"read-only" * 200))
    store.remove_all(force=True)


def test_batch_forms_are_byte_exact_with_random_sizes(store):
    rng = random.Random(9)
    sizes = [rng.choice([1, 7, 4096, 65_537, 300_000]) for _ in range(40)]
    values = [np.frombuffer(rng.randbytes(n), np.uint8) for n in sizes]
    keys = [f"batch-{store.mode}-{i}" for i in range(len(values))]
    kw = _put_kw(store)
    if kw:  # batch_put has no preferred segment: place them one by one
        for k, v in zip(keys, values):
            store.put(k, v, **kw)
    else:
        assert store.batch_put_from(keys, values, sizes) == [ErrorCode.OK] * len(keys)
    dsts = [np.zeros(n + 3, np.uint8) for n in sizes]
    assert store.batch_get_into(keys, dsts) == sizes
    assert all(np.array_equal(d[:n], v) and not d[n:].any() for d, n, v in zip(dsts, sizes, values))
    got = store.batch_get(keys + ["missing"])
    assert [bytes(g) for g in got[:-1]] == [v.tobytes() for v in values] and got[-1] is None
    assert store.batch_put_from(["bad-size"], [values[0]], [sizes[0] + 1]) == [ErrorCode.INVALID_PARAMS]
    store.remove_all(force=True)


def test_tcp_get_of_a_large_value_is_exact(module_cluster):
    value = np.frombuffer(random.Random(1).randbytes(9 << 20), np.uint8)
    with Client(module_cluster.master_addr, force_tcp=True) as c:
        c.put("large-tcp", value)
        got = c.get("large-tcp")
        assert isinstance(got, bytes) and got == value.tobytes()
        dst = np.empty_like(value)
        assert c.get_into("large-tcp", dst) == value.nbytes and np.array_equal(dst, value)
        c.remove("large-tcp", force=True)


@pytest.mark.parametrize("leases", [True, False])
def test_a_batch_costs_one_rpc_per_step_and_chunk(module_cluster, monkeypatch, leases):
    """A lease's batch put of small values: one PutCommit (the PutStart way: one
    BatchPutStart and one BatchPutEnd); a batch get: one BatchGetReplicaList per
    pipelined chunk (:mod:`kvpool.client.pipeline`)."""
    sent = []
    real_call = RpcChannel.call

    def counting_call(self, request, *args):  # a ReadDone riding along is no RPC of its own
        sent.append(type(request).__name__)
        return real_call(self, request, *args)

    monkeypatch.setattr(RpcChannel, "call", counting_call)
    keys = [f"rpc-{i}" for i in range(128)]
    pages = [np.full(4096, i, np.uint8) for i in range(128)]
    with Client(module_cluster.master_addr, force_tcp=True, alloc_leases=leases) as c:
        sent.clear()
        assert c.batch_put_from(keys[:64], pages[:64], [4096] * 64) == [ErrorCode.OK] * 64
        assert put_spans(64, 4096, in_place=False) == [(0, 64)]  # small values over TCP: one chunk
        assert sent == (["AllocLease", "PutCommit"] if leases else ["BatchPutStart", "BatchPutEnd"])
        sent.clear()
        assert c.batch_put_from(keys[64:], pages[64:], [4096] * 64) == [ErrorCode.OK] * 64
        assert sent == (["PutCommit"] if leases else ["BatchPutStart", "BatchPutEnd"])  # the same lease
        sent.clear()
        dsts = [np.empty(4096, np.uint8) for _ in keys]
        assert c.batch_get_into(keys, dsts) == [4096] * 128
        assert c.batch_get(keys[:64]) == [p.tobytes() for p in pages[:64]]
        assert sent == ["BatchGetReplicaList"] * (len(get_spans(128, 4096)) + len(get_spans(64, 0)))
        assert all(np.array_equal(d, p) for d, p in zip(dsts, pages))
        c.batch_remove(keys, force=True)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA is not available here")
def test_cuda_tensor_is_staged_through_pinned_memory(module_cluster):
    import torch

    src = torch.arange(4096, dtype=torch.float32, device="cuda")
    with Client(module_cluster.master_addr) as c:
        c.put_from("cuda", c.register_buffer(src), src.numel() * 4)
        out = torch.zeros_like(src)
        assert c.get_into("cuda", c.register_buffer(out)) == src.numel() * 4
        assert torch.equal(out, src)
        c.remove("cuda", force=True)



@pytest.mark.cluster(segment_size="256MiB")
def test_threads_sharing_a_client_share_its_connection_pool_safely(cluster):
    """Four threads, small and sliced (≥ 8 MiB) values, one force_tcp client: every
    byte lands where it belongs (no two transfers ever share a socket)."""
    sizes = [4096, 300_000, 9 << 20]
    with Client(cluster.master_addr, force_tcp=True) as c:
        def worker(t):
            rng = random.Random(t)
            for j, size in enumerate(sizes * 2):
                value = np.frombuffer(rng.randbytes(size), np.uint8)
                key = f"thr-{t}-{j}"
                c.put(key, value)
                dst = np.empty(size, np.uint8)
                assert c.get_into(key, dst) == size and np.array_equal(dst, value)
                assert c.get(key) == value.tobytes()
                c.remove(key, force=True)

        assert in_threads(worker, 4, timeout_s=60) == []


def test_warming_maps_same_host_segments_and_allocates_no_holes(cluster, tmp_path):
    from kvpool.transfer.shm import _data_ranges

    with Client(cluster.master_addr) as shm, Client(cluster.master_addr, force_tcp=True) as tcp:
        sizes = sum(s.size for s in shm.stats().segments)
        assert shm.warm_local_segments() >= sizes  # prefaulted nodes: all allocated
        assert tcp.warm_local_segments() == 0
    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(8 << 20)
        f.seek(4 << 20)
        f.write(b"x" * 4096)
    ranges = _data_ranges(str(sparse), 8 << 20)
    assert sum(e - s for s, e in ranges) < (1 << 20) and any(s <= 4 << 20 < e for s, e in ranges)
    assert _data_ranges(str(tmp_path / "missing"), 4096) == []
