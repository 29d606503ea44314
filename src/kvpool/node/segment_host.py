"""Hosting a segment: one POSIX shared-memory segment, its TCP data server, and the
mount + heartbeat conversation with the master. ``kvpool node`` is one of these; a
Client with ``global_segment_size > 0`` embeds one (Mooncake's client-contributed
segment), so the client imports this module and never the other way round.

Lifecycle: create the segment (``/dev/shm/kvpool-<id>``), bind the data port, mount with
the master, heartbeat every ``heartbeat_interval_ms`` the master asked for, and on stop
unmount, unmap and unlink so nothing is left in /dev/shm. If this process is killed,
Python's resource tracker (which registered the segment at creation) unlinks it; if the
tracker dies too, the next node on the host removes it (the owner lock of
:mod:`kvpool.transfer.segment_files`).

Index and re-mount: the mount connection stays open as the master's index stream
(:class:`~kvpool.protocol.IndexUpdate`): the host keeps ``index``, the COMPLETE objects
in its segment. When that stream ends (the master died, restarted, or dropped the
segment) or a heartbeat says the master forgot us, the host fences the old mount epoch
(:mod:`kvpool.transfer.epoch`: no grant of it moves bytes any more) and mounts again,
reporting its index, until a master takes it: a new master incarnation rebuilds the
objects from it (master/restore.py). With HA masters (a list or etcd as ``master_addr``)
the channels follow the leader (:mod:`kvpool.rpc`), and a heartbeat that fails ends
the stream when another master answers as leader: it may hang on a leader that stalled
and was replaced.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
import uuid
from multiprocessing import shared_memory
from typing import Callable

from kvpool import auth
from kvpool import protocol as P
from kvpool.config import format_addr, format_size
from kvpool.errors import ErrorCode, InvalidParams, KVPoolError, RpcFailed, UserError
from kvpool.node.data_server import MAX_CONNECTIONS, STALL_S, DataServer
from kvpool.rpc import MasterUnreachable, RpcChannel
from kvpool.spin import BUSY_POLL_US
from kvpool.throttle import Throttle
from kvpool.transfer import local_host_id
from kvpool.transfer.epoch import SHM_DIR, EpochWord, shm_bytes
from kvpool.transfer.segment_files import OwnerLock, sweep_stale
from kvpool.transfer.shm import (MADV_POPULATE_WRITE, POPULATE_CHUNK, Populator,
                                 register_local_segment, unregister_local_segment)

log = logging.getLogger("kvpool.segment")
FENCE_S = 5.0  # how long a remount waits for transfers of the old mount to end, per try
REMOUNT_RETRY_S = 0.1  # seconds between two mount tries while the master is away (a restart is back in ~1 s)
MASTER_RETRY_S = 0.5  # seconds between two tries to reach the master at start
REMOUNT_LOG_S = 10.0  # a failing mount is logged at most this often (10 tries a second would flood the log)
INDEX_POLL_S = 0.005  # seconds between two reads of the index stream (its frames wait in the kernel)


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0 = a free port the OS picks and we keep);
    ``host`` is a name, IPv4 or IPv6 address (the family is the first that
    ``getaddrinfo`` gives for it).

    Raises UserError when the port is in use or the address is not local.
    """
    where = format_addr(host, port)
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise UserError(f"cannot listen on {where}: {exc.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is already in use") from None
        raise UserError(f"cannot listen on {where}: {exc.strerror}") from None
    sock.listen(128)
    return sock


