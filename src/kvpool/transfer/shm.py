"""Same-host transports: map a node's POSIX shared-memory segment and memcpy
(:class:`ShmTransport`), or, for a segment hosted by this very process,
copy through the host's own mapping (:class:`LocalTransport`). No socket is involved.

Segments are opened by name under /dev/shm with :func:`mmap.mmap` directly rather than
``multiprocessing.shared_memory.SharedMemory``: on Python < 3.13 the latter registers
every *opened* segment with the resource tracker, which would unlink the node's segment
when this process exits. Mappings are kept open for the life of the transport.

Both transports move bytes under a grant only while the segment's mount epoch is the
grant's (:mod:`kvpool.transfer.epoch`): writes hold the segment's shared lock and check
first, reads check after copying; a request of a stale epoch fails and says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
import time

from kvpool.protocol import SegmentInfo
from kvpool.transfer import local_host_id
from kvpool.transfer.epoch import MOUNT_WAIT_S, SHM_DIR, EpochWord
from kvpool.transfer.memcopy import copy_into
from kvpool.transfer.request import Cancel, Op, Transport, TransferRequest

# shm name -> (writable view, epoch word, before_write or None) of a segment hosted here
_IN_PROCESS: dict[str, tuple[memoryview, EpochWord, object]] = {}


def register_local_segment(shm_name: str, view: memoryview, word: EpochWord,
                           before_write=None) -> None:
    """Make ``view`` (a segment this process hosts) reachable by :class:`LocalTransport`;
    ``word``: its epoch word, opened for this process's writers (not the host's own);
    ``before_write(offset, length)``: runs before each write into the segment (a
    :class:`Populator`'s ``populate`` for a segment not prefaulted), or None."""
    _IN_PROCESS[shm_name] = (view, word, before_write)


def unregister_local_segment(shm_name: str) -> None:
    _IN_PROCESS.pop(shm_name, None)


def _stale(segment: SegmentInfo) -> str:
    return (f"segment {segment.name} was mounted again (epoch {segment.epoch} of the grant is "
            f"stale): the grant came from an earlier mount or master incarnation")


def _kept(segment: SegmentInfo, word: EpochWord, cancel: Cancel | None) -> bool:
    """Whether bytes just copied out of ``segment`` under its grant may be kept: its
    mount epoch is still the grant's (else the reason is noted on ``cancel``)."""
    if word.valid(segment.epoch):
        return True
    if cancel is not None:
        cancel.note(_stale(segment))
    return False


class _MemoryTransport(Transport):
    """A same-host transport: each segment is a byte view found by its shm name, copied
    under its epoch word (:meth:`write_many`, :meth:`read_many`)."""

    in_place = True

    def _find(self, segment: SegmentInfo) -> tuple[memoryview, EpochWord, object] | None:
        """(view of the segment, its epoch word, ``before_write(offset, length)`` run
        before each write, or None), or None."""
        raise NotImplementedError

    def _missing(self, segment: SegmentInfo) -> str:
        """Why ``segment`` has no view (for :meth:`Cancel.note`)."""
        raise NotImplementedError

    def run(self, requests: list[TransferRequest], deadline: float, cancel: Cancel) -> list[bool]:
        """The writes under one hold of the grant's epoch (:meth:`write_many`), then the
        reads, kept only if the epoch is still the grant's (:meth:`read_many`)."""
        segment = requests[0].segment
        writes = [(r.remote_offset, r.local_view()) for r in requests if r.op == Op.WRITE]
        reads = [(r.remote_offset, r.local_view()) for r in requests if r.op == Op.READ]
        ok_w = self.write_many(segment, writes, deadline, cancel) if writes else True
        ok_r = self.read_many(segment, reads, deadline, cancel) if reads else True
        return [ok_w if r.op == Op.WRITE else ok_r for r in requests]

    def _found(self, segment: SegmentInfo, cancel: Cancel | None):
        """:meth:`_find`, noting on ``cancel`` why there is no view."""
        found = self._find(segment)
        if found is None and cancel is not None:
            cancel.note(self._missing(segment))
        return found

    def read_bytes(self, segment: SegmentInfo, offset: int, length: int, deadline: float,
                   cancel: Cancel | None = None) -> bytes | None:
        found = self._found(segment, cancel)
        if found is None:
            return None
        found[1].await_mount(segment.epoch, deadline)
        out = bytes(found[0][offset : offset + length])
        return out if _kept(segment, found[1], cancel) else None

    def read_many(self, segment: SegmentInfo, ranges: list[tuple[int, memoryview]], deadline: float,
                  cancel: Cancel | None = None) -> bool:
        """One memcpy per range, then one epoch check for them all (a batch get's
        values on one segment: no request objects, no batch)."""
        found = self._found(segment, cancel)
        if found is None or not self._all_in(segment, ranges, cancel):
            return False
        view = found[0]
        found[1].await_mount(segment.epoch, deadline)
        for offset, dst in ranges:
            copy_into(dst, view[offset : offset + len(dst)])
        return _kept(segment, found[1], cancel)

    def write_from(self, segment: SegmentInfo, offset: int, src: memoryview, deadline: float,
                   cancel: Cancel | None = None) -> bool:
        """One memcpy under the grant's epoch (a single put's copy: no request, no batch)."""
        return bool(src) and self.write_many(segment, [(offset, src)], deadline, cancel)

    def write_many(self, segment: SegmentInfo, ranges: list[tuple[int, memoryview]], deadline: float,
                   cancel: Cancel | None = None) -> bool:
        """One memcpy per (offset, source) range, all under one hold of the grant's
        epoch (a batch put's values on one segment: no request objects, no batch);
        nothing is written when a range lies outside the segment."""
        found = self._found(segment, cancel)
        if found is None or not self._all_in(segment, ranges, cancel):
            return False
        view, word, before_write = found
        allocated = True
        with word.writing(segment.epoch, deadline) as allowed:
            if allowed:
                allocated = before_write is None or populate_ranges(before_write, ranges)
                if allocated:
                    for offset, src in ranges:
                        copy_into(view[offset : offset + len(src)], src)
        if cancel is not None and not (allowed and allocated):
            cancel.note(_stale(segment) if not allowed else _unallocated(segment))
        return allowed and allocated

    @staticmethod
    def _all_in(segment: SegmentInfo, ranges: list[tuple[int, memoryview]], cancel: Cancel | None) -> bool:
        """Whether every (offset, view) range lies inside ``segment`` (else noted)."""
        for offset, buf in ranges:
            if offset < 0 or offset + len(buf) > segment.size:
                if cancel is not None:
                    cancel.note(f"range {offset}+{len(buf)} outside segment {segment.name}")
                return False
        return True

    def value_view(self, segment: SegmentInfo, offset: int, length: int, deadline: float | None = None):
        found = self._find(segment)
        if found is None or offset < 0 or offset + length > segment.size:
            return None
        view, word, _ = found
        word.await_mount(segment.epoch, time.monotonic() + MOUNT_WAIT_S if deadline is None else deadline)
        return view[offset : offset + length], lambda: word.valid(segment.epoch)


def populate_ranges(before_write, ranges: list[tuple[int, memoryview]]) -> bool:
    """``before_write(offset, length)`` for writes of ``ranges``: once for their whole
    span when they lie close together (a batch placed in one allocation lease: 128
    values, one call instead of 128), else once per range (scattered ranges would
    populate the gaps between them). False when it refused one (:meth:`Populator.populate`);
    True for no ranges. Used by same-host writers and by the node's TCP data server."""
    if not ranges:
        return True
    lo = min(offset for offset, _ in ranges)
    hi = max(offset + len(src) for offset, src in ranges)
    if hi - lo <= 2 * sum(len(src) for _, src in ranges):
        return before_write(lo, hi - lo)
    return all([before_write(offset, len(src)) for offset, src in ranges])


def _unallocated(segment: SegmentInfo) -> str:
    return (f"shm {segment.shm_name}: no memory for the segment's pages (/dev/shm is full; "
            "its node was started with --prefault no)")


class LocalTransport(_MemoryTransport):
    """Same process: one memcpy through the hosting SegmentHost's own mapping."""

    name, rank = "local", 0

    def can_reach(self, segment: SegmentInfo) -> bool:
        return segment.shm_name in _IN_PROCESS

    def _find(self, segment: SegmentInfo) -> tuple[memoryview, EpochWord, object] | None:
        return _IN_PROCESS.get(segment.shm_name)

    def _missing(self, segment: SegmentInfo) -> str:
        return f"local segment {segment.name} is no longer hosted here"


class ShmTransport(_MemoryTransport):
    """Copies between local buffers and mapped same-host segments; thread-safe."""

    name, rank = "shm", 1

    def __init__(self):
        self._maps: dict[str, _Mapping | None] = {}
        self._lock = threading.Lock()

    def _mapping(self, shm_name: str) -> _Mapping | None:
        entry = self._maps.get(shm_name, False)
        if entry is False:
            with self._lock:
                entry = self._maps.get(shm_name, False)
                if entry is False:
                    self._prune()
                    entry = self._maps[shm_name] = _open(shm_name)
        return entry

    def view(self, shm_name: str) -> memoryview | None:
        """Writable byte view of the whole segment, or None if it cannot be mapped."""
        entry = self._mapping(shm_name)
        return entry.view if entry else None

    def _prune(self) -> None:
        """Unmap segments whose shm file is gone (their node exited), so a long-lived
        client does not keep dead segments' memory alive. Called with the lock held."""
        for name in [n for n in self._maps if not os.path.exists(os.path.join(SHM_DIR, n))]:
            entry = self._maps.pop(name)
            if entry:
                entry.close()

    def can_reach(self, segment: SegmentInfo) -> bool:
        return segment.host_id == local_host_id() and self.view(segment.shm_name) is not None

    def _find(self, segment: SegmentInfo) -> tuple[memoryview, EpochWord, object] | None:
        entry = self._mapping(segment.shm_name)
        return None if entry is None else (entry.view, entry.word(segment.size), entry.populate)

    def _missing(self, segment: SegmentInfo) -> str:
        return f"shm {segment.shm_name} cannot be mapped (its node is gone?)"

    def warm(self, shm_name: str) -> int:
        """Map segment ``shm_name`` if it is on this host and fill the page tables of
        every range its node has allocated (found with SEEK_DATA / SEEK_HOLE, so no hole
        is allocated by this); returns the bytes populated (0: not here).

        A fresh process's first reads out of a segment otherwise pay its page faults:
        ~10 ms per 100 MB here, on the critical path of the first load.
        """
        entry = self._mapping(shm_name)
        if entry is None:
            return 0
        done = 0
        for start, end in _data_ranges(os.path.join(SHM_DIR, shm_name), len(entry.mm)):
            entry.populate(start, end - start)
            done += end - start
        return done

    def forget(self, shm_name: str) -> None:
        """Drop one mapping (e.g. its node is gone); views handed out keep it alive."""
        with self._lock:
            entry = self._maps.pop(shm_name, None)
        if entry:
            entry.close()

    def close(self) -> None:
        """Unmap every segment (views handed out keep theirs alive)."""
        with self._lock:
            entries, self._maps = list(self._maps.values()), {}
        for entry in entries:
            if entry:
                entry.close()


# madvise(2) advice (Linux >= 5.14): fault a range's pages in at once, for reading /
# for writing (the latter also allocates a shared-memory file's holes, writable).
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23
POPULATE_CHUNK = 2 << 20  # granularity of "populated once" (bytes; a multiple of the page size)


def _libc_madvise():
    """libc's ``madvise`` through ctypes, or None (not found). Looked up among the
    symbols this process has loaded (``dlopen(NULL)``), which include libc's:
    ``ctypes.util.find_library`` would run ``ldconfig`` in a subprocess at import."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


_MADVISE = _libc_madvise()


def _madvise(mm: mmap.mmap, start: int, length: int, advice: int) -> None:
    """madvise(2) on bytes ``[start, start + length)`` of ``mm`` (``start`` page
    aligned) without holding the GIL: ctypes releases it around the call, where
    ``mmap.madvise`` keeps it, and populating takes ~65 ms per GiB here (2-3x that
    for MADV_POPULATE_WRITE), during which every other thread of the process stood
    still: an engine's beside ``warm_local_segments`` on a thread, a client's puts
    beside its own segment populated behind its start (8 MiB steps).
    The ctypes view of its first byte holds the mapping's buffer, so it cannot be
    closed during the call (one byte: an array type per length would be cached for
    good). Raises OSError (the call's errno) and ValueError (a closed mapping, a range
    outside it), as ``mmap.madvise`` does, which is used where libc is not found."""
    pinned = None
    if _MADVISE is not None:
        if start < 0 or length < 0 or start + length > len(mm):
            raise ValueError(f"madvise range {start}+{length} outside a mapping of {len(mm)} bytes")
        with contextlib.suppress(TypeError):  # a read-only mapping (none of kvpool's)
            pinned = ctypes.c_char.from_buffer(mm, start)  # ValueError when closed
    if pinned is None:  # the call that keeps the GIL
        mm.madvise(advice, start, length)
        return
    try:
        if _MADVISE(ctypes.addressof(pinned), length, advice) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    finally:
        del pinned


class Populator:
    """Fills a mapping's page tables lazily, a ``POPULATE_CHUNK`` at a time, once: call
    :meth:`populate` before the first write into a range.

    Why, measured here (Linux 6.18, 100 MB written in 1 MiB copies):

    - A client's mapping of a node's segment (pages allocated at the node's start):
      ``MADV_POPULATE_READ``. Populating costs what faulting does, ~65 ms per GiB, so
      populating the whole segment at map time (MAP_POPULATE, as before) put that on
      each client's first request whatever it touched: the first 100 MB read after
      mapping a 1 GiB segment took 73 ms with it, 18 ms without (11 ms once faulted).
      Reads fault 16 pages at a time (fault-around); populating a read's range first
      gains nothing. Writes fault one page at a time: a first 100 MB write takes ~42 ms
      unpopulated, ~15 ms with its range populated first (8 ms once populated). The
      read-populated PTEs of a shared shmem mapping are writable; MADV_POPULATE_WRITE
      costs 2-3x as much for the same result.
    - The host's own mapping of a segment it did not prefault (a client's contributed
      segment, allocated at start but its page tables unfilled; a node run with
      ``--prefault no``, whose pages are holes until written): ``MADV_POPULATE_WRITE``,
      which also allocates holes: 43 ms per 100 MB in all, against 51-73 ms faulting
      page by page and 57 ms with POPULATE_READ (whose pages fault again on the write).

    Without the advice (Linux < 5.14), pages fault as they are touched.

    Args:
        mm: the mapping (an :class:`mmap.mmap`).
        advice: MADV_POPULATE_READ or MADV_POPULATE_WRITE.
    """

    def __init__(self, mm: mmap.mmap, advice: int = MADV_POPULATE_READ):
        self.mm, self.advice = mm, advice
        self.populated = bytearray(-(-len(mm) // POPULATE_CHUNK))  # 1 per populated chunk

    def populate(self, offset: int, length: int) -> bool:
        """Fill the page tables of the chunks ``[offset, offset + length)`` (bytes)
        touches that were not filled yet. Never raises; races only repeat harmless work.

        Returns False when the kernel could not allocate their pages (a segment not
        prefaulted, and /dev/shm filled since its node started): the caller must not
        write there, or the write faults with SIGBUS and kills the writing process.
        True otherwise, also where the advice is not supported (Linux < 5.14: pages then
        fault as they are written, as before this check existed).
        """
        first, last = offset // POPULATE_CHUNK, (offset + max(length, 1) - 1) // POPULATE_CHUNK
        if first == last and first < len(self.populated) and self.populated[first]:
            return True  # the common case: one chunk, filled before
        todo = [c for c in range(first, min(last + 1, len(self.populated))) if not self.populated[c]]
        if not todo:
            return True
        start = todo[0] * POPULATE_CHUNK
        try:
            _madvise(self.mm, start, min((todo[-1] + 1) * POPULATE_CHUNK, len(self.mm)) - start, self.advice)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                return False  # EFAULT or ENOMEM: no memory for the pages; asked again next time
            self.populated[:] = b"\1" * len(self.populated)  # not supported here: stop asking
        except ValueError:  # a closed mapping: the write that follows fails on its own
            return True
        for c in todo:
            self.populated[c] = 1
        return True


class _Mapping:
    """One mapped segment of another process, whose page tables are filled lazily
    before writes (:class:`Populator`, MADV_POPULATE_READ)."""

    def __init__(self, mm: mmap.mmap, shm_name: str):
        self.mm, self.view, self.shm_name = mm, memoryview(mm), shm_name
        self.populate = Populator(mm).populate
        self._word: EpochWord | None = None

    def word(self, size: int) -> EpochWord:
        """The segment's epoch word (``size``: its value bytes), opened at first use."""
        if self._word is None:
            self._word = EpochWord(self.view, size, self.shm_name)
        return self._word

    def close(self) -> None:
        if self._word is not None:
            self._word.close()
        try:
            self.view.release()
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a slice; the mapping goes when that does


def _data_ranges(path: str, size: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges of ``path`` (its first ``size`` bytes) that hold
    allocated pages; [] when the file cannot be opened or sought."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return []
    out, pos = [], 0
    try:
        while pos < size:
            start = os.lseek(fd, pos, os.SEEK_DATA)
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            if start >= size:
                break
            out.append((start, end))
            pos = end
    except OSError:
        pass  # ENXIO: no data after pos
    finally:
        os.close(fd)
    return out


def _open(shm_name: str) -> _Mapping | None:
    try:
        fd = os.open(os.path.join(SHM_DIR, shm_name), os.O_RDWR)
    except OSError:
        return None  # another host's segment, or gone: the caller uses TCP
    try:
        mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return _Mapping(mm, shm_name)
