"""Transfer engine: every transport and batch form against a real node process
(shared memory and TCP) and a segment hosted in this process (local memcpy)."""

from __future__ import annotations

import random
import socket
import threading
import time

import numpy as np
import pytest

from kvpool import protocol as P
from kvpool.client import Client
from kvpool.transfer import local_host_id
from kvpool.transfer.engine import SLICE_BYTES, TransferEngine, plan_slices, spread
from kvpool.transfer.request import Cancel, Op, TransferRequest, TransferStatus, Transport
from kvpool.transfer.shm import LocalTransport, ShmTransport
from kvpool.transfer.tcp import LANES, LOCAL_LANES, TcpTransport

SEGMENT = 64 << 20


@pytest.fixture(scope="module")
def node_segment(module_cluster):
    """SegmentInfo of the module cluster's node (a separate process)."""
    node = module_cluster.nodes[0]
    return P.SegmentInfo(node["segment"], local_host_id(), node["shm_name"], SEGMENT, node["addr"])


@pytest.fixture(scope="module")
def own_segment(module_cluster):
    """A segment hosted by this process (a client contributing 16 MiB)."""
    with Client(module_cluster.master_addr, global_segment_size=16 << 20) as c:
        yield c.segment.info


def _engine(kind: str) -> TransferEngine:
    transport = {"local": LocalTransport, "shm": ShmTransport, "tcp": TcpTransport}[kind]()
    return TransferEngine([transport], timeout_s=10.0)


def _segment(kind, node_segment, own_segment) -> P.SegmentInfo:
    return own_segment if kind == "local" else node_segment


@pytest.mark.parametrize("kind", ["local", "shm", "tcp"])
def test_every_transport_is_byte_exact_at_random_offsets_and_lengths(kind, node_segment, own_segment):
    segment = _segment(kind, node_segment, own_segment)
    rng = random.Random(7)
    with _engine(kind) as engine:
        for _ in range(4):
            n = rng.randint(1, 24)
            src = np.frombuffer(rng.randbytes(1 << 20), np.uint8)
            # disjoint remote ranges at odd offsets, odd lengths, odd local offsets
            lengths = [rng.randint(1, 30_000) for _ in range(n)]
            remote = sorted(rng.sample(range(0, segment.size - 40_000, 40_000), n))
            local = [rng.randint(0, len(src) - ln) for ln in lengths]
            writes = [TransferRequest(Op.WRITE, memoryview(src), lo, segment, ro, ln)
                      for lo, ro, ln in zip(local, remote, lengths)]
            assert engine.transfer(writes) == [TransferStatus.COMPLETED] * n
            dsts = [bytearray(ln + 3) for ln in lengths]  # unaligned: data lands at offset 3
            reads = [TransferRequest(Op.READ, memoryview(d), 3, segment, ro, ln)
                     for d, ro, ln in zip(dsts, remote, lengths)]
            assert engine.submit(reads).wait(10) == [TransferStatus.COMPLETED] * n
            for d, lo, ln in zip(dsts, local, lengths):
                assert d[3:] == src[lo : lo + ln].tobytes() and d[:3] == b"\0\0\0"


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_invalid_requests_are_refused_before_any_byte_moves(kind, node_segment):
    with _engine(kind) as engine:
        guard = bytearray(b"G" * 64)
        view = memoryview(guard)
        reqs = [
            TransferRequest(Op.READ, view, 0, node_segment, 0, 0),  # 0-length slice
            TransferRequest(Op.READ, view[:16], 0, node_segment, 0, 32),  # destination too small
            TransferRequest(Op.READ, view, 60, node_segment, 0, 8),  # past the buffer's end
            TransferRequest(Op.READ, view, 0, node_segment, SEGMENT - 4, 8),  # past the segment
            TransferRequest(Op.READ, view, 0, node_segment, -1, 8),
            TransferRequest(Op.READ, memoryview(b"ro" * 8), 0, node_segment, 0, 8),  # read-only
            TransferRequest(Op.WRITE, view, 0, node_segment, 2**40, 8),
        ]
        assert engine.transfer(reqs) == [TransferStatus.INVALID] * len(reqs)
        assert guard == b"G" * 64
        ok = TransferRequest(Op.WRITE, view, 0, node_segment, 128, 64)  # a valid one next to them
        assert engine.transfer([reqs[0], ok]) == [TransferStatus.INVALID, TransferStatus.COMPLETED]