class SegmentHost:
    """Owns a segment of ``segment_size`` bytes and serves it; see the module docstring.

    Args: master_addr "host:port"; host/port of the data server (port 0 = free port);
    segment_size in bytes; prefault: allocate every page at start and fill this
    mapping's page tables; else, with populate_behind, allocate the file at start and
    fill the page tables on a thread after it (:meth:`_populate_all`), and without,
    allocate pages as writes reach them; owner_prefix names
    the owner id ("node" or "client"); stall_s: seconds a data-port peer may pause
    mid-frame (:class:`~kvpool.node.data_server.DataServer`); secret: what the data port
    asks of its peers and what this host answers the master (None: ``KVPOOL_SECRET``);
    max_connections: data-port connections served at once (the DataServer's);
    busy_poll_s: a data connection's longest poll for its next request after a read (the DataServer's).

    Raises UserError (port in use) from the constructor; RpcFailed (master
    unreachable), InvalidParams (prefault or populate_behind, and the segment does not
    fit in /dev/shm) from :meth:`start`.
    """

    def __init__(self, master_addr: str, host: str, port: int, segment_size: int, prefault: bool = True,
                 owner_prefix: str = "node", populate_behind: bool = False, stall_s: float = STALL_S,
                 secret: bytes | None = None, master_wait_s: float = 0.0,
                 max_connections: int = MAX_CONNECTIONS, busy_poll_s: float = BUSY_POLL_US / 1e6):
        self.stall_s = stall_s
        self.busy_poll_s = busy_poll_s
        self.max_connections = max_connections
        self.master_wait_s = master_wait_s
        self.secret = auth.secret_or_env(secret)
        self.master_addr = master_addr
        self.owner_id = f"{owner_prefix}-{uuid.uuid4().hex[:12]}"
        self.listener = bind_listener(host, port)
        self.data_addr = format_addr(host, self.listener.getsockname()[1])
        self.master = RpcChannel(master_addr, timeout_s=5.0, secret=self.secret or b"")
        self.shm: shared_memory.SharedMemory | None = None
        self.word: EpochWord | None = None  # the segment's mount epoch (this host sets it)
        self._writers_word: EpochWord | None = None  # the same word, for this process's writers
        self.info: P.SegmentInfo | None = None
        self._owner: OwnerLock | None = None
        self.server: DataServer | None = None
        self.segment_size = segment_size
        self.prefault = prefault
        self.populate_behind = populate_behind and not prefault
        self._stop = threading.Event()
        self._rpc_lock = threading.Lock()  # the heartbeat thread and stop() share one channel
        self._stream = RpcChannel(master_addr, timeout_s=5.0, secret=self.secret or b"")  # mount + index stream (its own thread)
        self.index: dict[str, P.IndexEntry] = {}  # key -> COMPLETE object in this segment
        self.incarnation = 0  # of the master that mounted the segment last
        self.mounts = 0  # mounts made (the first and every re-mount)
        self._remounting = False  # the stream thread is mounting again (_remount)
        self._mount_state = threading.Lock()  # _remounting and the stream's shutdown
        self._stream_thread: threading.Thread | None = None  # applies the index stream, mounts again
        self._populate_thread: threading.Thread | None = None  # fills the page tables (_populate_all)

    def start(self, stop_asked: Callable[[], bool] = lambda: False) -> None:
        """Reach the master (waiting up to ``master_wait_s`` for one to accept a
        connection, or until ``stop_asked()``), create the segment, mount it, start the
        data server. Raises RpcFailed (MasterUnreachable when none came up in time or a
        stop was asked)."""
        self._connect_master(stop_asked)
        sweep_stale()
        name = f"kvpool-{uuid.uuid4().hex[:16]}"
        self._owner = OwnerLock(name)  # before the segment exists: never one without a lock
        self.shm = shared_memory.SharedMemory(name=name, create=True, size=shm_bytes(self.segment_size))
        if self.prefault or self.populate_behind:
            _reserve(self.shm, self.segment_size)
        if self.prefault:
            started = time.monotonic()
            log.info("filling the segment's %s of pages (--prefault yes; 1-3 s per GiB on a VM)",
                     format_size(self.segment_size))
            _touch_pages(self.shm.buf)
            log.info("segment filled in %.1f s", time.monotonic() - started)
        self.info = P.SegmentInfo(name, local_host_id(), self.shm.name, self.segment_size, self.data_addr)
        self.word = EpochWord(self.shm.buf, self.segment_size, self.shm.name)
        self._writers_word = EpochWord(self.shm.buf, self.segment_size, self.shm.name)
        # writers into a segment not prefaulted (same-process clients' memcpy, TCP
        # receives) first populate each 2 MiB chunk once: a page fault per 4 KiB page
        # otherwise, and a refusal rather than a SIGBUS when /dev/shm has no room left
        # (SharedMemory keeps its mapping in _mmap, 3.8 onwards: the one whose pages we fill)
        populate = None if self.prefault else Populator(self.shm._mmap, MADV_POPULATE_WRITE).populate
        self.server = DataServer(self.listener, self.shm.buf[: self.segment_size], self.word,
                                 self.stall_s, self.secret, populate, self.max_connections, self.busy_poll_s)
        register_local_segment(self.shm.name, self.shm.buf, self._writers_word, populate)
        if self.populate_behind:
            self._populate_thread = threading.Thread(target=self._populate_all, args=(populate,),
                                                     name="kvpool-populate", daemon=True)
            self._populate_thread.start()
        self._stream.connect()
        self.interval_s = self._mount()
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        threading.Thread(target=self._heartbeat_loop, daemon=True).start()
        self._stream_thread = threading.Thread(target=self._stream_loop, name="kvpool-index", daemon=True)
        self._stream_thread.start()

    def _connect_master(self, stop_asked: Callable[[], bool]) -> None:
        """Connect, retrying while no master accepts: a node started beside its master
        (a shell's `&`, a container whose master restarts) must not lose the race."""
        deadline = time.monotonic() + self.master_wait_s
        said = False
        while True:
            try:
                return self.master.connect()
            except MasterUnreachable as exc:
                if time.monotonic() >= deadline or self._stop.is_set() or stop_asked():
                    raise
                if not said:
                    log.warning("%s; trying again for up to %g s (--master-wait)", exc, self.master_wait_s)
                    said = True
                self._stop.wait(min(MASTER_RETRY_S, max(0.0, deadline - time.monotonic())))

    def _populate_all(self, populate) -> None:
        """Allocate the pages of a segment not prefaulted, in the background, keeping
        what was written meanwhile (MADV_POPULATE_WRITE): its first puts otherwise pay
        the page faults, and the client's leases move through fresh memory (a 1 MiB put
        into a new client's segment ran at 0.3-1.4 GB/s, 2.6-3.0 once touched; in
        batches of 16, 1.2-1.4 against 5.9). Chunks of 8 MiB, ~3 ms each here; stops
        with the host."""
        step = 4 * POPULATE_CHUNK
        for offset in range(0, self.segment_size, step):
            if self._stop.is_set():
                return
            populate(offset, min(step, self.segment_size - offset))

    def _call(self, request, deadline: float | None = None):
        with self._rpc_lock:
            return self.master.call(request, deadline=deadline)

    def _fence(self) -> bool:
        """End the current mount epoch: no grant of it moves bytes any more, and the
        transfers under it have ended (TCP ones cut; same-host writers waited for).
        False if a writer still holds the segment (then do not mount yet)."""
        deadline = time.monotonic() + FENCE_S
        return self.server.fence(FENCE_S) and self.word.fence(deadline, self._stop)

    def _mount(self) -> float:
        """Mount on the stream channel, reporting the index; serve the new epoch."""
        request = P.MountSegment(self.owner_id, self.info, True, list(self.index.values()), self.incarnation)
        reply = self._stream.call(request, idempotent=False)
        if reply.code != ErrorCode.OK:
            raise KVPoolError(f"master refused to mount segment {self.info.name}", reply.code)
        for key in reply.dropped:
            self.index.pop(key, None)
        self.incarnation = reply.incarnation
        self.mounts += 1
        self.server.open_epoch(reply.epoch)
        return reply.heartbeat_interval_ms / 1000

    def _stream_loop(self) -> None:
        """Apply the master's index updates every :data:`INDEX_POLL_S` (polled, not
        waited for: see :meth:`RpcChannel.receive_pending`); when the stream ends, apply
        what came before its end, then mount again."""
        while not self._stop.wait(INDEX_POLL_S):
            try:
                updates, ended = self._stream.receive_pending()
            except KVPoolError:
                updates, ended = [], True
            for update in updates:
                if isinstance(update, P.IndexUpdate) and update.name == self.info.name:
                    for key in update.drops:
                        self.index.pop(key, None)
                    for entry in update.adds:
                        self.index[entry.key] = entry
            if ended and not self._stop.is_set():
                self._remount()

    def _remount(self) -> None:
        """Fence the old epoch and mount again (index reported), until a master takes it
        or the host stops."""
        log.warning("lost the master's index stream for segment %s; mounting again (%d objects indexed)",
                    self.info.name, len(self.index))
        with self._mount_state:
            self._remounting = True
        try:
            self._mount_until_taken()
        finally:
            with self._mount_state:
                self._remounting = False

    def _mount_until_taken(self) -> None:
        tries, say = 0, Throttle(REMOUNT_LOG_S)  # the first failure is said at once
        while not self._stop.is_set():
            try:
                self._stream.close()
                self._stream.connect()
                if self._fence():
                    self._mount()
                    if tries:
                        log.warning("mounted segment %s again after %d failed tries", self.info.name, tries)
                    return
                why = f"a writer of the old mount still holds segment {self.info.name}; not mounting yet"
            except KVPoolError as exc:  # master down or restarting: keep trying, saying so now and then
                why = f"mount of {self.info.name} failed: {exc}"
            tries += 1
            if say.due():
                log.warning("%s (%d tries so far; retrying every %.1f s, this said every %.0f s)",
                            why, tries, REMOUNT_RETRY_S, REMOUNT_LOG_S)
            self._stop.wait(REMOUNT_RETRY_S)

    def _heartbeat_loop(self) -> None:
        """Heartbeat every ``interval_s``. With several masters (HA) a heartbeat waits
        one interval (at least :data:`~kvpool.rpc.MIN_WAIT` and at most all of the
        channel's 5 s timeout), not always the whole timeout: a stalled leader
        (SIGSTOP, a hung host) holds its connections open, and this node's stream to it
        ends only when the heartbeat gives up, so the new leader had no segments for
        5 s. A heartbeat that fails then ends the stream only when another master
        leads (:meth:`_leader_elsewhere`): a leader that is merely slow keeps its
        stream (a re-mount fences the transfers in flight)."""
        ha = self.master.masters.ha
        while not self._stop.wait(self.interval_s):
            mounts = self.mounts  # a mount that lands while the heartbeat is out answers it
            deadline = time.monotonic() + self.interval_s if ha else None
            try:
                if self._call(P.Heartbeat(self.owner_id), deadline).code == ErrorCode.CLIENT_NOT_FOUND:
                    self._lost_master(mounts, "master forgot segment %s")
            except KVPoolError as exc:  # master down or restarting: keep trying
                log.warning("heartbeat to %s failed: %s", self.master_addr, exc)
                if ha and self._leader_elsewhere():  # the stream may hang on a stalled ex-leader
                    self._lost_master(mounts, "another master leads: segment %s mounts with it")

    def _leader_elsewhere(self) -> bool:
        """Whether a master other than the stream's leads
        (:meth:`~kvpool.rpc.RpcChannel.leader_elsewhere`), each asked within one
        heartbeat interval."""
        # asked on the heartbeat's channel (the stream's belongs to the stream thread); the
        # stream's next connection goes to the leader found first
        leader = self.master.leader_elsewhere(max(0.1, self.interval_s), of=self._stream)
        if leader is not None:
            self._stream.prefer(leader)
        return leader is not None

    def _lost_master(self, mounts: int, why: str) -> None:
        """End the stream (its thread mounts again) unless a mount happened since
        ``mounts`` was read (the master that forgot us has been told again), or the
        stream thread is mounting again now: its own loop finds the master that leads,
        and a shutdown could only cut a mount in flight. After a failover a heartbeat
        may reach the new leader just before the node's mount; its answer (unknown
        owner) used to cut that mount, and the node mounted a second time, with no
        stream in between (the new leader's replies on the segment then wait for its
        resync). A mount stuck on a stalled ex-leader ends at the channel's timeout
        (5 s) and the next try goes to the leader the heartbeat found."""
        with self._mount_state:
            if self.mounts != mounts or self._remounting:
                return
            log.warning(why, self.info.name)
            self._stream.shutdown()

    def _stream_ended(self) -> bool:
        """Wait (at most the stream channel's timeout and a second) for the index thread
        to end: it may be mounting again, and the epoch word it fences and sets must not
        be released under it (it ended in ValueError on a released memoryview)."""
        thread = self._stream_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._stream.timeout_s + 1.0)
        return thread is None or not thread.is_alive()

    def stop(self) -> None:
        """Unmount (best effort), stop serving, unmap and unlink the segment (the
        mapping is left to the process's exit when the index thread does not end)."""
        self._stop.set()
        if self.server:
            self.server.stop()
            self.server.fence(0.5)
        if self.info:
            try:
                self._call(P.UnmountSegment(self.owner_id, self.info.name))
            except RpcFailed:
                pass  # master gone: it will expire us by TTL
        self.master.close()
        self._stream.shutdown()  # its thread sees the end at its next poll
        self.listener.close()
        ended = self._stream_ended()
        if self._populate_thread is not None:
            # it stops within a step (~3 ms), having seen _stop set above; inside one
            # (madvise leaves the GIL) the mapping cannot be closed, and
            # SharedMemory.close() would keep its fd and the file's memory until exit
            self._populate_thread.join()
        if self.shm:
            unregister_local_segment(self.shm.name)
            if ended:
                self._unmap()
            else:  # it may still fence or set the epoch word: leave the mapping to exit
                log.warning("segment %s: the index thread is still mounting; its mapping stays until exit",
                            self.info.name)
            self.shm.unlink()
            self.shm = None
        if self._owner:
            self._owner.release()
            self._owner = None

    def _unmap(self) -> None:
        """Release the epoch words and the segment's views, and unmap it."""
        for word in (self.word, self._writers_word):
            if word is not None:
                word.close()
        if self.server is not None:
            with contextlib.suppress(BufferError):  # a serving thread may still use it
                self.server.segment.release()
        with contextlib.suppress(BufferError):  # a serving thread's view: unlink frees the name anyway
            self.shm.close()


