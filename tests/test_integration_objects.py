"""Checked page objects written from and read into separate regions (the engine adapters'
common path): gather puts, scatter reads, header checks, on a real cluster."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import numpy as np
import pytest

from kvpool.cache.codec import HEADER_SIZE, PageHeader, decode_page
from kvpool.child import pause_process
from kvpool.client import Client
from kvpool.integrations.objects import PageObjects
from kvpool.launch import Cluster

NS = bytes(range(32))


def header(i: int, nbytes: int) -> PageHeader:
    return PageHeader(NS, bytes([i]) * 32, 0, 4, nbytes)


def regions(seed: int, sizes=(1000, 24, 3000)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


@pytest.mark.parametrize("force_tcp", [False, True])
def test_gather_write_then_scatter_read(module_cluster, force_tcp):
    with Client(module_cluster.master_addr, force_tcp=force_tcp) as c:
        objs = PageObjects(c)
        names = [f"t/{force_tcp}/{i}" for i in range(3)]
        src = [regions(i) for i in range(3)]
        assert objs.write(names, [header(i, 4024) for i in range(3)], src) == [True] * 3
        # the object is header + the regions joined, and decodes as one page
        assert bytes(decode_page(c.get(names[1]), header(1, 4024))) == b"".join(r.tobytes() for r in src[1])
        dst = [[np.zeros(n, np.uint8) for n in (1000, 24, 3000)] for _ in range(3)]
        assert objs.read(names + ["t/absent"], [header(i, 4024) for i in range(4)], dst + [[np.zeros(4024, np.uint8)]]) \
            == [True, True, True, False]
        assert all(np.array_equal(a, b) for page_s, page_d in zip(src, dst) for a, b in zip(page_s, page_d))
        assert objs.write(names[:1], [header(0, 4024)], src[:1]) == [True]  # already there: kept
        c.remove_all(force=True)


def test_bad_pages_are_misses_and_are_removed(client):
    objs = PageObjects(client)
    src = regions(7)
    objs.write(["p/0", "p/1"], [header(0, 4024), header(1, 4024)], [src, src])
    blob = bytearray(client.get("p/1"))
    blob[HEADER_SIZE + 10] ^= 1
    client.upsert("p/1", bytes(blob))
    dst = [[np.zeros(4024, np.uint8)], [np.zeros(4024, np.uint8)], [np.zeros(100, np.uint8)]]
    client.put("p/2", b"x" * 300)  # a size that is not this page's, and no page at all
    assert objs.read(["p/0", "p/1", "p/2"], [header(0, 4024), header(1, 4024), header(2, 100)], dst) \
        == [True, False, False]
    assert objs.rejects == {"checksum": 1, "magic": 1}
    assert objs.exists(["p/0", "p/1", "p/2"]) == [True, False, False]
    # a page read under another page's header is refused as well
    assert objs.read(["p/0"], [header(5, 4024)], [[np.zeros(4024, np.uint8)]]) == [False]
    assert objs.rejects["page_key"] == 1


def test_a_reader_of_another_size_misses_and_leaves_the_page_stored(client, caplog):
    """Buffers of the wrong size (SGLang's generic ``get`` into a wrong target) or a
    header of another length (another engine configuration) are the reader's mismatch:
    a miss, warned, and the stored page stays for the ranks and engines that use it.
    Only an object whose own header does not fit its own bytes is removed."""
    objs = PageObjects(client)
    src = regions(11)
    assert objs.write(["w/0"], [header(0, 4024)], [src]) == [True]
    assert objs.read(["w/0"], [header(0, 4024)], [[np.zeros(10, np.uint8)]]) == [False]
    assert objs.exists(["w/0"]) == [True]
    assert objs.read(["w/0"], [header(0, 100)], [[np.zeros(100, np.uint8)]]) == [False]
    assert objs.exists(["w/0"]) == [True] and not objs.rejects
    assert "the caller's buffers hold 10 bytes" in caplog.text
    assert "is stored with 4152 bytes, this reader expects 228" in caplog.text
    dst = [np.zeros(n, np.uint8) for n in (1000, 24, 3000)]
    assert objs.read(["w/0"], [header(0, 4024)], [dst]) == [True]
    assert all(np.array_equal(a, b) for a, b in zip(src, dst))
    # a write of the wrong size is not stored (no exception: SGLang's set answers a bool)
    assert objs.write(["w/1", "w/2"], [header(1, 4024), header(2, 4024)], [src, src[:1]]) == [True, False]
    assert objs.exists(["w/1", "w/2"]) == [True, False]
    # objects that are not sound in themselves are removed: cut short, shorter than a header
    client.put("w/3", bytes(client.get("w/0"))[:HEADER_SIZE + 100])
    client.put("w/4", b"x" * 50)
    assert objs.read(["w/3", "w/4"], [header(0, 4024), header(4, 4024)], [[np.zeros(4024, np.uint8)]] * 2) \
        == [False, False]
    assert objs.rejects == {"length": 1, "truncated": 1}
    assert objs.exists(["w/0", "w/3", "w/4"]) == [True, False, False]


def test_a_stopped_master_costs_the_engines_threads_one_timeout_per_retry_s(caplog):
    """SGLang's prefetch and backup threads and LMCache's calls go through PageObjects:
    a master that stops answering costs one ``timeout_s``, then calls answer all-False
    at once for ``retry_s`` (said once), and the next call after it serves again, as do
    the calls right after that one (they do not wait out the retry_s its probe set)."""
    caplog.set_level(logging.INFO, logger="kvpool.integrations.objects")
    clock = [0.0]
    with Cluster(segment_size="16MiB") as cluster, Client(cluster.master_addr, timeout_s=1.0) as c:
        objs = PageObjects(c, retry_s=30.0, clock=lambda: clock[0])
        src, page = regions(3), [header(0, 4024)]
        assert objs.write(["s/0"], page, [src]) == [True]
        master = cluster.master.proc.pid
        assert pause_process(master)
        try:
            assert objs.exists(["s/0"]) == [False]  # found out: one timeout
            started = time.monotonic()
            for _ in range(5):  # each of these waited timeout_s before
                assert objs.exists(["s/0"]) == [False]
                assert objs.write(["s/1"], page, [src]) == [False]
                assert objs.read(["s/0"], page, [[np.zeros(4024, np.uint8)]]) == [False]
            assert time.monotonic() - started < 1.0
            clock[0] += 31.0  # due: one thread asks the master again, the others skip
            waits = []

            def timed_exists():
                began = time.monotonic()
                assert objs.exists(["s/0"]) == [False]
                waits.append(time.monotonic() - began)

            threads = [threading.Thread(target=timed_exists) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sum(w > 0.5 for w in waits) == 1, waits
        finally:
            os.kill(master, signal.SIGCONT)
        assert caplog.text.count("the master did not answer") == 1
        clock[0] += 31.0
        dst = [np.zeros(n, np.uint8) for n in (1000, 24, 3000)]
        assert objs.read(["s/0"], page, [dst]) == [True]
        assert all(np.array_equal(a, b) for a, b in zip(src, dst))
        assert "loading and saving pages resumes" in caplog.text
        clock[0] += 0.1
        assert objs.exists(["s/0"]) == [True]
        assert objs.write(["s/1"], page, [src]) == [True]
