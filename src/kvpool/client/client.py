"""``Client``: the native kvpool store API (put/get/remove and batch forms).

Control: one blocking :class:`~kvpool.rpc.RpcChannel` to the master per thread, over the
master's Unix socket when it runs on this host (:mod:`kvpool.local_socket`; TCP with
``force_tcp=True``).
Data: :class:`~kvpool.transfer.engine.TransferEngine` moves the bytes: a replica on a
segment this process hosts by one memcpy, on a segment of this host through its mapped
shared memory (one memcpy), any other, or every one with ``force_tcp=True``, over pooled
TCP connections to its node (large values sliced over parallel lanes). Batches cost one
master RPC per step and chunk (PutCommit or BatchPutStart/BatchPutEnd,
BatchGetReplicaList) and one exchange per node and chunk; large batches overlap the
RPCs of one chunk with the copies of another (:mod:`kvpool.client.pipeline`). Buffers given to put/get are used in place (zero copy); ``register_buffer``
does the checks once and adds torch CUDA tensors (through a pinned staging buffer).

Leases (Mooncake semantics): a read asks the master for the replica list, which grants a
lease of ``lease_ttl_ms``. The client measures the lease from the moment it *sent* the
request (never later than the master's grant) and checks it after the bytes are copied:
a copy that finished after the deadline raises LeaseExpired and no bytes are returned,
because the master may have reused that buffer meanwhile.

Read grants: each replica list the master hands out carries a grant id. Once the copy
of a handle has finished (success or failure) the handle is spent (reading it again
fails with LEASE_EXPIRED: query again) and its grant id is queued for ``ReadDone``, a
message the master never answers: it rides in the same write as this client's next
request, or, if none comes within :data:`DONE_DELAY_S`, goes alone from a small flusher
thread (measured: a separate write per get cost +25 us on a 55 us get, riding along
+4 us). That lets the master free an upserted-over or removed version as soon as no
read of it is in flight, instead of at the end of the lease; the object's own lease (no
removal, no eviction) is unchanged.
"""

from __future__ import annotations

import math
import numbers
import os
import secrets
import threading
import time
from typing import Sequence

from kvpool import protocol as P
from kvpool.client.get import GetPath
from kvpool.client.grants import ReadGrants, ReadHandle
from kvpool.client.hints import LocationHints
from kvpool.client.keys import check_key, check_keys
from kvpool.client.lease import LocalLeases
from kvpool.client.put import PutPath
from kvpool.client.shortfall import ReplicaShortfall
from kvpool.errors import ErrorCode, InvalidParams, KVPoolError, RpcFailed, code_name, code_of, raise_for
from kvpool.node.segment_host import SegmentHost
from kvpool.rpc import RpcChannel
from kvpool.transfer import local_host_id
from kvpool.transfer.buffers import BufferRegistry, RegisteredBuffer
from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.request import Transport
from kvpool.transfer.shm import LocalTransport, ShmTransport
from kvpool.transfer.tcp import TcpTransport

LEASE_BYTES = 64 << 20  # the allocation lease a client asks for (bytes)