def _reserve(shm: shared_memory.SharedMemory, segment_size: int) -> None:
    """Allocate the whole segment file in /dev/shm now (``posix_fallocate``), so that
    a segment that does not fit is refused here rather than kill its writers later: a
    write into a tmpfs page that cannot be allocated is a SIGBUS, in whichever process
    writes (this host, or a same-host client writing through its own mapping), and a
    client's segment (populated behind its start) accepted any size. About 0.25 s per
    GiB here, the zeroing its pages need anyway. Raises InvalidParams (ENOSPC: saying
    how much is free) or OSError."""
    try:
        os.posix_fallocate(shm._fd, 0, shm.size)  # SharedMemory keeps its descriptor in _fd
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        try:
            st = os.statvfs(SHM_DIR)
            free = f"{st.f_bavail * st.f_frsize / (1 << 20):,.1f} MiB free"
        except OSError:
            free = "not enough free"
        raise InvalidParams(f"a segment of {segment_size / (1 << 20):,.1f} MiB does not fit in "
                            f"{SHM_DIR}: {free} (a smaller segment, or a larger {SHM_DIR})") from None


def _touch_pages(buf: memoryview) -> None:
    """Write one byte per page so the kernel allocates (and zeroes) the whole segment
    now, at start, not as page faults during the first transfers (~1 GB/s instead of
    ~10 GB/s): 0.75 s per GiB on the development VM one day, 1.8-2.9 another (a 4 KiB
    page fault each; MADV_POPULATE_WRITE took 1.25). Clients map it without populating
    and fill their page tables lazily before writes (see transfer/shm.py)."""
    import mmap

    import numpy as np

    np.frombuffer(buf, dtype=np.uint8)[:: mmap.PAGESIZE] = 0
