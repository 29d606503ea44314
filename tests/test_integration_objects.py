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
    client.put("p/2", b"x" * 300)  # a size that is not this page's
    assert objs.read(["p/0", "p/1", "p/2"], [header(0, 4024), header(1, 4024), header(2, 100)], dst) \
        == [True, False, False]
    assert objs.rejects == {"checksum": 1, "length": 1}
    assert objs.exists(["p/0", "p/1", "p/2"]) == [True, False, False]
    # a page read under another page's header is refused as well
    assert objs.read(["p/0"], [header(5, 4024)], [[np.zeros(4024, np.uint8)]]) == [False]
    assert objs.rejects["page_key"] == 1


def test_a_stopped_master_costs_the_engines_threads_one_timeout_per_retry_s(caplog):
    """SGLang's prefetch and backup threads and LMCache's calls go through PageObjects:
    a master that stops answering costs one ``timeout_s``, then calls answer all-False
    at once for ``retry_s`` (said once), and the next call after it serves again."""
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