class Client(ReadGrants, PutPath, GetPath):
    """A thread-safe connection to a kvpool cluster.

    Args:
        master_addr: "host:port" of the master.
        force_tcp: move every byte over the nodes' TCP ports, and talk to the master over
            TCP, even on the same host (as a client on another host would).
        timeout_s: socket timeout of every control and data connection (seconds).
        global_segment_size: bytes of shared memory this client contributes to the pool
            (Mooncake's client segment; 0 = none). It is mounted while the client is
            open, heartbeats keep it mounted, and close() unmounts it: objects on it go.
            It is allocated in /dev/shm at construction (resident, as memory given to
            a pool is; about 0.25 s per GiB) and its page tables are filled on a thread
            after it, so that puts into it do not pay first-touch page faults.
        segment_host: data-server address of that segment (port 0 = a free one).
        alloc_leases: put small single-replica values through an allocation lease (one
            master round trip per put or batch instead of two; docs/store.md,
            "Allocation leases"); None = on unless the env var KVPOOL_ALLOC_LEASES is "0".
        lease_bytes: the lease size asked for (the master may grant less).

    Raises RpcFailed at construction when the master cannot be reached, InvalidParams
    when ``global_segment_size`` does not fit in /dev/shm (the message says what is free)
    or ``timeout_s`` is not a finite number > 0.

    ``hint_counts``: copies made from location hints ("confirmed", "missed"; see
    :mod:`kvpool.client.hints`), a Counter.
    ``replica_shortfall.count``: puts (and batch items) stored with fewer replicas than
    their ``replica_num`` (:class:`~kvpool.client.shortfall.ReplicaShortfall`).

    The put methods are in :class:`~kvpool.client.put.PutPath`, the get methods in
    :class:`~kvpool.client.get.GetPath`, read-grant bookkeeping in
    :class:`~kvpool.client.grants.ReadGrants`; this class holds the connections and the
    rest of the API.
    """

    def __init__(self, master_addr: str, force_tcp: bool = False, timeout_s: float = 10.0,
                 global_segment_size: int = 0, segment_host: str = "127.0.0.1",
                 alloc_leases: bool | None = None, lease_bytes: int = LEASE_BYTES):
        if not (isinstance(timeout_s, numbers.Real) and 0 < timeout_s < math.inf):
            raise InvalidParams(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        self.master_addr = master_addr
        self.force_tcp = force_tcp
        self.timeout_s = timeout_s
        self.host_id = local_host_id()
        transports: list[Transport] = [TcpTransport(timeout_s)]
        if not force_tcp:
            transports += [LocalTransport(), ShmTransport()]
        self.engine = TransferEngine(transports, timeout_s)
        self.buffers = BufferRegistry()
        self._local = threading.local()
        self._channels: list[RpcChannel] = []
        self._lock = threading.Lock()
        self._grant_lock = threading.Lock()  # ReadHandle.reading / .spent, _done
        self._done: list[int] = []  # grant ids whose reads ended, not yet sent
        self._done_waiting = threading.Event()  # wakes the flusher
        self._flusher: threading.Thread | None = None
        self._closing = False
        self._closed = False  # set by close() before its channels go: no call opens one after
        self.hints = LocationHints()  # where keys read before were (kvpool.client.hints)
        self.hint_counts = self.hints.counts  # copies from a hint: "confirmed", "missed"
        self.segment: SegmentHost | None = None
        if alloc_leases is None:
            alloc_leases = os.environ.get("KVPOOL_ALLOC_LEASES", "1") != "0"
        self.owner_id = f"client-{secrets.token_hex(8)}"  # names this client's allocation leases
        self.leases = LocalLeases(lease_bytes) if alloc_leases else None
        self._keeper: threading.Thread | None = None  # returns leases (PutPath._keep_leases)
        self._lease_wake = threading.Event()
        self.replica_shortfall = ReplicaShortfall()  # puts placed with fewer replicas than asked
        try:
            self._call(P.Ping())  # fail now, clearly: master not there, another protocol version
        except BaseException:
            self.close()
            raise
        if global_segment_size > 0:
            host = SegmentHost(master_addr, segment_host, 0, global_segment_size, prefault=False,
                               owner_prefix="client", populate_behind=True)
            try:
                host.start()
            except BaseException:
                host.stop()
                raise
            self.segment = host

    # ------------------------------------------------------------ plumbing

    def _channel(self) -> RpcChannel:
        # after close() a channel would connect again and the call go through unnoticed
        self._check_open()
        chan = getattr(self._local, "chan", None)
        if chan is None:
            chan = RpcChannel(self.master_addr, self.timeout_s, local=not self.force_tcp)
            with self._lock:
                self._check_open()  # close() may have taken the channels meanwhile
                self._channels.append(chan)
            self._local.chan = chan
        return chan

    def _check_open(self) -> None:
        """Raise RpcFailed once close() has begun to close the channels."""
        if self._closed:
            raise RpcFailed(f"this client of {self.master_addr} is closed")

    def _call(self, request, idempotent: bool = True, during=None, deadline: float | None = None):
        """One request to the master (:meth:`RpcChannel.call`; ``deadline``: time.monotonic,
        the end of the operation it is a step of)."""
        done = self._take_done()  # ReadDone rides along in the same write
        return self._channel().call(request, idempotent, (P.ReadDone(done),) if done else (), during, deadline)

    def ping(self) -> float:
        """One round trip to the master that touches no metadata (health checks).
        Returns the round-trip time in seconds; raises RpcFailed when unreachable."""
        start = time.perf_counter()
        self._call(P.Ping())
        return time.perf_counter() - start

    def register_buffer(self, buf) -> RegisteredBuffer:
        """Register caller memory for zero-copy puts and gets: bytes-like, numpy array,
        torch CPU tensor, or torch CUDA tensor (staged through pinned host memory).
        Pass the returned handle (or the original object) to put_from / get_into and
        their batch forms. Raises InvalidParams (non-contiguous, no buffer interface)."""
        return self.buffers.register(buf)

    def unregister_buffer(self, buf: RegisteredBuffer | int) -> bool:
        """Forget a registered buffer; False if it was not registered."""
        return self.buffers.unregister(buf)

    # ------------------------------------------------------------ existence, removal, pins

    def is_exist(self, key: str) -> bool:
        """True if ``key`` is readable now (grants a read lease)."""
        check_key(key)
        code = self._call(P.ExistKey(key)).code
        if code not in (ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND):
            raise_for(code)
        return code == ErrorCode.OK

    def batch_is_exist(self, keys: Sequence[str]) -> list[bool]:
        """One bool per key, in one RPC."""
        keys = check_keys(keys)
        return [c == ErrorCode.OK for c in self._call(P.BatchExistKey(keys)).codes]

    def remove(self, key: str, force: bool = False) -> None:
        """Remove ``key``. Raises ObjectNotFound, ObjectHasLease (unless ``force``)."""
        check_key(key)
        raise_for(self._call(P.Remove(key, force)).code, f"remove {key!r}")

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[ErrorCode]:
        """One ErrorCode per key (OK, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE)."""
        keys = check_keys(keys)
        return [code_of(c) for c in self._call(P.BatchRemove(keys, force)).codes]

    def remove_all(self, force: bool = False) -> int:
        """Remove every object (leased ones skipped unless ``force``); returns the count."""
        return self._call(P.RemoveAll(force)).count

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        """Remove objects whose key matches ``pattern`` (RE2 search: Python ``re`` syntax
        without backreferences or lookaround, linear time); returns the count.
        Raises InvalidParams for a bad or unsupported pattern."""
        reply = self._call(P.RemoveByRegex(pattern, force))
        raise_for(reply.code, f"bad regex {pattern!r}")
        return reply.count

    def pin(self, key: str, mode: str = "hard") -> None:
        """Set ``key``'s pin: "hard" (never evicted), "soft" (evicted last, until the
        master's soft_pin_ttl from now) or "none". Raises ObjectNotFound, InvalidParams
        (an unknown mode: the message names it and the valid ones; nothing is sent)."""
        check_key(key)
        if mode not in P.PIN_MODES:
            raise InvalidParams(f"pin {key!r}: unknown mode {mode!r}; valid modes: {', '.join(P.PIN_MODES)}")
        reply = self._call(P.SetPin(key, mode))
        raise_for(reply.code, f"pin {key!r}: {reply.message or code_name(reply.code)}")

    def stats(self) -> P.StatsResp:
        """Master statistics: object count, used/total bytes, segments, counters."""
        return self._call(P.GetStats())

    def warm_local_segments(self) -> int:
        """Map every mounted segment that lives on this host and fill the page tables of
        its allocated pages, so that the first reads out of it pay no page faults (for
        an engine about to serve; it takes ~65 ms per GiB, best on a thread). Returns
        the bytes populated; 0 with ``force_tcp`` or no same-host segment."""
        shm = next((t for t in self.engine.transports if isinstance(t, ShmTransport)), None)
        if shm is None:
            return 0
        return sum(shm.warm(s.name) for s in self.stats().segments)

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close every connection and mapping (queued ReadDones go first). Safe to call twice
        (the second does nothing); every later call that asks the master raises RpcFailed."""
        if self._closed:
            return
        with self._grant_lock:
            self._closing, flusher = True, self._flusher
        if flusher is not None:
            self._done_waiting.set()
            flusher.join(self.timeout_s)
        with self._lock:
            keeper = self._keeper
        if keeper is not None:
            self._lease_wake.set()
            keeper.join(self.timeout_s)
        if self.leases is not None and self._channels:
            self._return_leases(everything=True)  # no put is in flight once close() is called
        done = self._take_done()
        if done and getattr(self._local, "chan", None) is not None:
            self._local.chan.notify(P.ReadDone(done))
        with self._lock:  # from here no channel opens again (_channel)
            self._closed = True
            channels, self._channels = self._channels, []
        for chan in channels:
            chan.close()
        self.engine.close()
        self.buffers.clear()
        if self.segment is not None:
            self.segment.stop()
            self.segment = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Client", "KVPoolError", "ReadHandle", "check_key"]
