"""Checked page objects written from and read into separate regions (the engine adapters'
common path): gather puts, scatter reads, header checks, on a real cluster."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.cache.codec import HEADER_SIZE, PageHeader, decode_page
from kvpool.client import Client
from kvpool.integrations.objects import PageObjects

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
