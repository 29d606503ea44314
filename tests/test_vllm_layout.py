"""vLLM block layouts <-> kvpool's stored page, and the page rows of a batch (no vLLM).

The CUDA flash-attention layout is exercised on CPU tensors of its shape; the same
functions run on a device tensor where one is lent.
"""

from __future__ import annotations

import pytest
import torch

from kvpool.cache.codec import HEADER_SIZE
from kvpool.errors import ErrorCode, InvalidParams
from kvpool.integrations.objects import PageRows, engine_page_key
from kvpool.integrations.vllm import layout as L

NB, H, B, D = 7, 3, 32, 8


def cpu_cache() -> torch.Tensor:
    return torch.randn(NB, H, B, 2 * D)


def flash_cache() -> torch.Tensor:
    return torch.randn(2, NB, B, H, D)


def test_cpu_block_view_is_k_rows_then_v_rows_per_head():
    kv = cpu_cache()
    view = L.block_view(kv, L.CPU, B)
    assert view.shape == (NB, 2, H, B, D)
    assert view.data_ptr() == kv.data_ptr()  # a view, no copy
    rows = kv[4, 1].reshape(2 * B, D)  # vLLM CPU attention: [H, 2*B, D], K rows then V rows
    assert torch.equal(view[4, 0, 1], rows[:B])
    assert torch.equal(view[4, 1, 1], rows[B:])


def test_flash_block_view_matches_the_kv_planes():
    kv = flash_cache()
    view = L.block_view(kv, L.FLASH, B)
    assert view.shape == (NB, 2, H, B, D)
    for kv_index in (0, 1):
        assert torch.equal(view[5, kv_index, 2], kv[kv_index, 5, :, 2, :])


@pytest.mark.parametrize("layout,make", [(L.CPU, cpu_cache), (L.FLASH, flash_cache)])
def test_gather_then_scatter_round_trips_blocks_between_two_caches(layout, make):
    src, dst = make(), torch.zeros_like(make())
    assert L.detect_layout(src, B) == layout
    ids_src, ids_dst = [6, 0, 3], [1, 5, 2]
    pages = torch.empty(len(ids_src), 2, H, B, D)
    L.gather_blocks(L.block_view(src, layout, B), ids_src, pages)
    L.scatter_blocks(L.block_view(dst, layout, B), ids_dst, pages)
    sv, dv = L.block_view(src, layout, B), L.block_view(dst, layout, B)
    for s, d in zip(ids_src, ids_dst):
        assert torch.equal(dv[d], sv[s])
    untouched = [i for i in range(NB) if i not in ids_dst]
    assert not dv[untouched].any()


def test_cpu_and_flash_caches_of_the_same_kv_store_the_same_page():
    flash = flash_cache()
    cpu = torch.empty(NB, H, B, 2 * D)
    L.block_view(cpu, L.CPU, B).copy_(L.block_view(flash, L.FLASH, B))
    a, b = torch.empty(1, 2, H, B, D), torch.empty(1, 2, H, B, D)
    L.gather_blocks(L.block_view(cpu, L.CPU, B), [3], a)
    L.gather_blocks(L.block_view(flash, L.FLASH, B), [3], b)
    assert torch.equal(a, b)


def test_shapes_that_fit_no_layout_are_refused():
    with pytest.raises(InvalidParams):
        L.detect_layout(torch.zeros(NB, H, 16, 2 * D), B)
    with pytest.raises(InvalidParams):
        L.block_view(torch.zeros(3, NB, B, H, D), L.FLASH, B)
    with pytest.raises(InvalidParams):
        L.block_view(cpu_cache(), "other", B)


def test_page_rows_seal_and_check_each_row():
    rows = PageRows(3, (2, 2, H, B, D), torch.float32)
    rows.payload().copy_(torch.randn(3, 2, 2, H, B, D))
    ns = bytes(32)
    headers = [rows.header(ns, engine_page_key(ns, bytes([i]) * 32), i, B) for i in range(3)]
    for i, h in enumerate(headers):
        rows.seal(i, h)
    assert [rows.check(i, h, rows.row_bytes) for i, h in enumerate(headers)] == ["", "", ""]
    assert rows.check(0, headers[1], rows.row_bytes) == "page_key"
    assert rows.check(0, headers[0], -704) == "missing"
    # a node that did not answer is not an eviction: the label says which (metrics honest)
    assert rows.check(0, headers[0], int(ErrorCode.TRANSFER_FAIL)) == "transfer_fail"
    assert rows.check(0, headers[0], int(ErrorCode.LEASE_EXPIRED)) == "lease_expired"
    assert rows.check(0, headers[0], -12345) == "-12345"  # a newer peer's code, named as sent
    assert rows.check(0, headers[0], rows.row_bytes - 1) == "length"
    rows.buf[2, HEADER_SIZE + 5] ^= 0xFF
    assert rows.check(2, headers[2], rows.row_bytes) == "checksum"
    other_ns = rows.header(b"\1" * 32, headers[1].page_key, 1, B)
    assert rows.check(1, other_ns, rows.row_bytes) == "namespace"
