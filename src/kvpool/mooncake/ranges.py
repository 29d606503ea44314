"""``get_into_ranges``: byte ranges of many objects into registered buffers, in one batch.

One replica-list RPC for all keys, then only the requested ranges move, straight into the
registered buffers, each checked against its key's lease (the native client's
``batch_read_ranges``). Mooncake's shape conventions (RealClient::get_into_ranges): a
top-level length mismatch fills the whole result with -600; a fragment outside the object
or the buffer is -600 and moves nothing; an empty fragment is 0.
"""

from __future__ import annotations

from typing import Sequence

from kvpool.client import Client, ReadHandle
from kvpool.errors import KVPoolError
from kvpool.mooncake.buffers import RegisteredBuffers
from kvpool.mooncake.convert import INVALID, as_int, as_keys


def get_into_ranges(client: Client | None, buffers: RegisteredBuffers, buffer_ptrs: Sequence[int], all_keys,
                    all_dst_offsets, all_src_offsets, all_sizes) -> list[list[list[int]]]:
    """Bytes copied (or a negative code) per (buffer, key, fragment), in the input's shape;
    see ``MooncakeDistributedStore.get_into_ranges``. ``client`` None (not set up): -600."""
    n = len(buffer_ptrs)
    if client is None or not n == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) == len(all_sizes):
        return _invalid_like(n, all_keys, all_dst_offsets)
    rows = [as_keys(keys) for keys in all_keys]  # TypeError for a row that is one str
    handles = _query_all(client, {k for keys in rows for k in keys if k is not None})
    out, reads = [], []  # reads: (codes row to fill, handle, [(fragment index, src, view)])
    for i, ptr in enumerate(buffer_ptrs):
        ptr = as_int("buffer_ptr", ptr)
        row = []
        for j, key in enumerate(rows[i]):
            dsts, srcs, sizes = all_dst_offsets[i][j], all_src_offsets[i][j], all_sizes[i][j]
            handle = handles.get(key, INVALID) if len(dsts) == len(srcs) == len(sizes) else INVALID
            if isinstance(handle, int):
                row.append([handle] * len(dsts))
                continue
            codes, frags = _plan_ranges(buffers, ptr, handle.size, dsts, srcs, sizes)
            row.append(codes)
            if frags:
                reads.append((codes, handle, frags))
        out.append(row)
    try:
        _read_ranges(client, reads)
    finally:  # a key whose every fragment was refused is never read: its grant goes back
        client.release([h for h in handles.values() if isinstance(h, ReadHandle)])
    return out


def _invalid_like(n_buffers: int, all_keys, all_dst_offsets) -> list:
    """get_into_ranges' result shape filled with -600 (for a call that is malformed)."""
    out = []
    for i in range(n_buffers):
        keys = all_keys[i] if i < len(all_keys) else []
        dsts = all_dst_offsets[i] if i < len(all_dst_offsets) else []
        out.append([[INVALID] * (len(dsts[j]) if j < len(dsts) else 0) for j in range(len(keys))])
    return out


def _plan_ranges(buffers: RegisteredBuffers, ptr: int, value_size: int, dsts, srcs, sizes) -> tuple[list[int], list]:
    """Codes per fragment (-600 where the range is outside the object or the
    registered memory, 0 for an empty one) and the fragments to read."""
    codes, frags = [INVALID] * len(dsts), []
    for k, (dst, src, size) in enumerate(zip(dsts, srcs, sizes)):
        if min(dst, src, size) < 0 or src + size > value_size:
            continue
        view = buffers.view(ptr + dst, size)
        if view is None:
            continue
        if size == 0:
            codes[k] = 0
        else:
            frags.append((k, src, view))
    return codes, frags


def _read_ranges(client: Client, reads: list) -> None:
    """Run every planned fragment in one batch and write results into the rows."""
    if not reads:
        return
    try:
        results = client.batch_read_ranges([h for _, h, _ in reads],
                                           [[(src, view) for _, src, view in frags] for _, _, frags in reads])
    except KVPoolError as exc:
        results = [[int(exc.code)] * len(frags) for _, _, frags in reads]
    for (codes, _, frags), got in zip(reads, results):
        for (k, _, _), n in zip(frags, got):
            codes[k] = int(n)


def _query_all(client: Client, keys: set[str]) -> dict[str, ReadHandle | int]:
    """{key: ReadHandle, or a negative code} for every key of ``keys`` (well-formed,
    :func:`as_key`'s), in one RPC."""
    wanted = sorted(keys)
    if not wanted:
        return {}
    try:
        handles = client.batch_query(wanted)
    except KVPoolError as exc:
        return {k: int(exc.code) for k in wanted}
    return {k: h if isinstance(h, ReadHandle) else int(h) for k, h in zip(wanted, handles)}
