"""The same-host copy (kvpool.transfer.memcopy): streaming stores for large values,
byte-exact at every alignment and length, into real POSIX shared memory; bad
arguments raise instead of writing anything; and the compiled part is built wherever
a C compiler is (a silent build failure would only show as a slower bench)."""

from __future__ import annotations

import mmap
import os
import shutil
import sysconfig

import numpy as np
import pytest

from kvpool.transfer import memcopy

needs_build = pytest.mark.skipif(not memcopy.streaming(), reason="kvpool.transfer._streamcopy not built")


def test_the_streaming_copy_is_built_where_a_compiler_is():
    if shutil.which(sysconfig.get_config_var("CC").split()[0] or "cc") is None:
        pytest.skip("no C compiler here: kvpool copies with memcpy")
    assert memcopy.streaming(), "pip install -e . built no kvpool/transfer/_streamcopy*.so"


@needs_build
@pytest.mark.parametrize("length", [memcopy.STREAM_MIN, memcopy.STREAM_MIN + 1, (1 << 20) + 63, 3 << 20])
@pytest.mark.parametrize("dst_at,src_at", [(0, 0), (1, 0), (0, 5), (37, 63)])
def test_a_large_copy_into_shared_memory_is_byte_exact(length, dst_at, src_at):
    fd = os.memfd_create("kvpool-memcopy-test")
    try:
        os.ftruncate(fd, length + 128)
        with mmap.mmap(fd, length + 128) as region:
            region.write(b"\xee" * (length + 128))
            src = np.random.default_rng(length + dst_at).integers(0, 256, length + 64, dtype=np.uint8)
            view = memoryview(region)
            memcopy.copy_into(view[dst_at:dst_at + length], memoryview(src)[src_at:src_at + length])
            got = bytes(view[dst_at:dst_at + length])
            before, after = bytes(view[:dst_at]), bytes(view[dst_at + length:])
            view.release()
    finally:
        os.close(fd)
    assert got == src[src_at:src_at + length].tobytes()
    assert before == b"\xee" * dst_at and after == b"\xee" * (128 - dst_at)  # nothing outside


@pytest.mark.parametrize("length", [0, 1, 4096, memcopy.STREAM_MIN - 1, 1 << 20])
def test_every_length_copies_exactly_with_or_without_streaming(length, monkeypatch):
    src = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8)
    for stream in {memcopy._stream_copy, None}:
        monkeypatch.setattr(memcopy, "_stream_copy", stream)
        dst = bytearray(length)
        memcopy.copy_into(memoryview(dst), memoryview(src))
        assert bytes(dst) == src.tobytes()


@needs_build
def test_bad_arguments_raise_and_write_nothing():
    dst = bytearray(memcopy.STREAM_MIN)
    with pytest.raises(ValueError, match="destination is"):
        memcopy.copy_into(memoryview(dst), bytes(memcopy.STREAM_MIN + 1))
    with pytest.raises(TypeError):
        memcopy.copy_into(memoryview(bytes(memcopy.STREAM_MIN)), bytes(memcopy.STREAM_MIN))
    strided = memoryview(bytearray(2 * memcopy.STREAM_MIN))[::2]
    with pytest.raises((TypeError, BufferError, ValueError)):
        memcopy.copy_into(memoryview(dst), strided)
    assert dst == bytearray(memcopy.STREAM_MIN)
