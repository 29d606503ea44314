"""Pipelined batches: a batch cut into chunks, so that the master's work on one chunk
overlaps this client's copies of another.

A batch get asks for the replica lists of chunk k+1 while it copies chunk k
(:meth:`~kvpool.rpc.RpcChannel.call` with ``during``); a batch put commits chunk k
while it writes chunk k+1. Every invariant of the unpipelined batch holds chunk by
chunk: a commit is sent only after its chunk's bytes are written (invisible until
complete), each copy is checked against its own grant, and every code is known
before the call returns. One thing differs: when no master answers a batch put's
commit any more, the chunks committed before stay committed (the call raises; a retry
finds them as OBJECT_ALREADY_EXISTS), where one commit was applied whole or not at
all. A get's query and a put's commit are asked again after a broken connection (both
are idempotent: the master answers OK for an item it committed just before) and the chunk
whose copy was to overlap it is copied all the same. The master and the client run on different cores, so
the master's share of a batch (per key: a lookup or a commit, and its reply) leaves
the critical path, except for the first query of a get and the last commit of a put.
Which side's share is worth hiding depends on the value size: a get's query costs the
master a few microseconds a key whatever the size, so only gets of small values are
pipelined (:func:`get_spans`); a put's commit costs the master more than a small
value's copy costs the client, so only puts of many large values copied in this process
are (:func:`put_spans`). A batch has one
deadline for all its copies (:func:`left`): a node that stopped answering costs the
client's timeout once, not once per chunk.
Hence the chunk sizes: the exposed chunk is small, the next ones grow fourfold (each
query or commit then takes no longer than the copies it overlaps), and no chunk
holds more than a third of the rest, so that the master is never left idle long.

Measured (2-core VM, in-process segment, 128 x 4 KiB): a batch get spends
5-9 us a key in the query and 4-6 us in the copies when they run one after the other.
"""

from __future__ import annotations

import time

MIN_KEYS = 32  # fewer keys of small values: one RPC costs about what it would hide
MIN_BYTES = 2 << 20  # or this many bytes: two 1 MiB copies already hide a round trip
LARGE_VALUE = 64 << 10  # bytes; one such copy already outlasts a round trip
FIRST_KEYS = 8  # keys of the exposed chunk of small values
GROWTH = 4


def spans(count: int, item_bytes: int) -> list[tuple[int, int]]:
    """The chunks of a batch of ``count`` items of about ``item_bytes`` bytes each, as
    [start, end) index pairs in order, the exposed (first) chunk first. One chunk when
    pipelining would not pay (fewer than MIN_KEYS items and MIN_BYTES bytes).
    A put uses them reversed: its exposed chunk is the last one."""
    if count <= 1 or (count < MIN_KEYS and count * item_bytes < MIN_BYTES):
        return [(0, count)]
    first = 1 if item_bytes >= LARGE_VALUE else min(FIRST_KEYS, count)
    cap = max(first, -(-(count - first) // 3))
    out, start, size = [], 0, first
    while start < count:
        end = min(count, start + size)
        out.append((start, end))
        start, size = end, min(cap, size * GROWTH)
    return out


def get_spans(count: int, item_bytes: int) -> list[tuple[int, int]]:
    """The chunks of a batch get of values of about ``item_bytes`` bytes (0: unknown):
    :func:`spans` for values under LARGE_VALUE bytes, else one chunk. A large value's
    copy dwarfs its share of the query (1 MiB: ~100 us against 2-3 us), so chunks
    would only add round trips: in-process 16 x 1 MiB, 1.05 -> 0.87 of Mooncake."""
    return [(0, count)] if item_bytes >= LARGE_VALUE else spans(count, item_bytes)


def put_spans(count: int, item_bytes: int, in_place: bool) -> list[tuple[int, int]]:
    """The chunks of a batch put, in the order written and committed: the sizes of
    :func:`spans` reversed (the exposed commit is the last, small one), the keys in
    their order. Pipelined only where it paid when measured (2-core VM, ``bench store
    --quick``, one chunk against pipelined, means of three or four runs each): values
    of at least LARGE_VALUE bytes, at least MIN_KEYS of them, copied in this process's
    memory (``in_place``: a same-host segment). Otherwise one chunk:

    - smaller values: their commits cost the master more than their copies cost this
      client, so there is little to hide and each chunk's extra round trip is lost
      (128 x 4 KiB in-process, 28-31k keys/s in five chunks against 31-37k in one);
    - fewer keys: a commit of a few keys costs the master little, and running it
      beside the copies only took a core from them (16 x 1 MiB: in-process 5.3 -> 6.5
      GB/s in one chunk, shared memory 5.6 -> 6.4);
    - over TCP: each chunk's write is a request and reply of its own, the stream drains
      and the node waits between them (16 x 1 MiB 2.6 -> 3.0 GB/s in one chunk,
      128 x 64 KiB 1.3 -> 1.5; 128 x 1 MiB 3.2 -> 3.3).

    Where it stays: 128 x 64 KiB in-process and over shared memory, 2.4 -> 2.5 GB/s
    pipelined (128 x 1 MiB: the same either way)."""
    if item_bytes < LARGE_VALUE or count < MIN_KEYS or not in_place:
        return [(0, count)]
    out, start = [], 0
    for first, end in reversed(spans(count, item_bytes)):  # the sizes reversed, keys in order
        out.append((start, start + end - first))
        start += end - first
    return out


def left(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (time.monotonic), at least 0 (an engine call
    given 0 fails at once); None for None (the engine's own timeout)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Overlap:
    """Work to run during a call (:meth:`~kvpool.rpc.RpcChannel.call`'s ``during``)
    whose exception is kept until the call's reply is read, so the channel stays in
    step and the reply (the next chunk's grants, this chunk's commit codes) is known.
    :meth:`finish` runs the work if the call did not (a broken connection: the retry
    asks again without it) and raises what it raised."""

    def __init__(self, work):
        self.work = work
        self.ran = False
        self.error: BaseException | None = None

    def __call__(self) -> None:
        self.ran = True
        try:
            self.work()
        except BaseException as exc:
            self.error = exc

    def finish(self) -> None:
        if not self.ran:
            self()
        if self.error is not None:
            raise self.error