def test_large_tcp_transfer_is_sliced_over_parallel_lanes(node_segment):
    size = 6 * SLICE_BYTES + 12345
    src = np.frombuffer(random.Random(3).randbytes(size), np.uint8)
    write = TransferRequest(Op.WRITE, memoryview(src), 0, node_segment, 4096, size)
    lanes = spread([(0, write)], 4)
    assert len(lanes) == 4  # four connections, one slice each
    assert sum(r.length for lane in lanes for _, r in lane) == size
    tcp = TcpTransport()
    tcp.local_lanes = 4  # as to another host, or to this one with 8 cores or more
    with TransferEngine([tcp], timeout_s=10.0) as engine:
        assert engine.transfer([write]) == [TransferStatus.COMPLETED]
        dst = np.zeros(size + 1, np.uint8)
        read = TransferRequest(Op.READ, memoryview(dst), 1, node_segment, 4096, size)
        assert engine.submit([read]).wait() == [TransferStatus.COMPLETED]
        assert np.array_equal(dst[1:], src) and dst[0] == 0


def test_slicing_arithmetic_and_wire_fields_above_4_gib():
    for length in (2**32 + 5, 2**33 - 1, 5 * 2**40 + 3):
        slices = plan_slices(length, 4)
        assert len(slices) == 4 and sum(n for _, n in slices) == length
        assert all(o1 + n1 == o2 for (o1, n1), (o2, _) in zip(slices, slices[1:]))
        assert max(n for _, n in slices) - min(n for _, n in slices) <= 1
    assert plan_slices(3 * SLICE_BYTES - 1, 4) == [(0, (3 * SLICE_BYTES - 1) // 2 + 1),
                                                  ((3 * SLICE_BYTES - 1) // 2 + 1, (3 * SLICE_BYTES - 1) // 2)]
    big_segment = P.SegmentInfo("s", "h", "shm", 2**34, "127.0.0.1:1")
    req = TransferRequest(Op.READ, memoryview(bytearray(1)), 0, big_segment, 2**32 + 7, 2**33)
    pieces = [r for lane in spread([(0, req)], 4) for _, r in lane]
    assert sorted((r.remote_offset, r.local_offset) for r in pieces)[-1] == (2**32 + 7 + 3 * 2**31, 3 * 2**31)
    assert sum(r.length for r in pieces) == 2**33
    for msg, decoder in ((P.DataRead([2**32 + 1, P.MAX_SEGMENT_BYTES], [2**33, 1]), P.data_request_decoder),
                         (P.DataWriteMany([2**40], [2**32 + 9]), P.data_request_decoder),
                         (P.DataResp(0, 2**35 + 1), P.data_reply_decoder)):
        body = P.encode_frame(msg)[P.HEADER.size:]
        assert decoder.decode(body) == msg


class _DictTransport(Transport):
    """A transport the store has never heard of: segments named "mem:*" are dicts here."""

    name, rank = "mem", -1

    def __init__(self):
        self.memory: dict[str, bytearray] = {}

    def can_reach(self, segment):
        return segment.name.startswith("mem:")

    def run(self, requests, deadline, cancel):
        for r in requests:
            mem = self.memory.setdefault(r.segment.name, bytearray(r.segment.size))
            if r.op == Op.WRITE:
                mem[r.remote_offset : r.remote_offset + r.length] = r.local_view()
            else:
                r.local_view()[:] = mem[r.remote_offset : r.remote_offset + r.length]
        return [True] * len(requests)


def test_a_new_transport_plugs_in_without_touching_the_store(node_segment):
    with _engine("tcp") as engine:
        mem = _DictTransport()
        engine.add_transport(mem)
        fake = P.SegmentInfo("mem:0", "elsewhere", "", 1024, "")
        assert engine.route(fake) is mem and engine.route(node_segment).name == "tcp"
        dst = bytearray(5)
        statuses = engine.transfer([TransferRequest(Op.WRITE, memoryview(b"hello"), 0, fake, 10, 5),
                                    TransferRequest(Op.WRITE, memoryview(b"world"), 0, node_segment, 0, 5)])
        assert statuses == [TransferStatus.COMPLETED] * 2
        assert engine.transfer([TransferRequest(Op.READ, memoryview(dst), 0, fake, 10, 5)]) == [0]
        assert dst == b"hello"


def test_unreachable_segment_is_invalid_not_a_hang():
    with TransferEngine([ShmTransport()]) as engine:
        other_host = P.SegmentInfo("x", "another-host/1", "kvpool-nothere", 1024, "127.0.0.1:9")
        assert engine.transfer([TransferRequest(Op.READ, memoryview(bytearray(8)), 0, other_host, 0, 8)]) \
            == [TransferStatus.INVALID]


def test_silent_peer_times_out_within_the_deadline_and_wait_cancels():
    """A peer that accepts and never answers: the batch ends TIMEOUT, nothing hangs."""
    listener = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
    segment = P.SegmentInfo("silent", "another-host/1", "", 1 << 20, f"127.0.0.1:{listener.getsockname()[1]}")
    dst = bytearray(4096)
    with TransferEngine([TcpTransport()]) as engine:
        t0 = time.monotonic()
        assert engine.transfer([TransferRequest(Op.READ, memoryview(dst), 0, segment, 0, 4096)], timeout_s=0.1) \
            == [TransferStatus.TIMEOUT]  # too short a wait to say the peer is silent (a hint's copy)
        assert engine.transfer([TransferRequest(Op.READ, memoryview(dst), 0, segment, 0, 4096)], timeout_s=0.6) \
            == [TransferStatus.TIMEOUT]
        assert time.monotonic() - t0 < 3
        # it timed out once: it is not asked again for a while (SilentPeers), however long the deadline
        reason = engine.transfer([TransferRequest(Op.READ, memoryview(dst), 0, segment, 0, 4096)], timeout_s=60)
        assert reason == [TransferStatus.FAILED] and "not asked for 1 s" in reason.describe(0)
    with TransferEngine([TcpTransport()]) as engine:  # a transport that has not seen it time out
        t0 = time.monotonic()
        handle = engine.submit([TransferRequest(Op.READ, memoryview(dst), 0, segment, 0, 4096)], timeout_s=60)
        assert handle.wait(timeout=0.3) == [TransferStatus.TIMEOUT]  # cancelled long before 60 s
        assert time.monotonic() - t0 < 3 and handle.done()
    listener.close()


def test_a_batch_wider_than_one_sendmsg_is_byte_exact_over_tcp(node_segment):
    """1500 slices: more than IOV_MAX (1024) buffers per gather/scatter call."""
    n, size = 1500, 97
    src = np.frombuffer(random.Random(4).randbytes(n * size), np.uint8)
    with _engine("tcp") as engine:
        writes = [TransferRequest(Op.WRITE, memoryview(src), i * size, node_segment, 1_000_000 + i * 128, size)
                  for i in range(n)]
        assert engine.transfer(writes) == [TransferStatus.COMPLETED] * n
        dst = np.zeros(n * size, np.uint8)
        reads = [TransferRequest(Op.READ, memoryview(dst), i * size, node_segment, 1_000_000 + i * 128, size)
                 for i in range(n)]
        assert engine.transfer(reads) == [TransferStatus.COMPLETED] * n
        assert np.array_equal(dst, src)


def test_tcp_lanes_follow_the_peer():
    # peers at this namespace's own addresses share its cores: one lane per two of
    # them; others (another host, another namespace) get LANES
    tcp = TcpTransport()

    def at(addr: str) -> P.SegmentInfo:
        return P.SegmentInfo("s", "h", "shm", 1 << 20, addr)

    assert tcp.lanes_to(at("127.0.0.1:9")) == tcp.lanes_to(at("[::1]:9")) == LOCAL_LANES
    assert tcp.lanes_to(at("localhost:9")) == LOCAL_LANES
    assert tcp.lanes_to(at("203.0.113.77:9")) == LANES == 4  # TEST-NET-3: held by no one here
    assert 1 <= LOCAL_LANES <= LANES


@pytest.mark.parametrize("kind", ["local", "shm", "tcp"])
def test_the_single_copy_write_and_read_of_every_transport(kind, node_segment, own_segment):
    """write_from / read_into (a single put's and get's copy, no request batch) are byte
    exact, and a range outside the segment moves nothing and says why."""
    segment = _segment(kind, node_segment, own_segment)
    value = memoryview(random.Random(11).randbytes(70_001))
    offset = segment.size - 2 * len(value) - 3
    with _engine(kind) as engine:
        transport = engine.route(segment)
        assert engine.write_from(transport, segment, offset, value)
        back = bytearray(len(value))
        assert engine.read_into(transport, segment, offset, memoryview(back))
        assert back == value
        why = Cancel()
        assert not engine.write_from(transport, segment, segment.size - 10, value, cancel=why)
        assert why.reasons and all("outside" in r or "exceeds" in r for r in why.reasons)
        assert engine.read_into(transport, segment, offset, memoryview(back)) and back == value


def test_a_batch_write_populates_its_span_once_and_scattered_ranges_each():
    """write_many fills the page tables of a batch placed in one lease with one call
    for the whole span (not one per value), and of scattered ranges range by range
    (one span would populate the gaps between them too). Byte exactness of the
    writes themselves: the tests above, through every transport."""
    from kvpool.transfer.shm import populate_ranges

    calls: list[tuple[int, int]] = []
    record = lambda offset, length: calls.append((offset, length))  # noqa: E731
    dense = [(4096 * i, memoryview(bytes([i]) * 4000)) for i in range(128)]
    populate_ranges(record, dense)
    assert calls == [(0, 4096 * 127 + 4000)]
    calls.clear()
    scattered = [(0, memoryview(b"a" * 100)), (1 << 20, memoryview(b"b" * 100))]
    populate_ranges(record, scattered)
    assert calls == [(0, 100), (1 << 20, 100)]


def test_populating_a_mapping_lets_the_process_other_threads_run():
    """Populator.populate leaves the GIL while the kernel fills the page tables
    (~65 ms per GiB here): warm_local_segments runs on a thread beside an engine, and a
    client's own segment is populated behind its start, beside its puts. With a switch
    interval far beyond the call, this thread can run while the populating one is still
    inside it only if the call released the GIL."""
    import mmap
    import sys

    from kvpool.transfer.shm import MADV_POPULATE_WRITE, Populator

    mm = mmap.mmap(-1, 256 << 20)  # ~0.1 s in the call here: time for this thread to be scheduled
    try:
        mm.madvise(MADV_POPULATE_WRITE, 0, mmap.PAGESIZE)
    except OSError:
        mm.close()
        pytest.skip("no MADV_POPULATE_WRITE here (Linux < 5.14): pages fault as they are written")
    populator = Populator(mm, MADV_POPULATE_WRITE)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (populator.populate(0, len(mm)), done.set()))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        thread.start()
        ran_during = not done.is_set()
    finally:
        sys.setswitchinterval(interval)
        thread.join()
        mm.close()
    assert ran_during
    assert all(populator.populated)
