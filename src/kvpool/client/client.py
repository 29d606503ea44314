"""``Client``: the native kvpool store API (put/get/remove and batch forms).

Control: one blocking :class:`~kvpool.rpc.RpcChannel` to the master per thread.
Data: :class:`~kvpool.transfer.engine.TransferEngine` moves the bytes: a replica on a
segment this process hosts by one memcpy, on a segment of this host through its mapped
shared memory (one memcpy), any other, or every one with ``force_tcp=True``, over pooled
TCP connections to its node (large values sliced over parallel lanes). Batches cost one
master RPC per step (BatchPutStart, BatchPutEnd, BatchGetReplicaList) and one exchange
per node. Buffers given to put/get are used in place (zero copy); ``register_buffer``
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

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import msgspec

from kvpool import protocol as P
from kvpool.errors import (
    BufferOverflow, ErrorCode, InvalidParams, KVPoolError, LeaseExpired, TransferFailed, code_name, code_of,
    raise_for,
)
from kvpool.node.segment_host import SegmentHost
from kvpool.rpc import RpcChannel
from kvpool.protocol import MAX_KEY_BYTES
from kvpool.transfer import as_byte_view, local_host_id
from kvpool.transfer.buffers import BufferRegistry, RegisteredBuffer
from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.request import Cancel, Op, TransferRequest, TransferStatus, Transport
from kvpool.transfer.shm import LocalTransport, ShmTransport
from kvpool.transfer.tcp import TcpTransport

DONE_DELAY_S = 0.01  # a ReadDone waits this long for a request to ride on, then goes alone


def check_key(key: str) -> None:
    """Raise InvalidParams unless ``key`` is a str of 1..MAX_KEY_BYTES (4096) UTF-8 bytes."""
    try:
        size = len(key.encode("utf-8")) if isinstance(key, str) else 0
    except UnicodeEncodeError:  # lone surrogates cannot go on the wire
        size = 0
    if not 0 < size <= MAX_KEY_BYTES:
        raise InvalidParams(f"key must be a str of 1..{MAX_KEY_BYTES} UTF-8 bytes, got {key!r:.80}")


@dataclass
class ReadHandle:
    """A granted read: ``size`` bytes of ``key`` in each of ``replicas``, readable under
    the lease until ``deadline`` (time.monotonic seconds, measured from the request's
    send time, so never later than the master's own deadline)."""

    key: str
    size: int
    replicas: list[P.ReplicaDesc]
    deadline: float
    grant_id: int = 0  # the master's read grant (0: none to report)
    # reads of this handle in progress, and whether its grant was returned (ReadDone)
    reading: int = field(default=0, repr=False, compare=False)
    spent: bool = field(default=False, repr=False, compare=False)

    def check_lease(self) -> None:
        """Raise LeaseExpired if the lease has run out (call after copying the bytes)."""
        if time.monotonic() > self.deadline:
            raise LeaseExpired(f"read of {self.key!r} finished after its lease expired")


class Client:
    """A thread-safe connection to a kvpool cluster.

    Args:
        master_addr: "host:port" of the master.
        force_tcp: move every byte over the nodes' TCP ports even on the same host.
        timeout_s: socket timeout of every control and data connection (seconds).
        global_segment_size: bytes of shared memory this client contributes to the pool
            (Mooncake's client segment; 0 = none). It is mounted while the client is
            open, heartbeats keep it mounted, and close() unmounts it: objects on it go.
        segment_host: data-server address of that segment (port 0 = a free one).

    Raises RpcFailed at construction when the master cannot be reached.
    """

    def __init__(self, master_addr: str, force_tcp: bool = False, timeout_s: float = 10.0,
                 global_segment_size: int = 0, segment_host: str = "127.0.0.1"):
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
        self.segment: SegmentHost | None = None
        try:
            self._call(P.Ping())  # fail now, clearly: master not there, another protocol version
        except BaseException:
            self.close()
            raise
        if global_segment_size > 0:
            host = SegmentHost(master_addr, segment_host, 0, global_segment_size, prefault=False,
                               owner_prefix="client")
            try:
                host.start()
            except BaseException:
                host.stop()
                raise
            self.segment = host

    # ------------------------------------------------------------ plumbing

    def _channel(self) -> RpcChannel:
        chan = getattr(self._local, "chan", None)
        if chan is None:
            chan = self._local.chan = RpcChannel(self.master_addr, self.timeout_s)
            with self._lock:
                self._channels.append(chan)
        return chan

    def _call(self, request, idempotent: bool = True):
        done = self._take_done()  # ReadDone rides along in the same write
        return self._channel().call(request, idempotent, (P.ReadDone(done),) if done else ())

    def _take_done(self) -> list[int]:
        with self._grant_lock:
            done, self._done = self._done, []
        return done

    def _flush_done(self) -> None:
        """Flusher thread: sends queued grant ids that found no request to ride on
        within DONE_DELAY_S, on a master connection of its own."""
        chan = RpcChannel(self.master_addr, self.timeout_s)
        try:
            while not self._closing:
                self._done_waiting.wait()
                time.sleep(DONE_DELAY_S)
                self._done_waiting.clear()
                done = self._take_done()
                if done:
                    chan.notify(P.ReadDone(done))
        finally:
            chan.close()

    def _begin(self, handles: Sequence["ReadHandle"]) -> list[bool]:
        """Count a read of each handle as in progress; False for a spent handle (its
        grant was returned, so its buffers may have been reused: it must not be read)."""
        with self._grant_lock:
            ok = [not h.spent for h in handles]
            for h, fresh in zip(handles, ok):
                h.reading += fresh
        return ok

    def _finish(self, handles: Sequence["ReadHandle"]) -> None:
        """End reads started by :meth:`_begin`; a handle with no read left in progress is
        spent and its grant goes back to the master (ReadDone, no reply awaited)."""
        with self._grant_lock:
            for h in handles:
                h.reading -= 1
        self.release(handles)

    def release(self, handles: Sequence["ReadHandle"]) -> None:
        """Hand back the read grants of ``handles`` that will not be read (again): the
        master may then free an old version they point at at once, instead of when the
        lease ends. The handles are spent (a later read fails with LEASE_EXPIRED); one
        still being read by another thread is released when that read ends. The
        objects' leases are unchanged. Never raises: an unsent ReadDone only means the
        grant lasts until its lease ends."""
        queued = False
        with self._grant_lock:
            for h in handles:
                if not h.spent and h.reading == 0:
                    h.spent = True
                    if h.grant_id:
                        self._done.append(h.grant_id)
                        queued = True
            if queued and self._flusher is None and not self._closing:
                self._flusher = threading.Thread(target=self._flush_done, name="kvpool-read-done", daemon=True)
                self._flusher.start()
        if queued and not self._done_waiting.is_set():  # is_set() is a plain read: cheap
            self._done_waiting.set()

    def _ranked(self, replicas: list[P.ReplicaDesc], routes: dict | None = None) -> list[tuple[P.ReplicaDesc, Transport]]:
        """Reachable replicas with their transport, cheapest first (local, shm, tcp).
        ``routes`` caches segment name -> transport across the items of one batch."""
        routes = {} if routes is None else routes
        out = []
        for d in replicas:
            name = d.segment.name
            if name not in routes:
                routes[name] = self.engine.route(d.segment)
            if routes[name] is not None:
                out.append((d, routes[name]))
        if len(out) > 1:
            out.sort(key=lambda dt: dt[1].rank)
        return out

    def _write_all(self, jobs: list[tuple[int, P.ReplicaDesc, memoryview]]) -> tuple[dict[int, bool], str]:
        """Write every (item index, replica, source) job. Returns ({index: all its
        writes OK}, why the failed ones failed: status and the transports' reasons)."""
        reqs = [TransferRequest(Op.WRITE, src, 0, d.segment, d.offset, d.length) for _, d, src in jobs]
        ok: dict[int, bool] = {i: True for i, _, _ in jobs}
        result = self.engine.transfer(reqs)
        why = ""
        for k, ((i, _, _), status) in enumerate(zip(jobs, result)):
            ok[i] = ok[i] and status == TransferStatus.COMPLETED
            if status != TransferStatus.COMPLETED and not why:
                why = result.describe(k)
        return ok, why

    def _read_all(self, jobs: list[tuple[int, list[P.ReplicaDesc], list[tuple[int, memoryview]]]]) -> dict[int, bool]:
        """Copy ranges of one replica of each item into destinations; {index: copied}.

        A job is (item index, replicas, [(offset in the value, destination view)]): each
        fragment reads len(destination) bytes. Each item reads its cheapest replica
        first (all items of one node in one exchange); the items that failed try their
        next replica, and so on. An item is copied only when all its fragments are.
        """
        routes: dict = {}
        options = {i: self._ranked(replicas, routes) for i, replicas, _ in jobs}
        frags = {i: fragments for i, _, fragments in jobs}
        done = {i: False for i in frags}
        pending, attempt = [i for i in frags if options[i]], 0
        while pending:
            owners, reqs = [], []
            for i in pending:
                d = options[i][attempt][0]
                for src, dst in frags[i]:
                    owners.append(i)
                    reqs.append(TransferRequest(Op.READ, dst, 0, d.segment, d.offset + src, len(dst)))
            ok = dict.fromkeys(pending, True)
            for i, status in zip(owners, self.engine.transfer(reqs)):
                ok[i] = ok[i] and status == TransferStatus.COMPLETED
            done.update(ok)
            attempt += 1
            pending = [i for i in pending if not done[i] and attempt < len(options[i])]
        return done

    def _read_bytes(self, handle: "ReadHandle") -> bytes:
        """The value behind ``handle`` as bytes, filled by one copy (memcpy out of the
        mapping, or the kernel's socket copy); tries each replica. Raises TransferFailed."""
        deadline = time.monotonic() + self.timeout_s
        why = Cancel()  # collects each replica's failure
        for desc, transport in self._ranked(handle.replicas):
            value = transport.read_bytes(desc.segment, desc.offset, handle.size, deadline, why)
            if value is not None:
                return value
        raise TransferFailed(f"get {handle.key!r}: no replica could be read ({'; '.join(why.reasons) or 'none reachable'})")

    # ------------------------------------------------------------ put

    def put(self, key: str, value, replica_num: int = 1, *, soft_pin: bool | None = None,
            soft_pin_ttl_ms: int | None = None, hard_pin: bool = False, preferred_segment: str = "") -> int:
        """Store ``value`` (bytes-like or C-contiguous numpy array) under ``key``.

        Args: replica_num: copies on distinct segments (best effort); soft_pin: True
        soft-pins the object (evicted only after unpinned ones) for ``soft_pin_ttl_ms``
        (None = the master's --soft-pin-ttl, at most its --max-soft-pin-ttl), False
        clears a soft pin, None keeps an existing one (an upsert; a new object has
        none) - Mooncake's SoftPinAction ENABLE / DISABLE / PRESERVE; hard_pin: never
        evicted; preferred_segment: segment name to place the first replica on.

        Returns the number of replicas stored (best effort: 1..replica_num).
        Raises ObjectExists (K01: nothing is stored), NoSpace, InvalidParams (empty key
        or value, a TTL without soft_pin=True or above the maximum), ObjectNotReady
        (another put of key in flight), TransferFailed (with the transport's cause).
        """
        return self._put(key, value, _item(key, replica_num, False, soft_pin, soft_pin_ttl_ms, hard_pin,
                                           preferred_segment))

    def upsert(self, key: str, value, replica_num: int = 1, *, soft_pin: bool | None = None,
               soft_pin_ttl_ms: int | None = None, hard_pin: bool = False, preferred_segment: str = "") -> int:
        """Like :meth:`put` but replaces an existing value; readers see old or new whole.
        By default (``soft_pin=None``) an existing soft pin is kept, as in Mooncake."""
        return self._put(key, value, _item(key, replica_num, True, soft_pin, soft_pin_ttl_ms, hard_pin,
                                           preferred_segment))

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

    def put_from(self, key: str, buf, size: int, replica_num: int = 1, *, offset: int = 0, **kw) -> int:
        """Put ``size`` bytes of ``buf`` starting at byte ``offset`` (zero-copy source:
        a RegisteredBuffer, or any object :meth:`register_buffer` accepts). Returns the
        replicas stored; raises InvalidParams when the range exceeds the buffer."""
        return self.put(key, _source(buf, offset, size), replica_num, **kw)

    def batch_put_from(self, keys: Sequence[str], bufs: Sequence, sizes: Sequence[int],
                       replica_num: int = 1, **kw) -> list[ErrorCode]:
        """:meth:`batch_put` of ``sizes[i]`` bytes at the start of ``bufs[i]`` (zero copy).
        An item whose size exceeds its buffer is INVALID_PARAMS."""
        if not len(keys) == len(bufs) == len(sizes):
            raise InvalidParams("batch_put_from needs as many buffers and sizes as keys")
        srcs = []
        for buf, size in zip(bufs, sizes):
            try:
                srcs.append(_source(buf, 0, size))
            except InvalidParams:
                srcs.append(b"")  # refused below as INVALID_PARAMS, like an empty value
        return self.batch_put(keys, srcs, replica_num, **kw)

    def _put(self, key: str, value, item: P.PutItem) -> int:
        check_key(key)
        src = as_byte_view(value)
        if len(src) == 0:
            raise InvalidParams("empty value (Mooncake refuses it: INVALID_PARAMS)")
        item.size = len(src)
        reply = self._call(P.PutStart(item, self.host_id), idempotent=False)
        detail = f": {reply.message}" if reply.message else ""
        raise_for(reply.code, f"put {key!r}: {code_name(reply.code)}{detail}")
        token = P.PutToken(key, reply.put_id)
        written, why = self._write_all([(0, d, src) for d in reply.replicas])
        if not written[0]:
            self._call(P.PutRevoke(token))
            raise TransferFailed(f"put {key!r}: writing a replica failed ({why})")
        raise_for(self._call(P.PutEnd(token)).code, f"put {key!r}: PutEnd refused")
        return len(reply.replicas)

    def batch_put(self, keys: Sequence[str], values: Sequence, replica_num: int = 1, *,
                  upsert: bool = False, soft_pin: bool | None = None, soft_pin_ttl_ms: int | None = None,
                  hard_pin: bool = False, preferred_segment: str = "") -> list[ErrorCode]:
        """Put many objects with one PutStart, one PutEnd (and one PutRevoke) RPC.
        Options as in :meth:`put`, for every item.

        Returns one ErrorCode per item: OK, OBJECT_ALREADY_EXISTS (also for the second of
        a duplicated key, K02), NO_AVAILABLE_HANDLE, INVALID_PARAMS, TRANSFER_FAIL...
        Raises InvalidParams for options that are wrong for every item.
        """
        if len(keys) != len(values):
            raise InvalidParams("batch_put needs as many values as keys")
        return self.batch_put_parts(keys, [(v,) for v in values], replica_num, upsert=upsert,
                                    soft_pin=soft_pin, soft_pin_ttl_ms=soft_pin_ttl_ms,
                                    hard_pin=hard_pin, preferred_segment=preferred_segment)

    def batch_put_parts(self, keys: Sequence[str], parts: Sequence[Sequence], replica_num: int = 1, *,
                        upsert: bool = False, soft_pin: bool | None = None, soft_pin_ttl_ms: int | None = None,
                        hard_pin: bool = False, preferred_segment: str = "") -> list[ErrorCode]:
        """:meth:`batch_put` where value ``i`` is the concatenation of the buffers
        ``parts[i]`` (bytes-like, numpy, CPU tensors), each written straight from where
        it lies (a gather write: e.g. a page header from a small buffer, then the page's
        regions of a registered host pool; nothing is joined in memory). Returns and
        raises as :meth:`batch_put`; an item whose parts are all empty is INVALID_PARAMS.
        """
        if len(keys) != len(parts):
            raise InvalidParams("batch_put_parts needs one list of parts per key")
        template = _item("", replica_num, upsert, soft_pin, soft_pin_ttl_ms, hard_pin, preferred_segment)
        codes = [ErrorCode.OK] * len(keys)
        srcs, sent = [], []
        for i, (key, item_parts) in enumerate(zip(keys, parts)):
            try:
                check_key(key)
                views = [v for v in (as_byte_view(p) for p in item_parts) if len(v)]
                if not views:
                    raise InvalidParams("empty value")
            except InvalidParams:
                codes[i] = ErrorCode.INVALID_PARAMS
                continue
            srcs.append(views)
            sent.append(i)
        if not sent:
            return codes
        items = [msgspec.structs.replace(template, key=keys[i], size=sum(map(len, views)))
                 for i, views in zip(sent, srcs)]
        results = self._call(P.BatchPutStart(items, self.host_id), idempotent=False).results
        jobs, tokens = [], {}
        for i, views, res in zip(sent, srcs, results):
            codes[i] = code_of(res.code)
            if res.code == ErrorCode.OK:
                tokens[i] = P.PutToken(keys[i], res.put_id)
                jobs.extend((i, piece, view) for d in res.replicas for piece, view in _pieces(d, views))
        written, _ = self._write_all(jobs)
        good = [i for i in tokens if written[i]]
        bad = [i for i in tokens if not written[i]]
        if bad:
            self._call(P.BatchPutRevoke([tokens[i] for i in bad]))
            for i in bad:
                codes[i] = ErrorCode.TRANSFER_FAIL
        if good:
            ends = self._call(P.BatchPutEnd([tokens[i] for i in good])).codes
            for i, code in zip(good, ends):
                codes[i] = code_of(code)
        return codes

    # ------------------------------------------------------------ get

    def query(self, key: str) -> ReadHandle:
        """Ask where ``key``'s replicas are and take a read lease (no bytes move).

        Returns a ReadHandle to pass to :meth:`read` / :meth:`read_into` before
        ``handle.deadline``. Raises ObjectNotFound, InvalidParams.
        """
        check_key(key)
        sent = time.monotonic()
        reply = self._call(P.GetReplicaList(key))
        raise_for(reply.code, f"{key!r}: {code_name(reply.code)}")
        return ReadHandle(key, reply.size, reply.replicas, sent + reply.lease_ttl_ms / 1000, reply.grant_id)

    def batch_query(self, keys: Sequence[str]) -> list[ReadHandle | ErrorCode]:
        """:meth:`query` for many keys in one RPC: a ReadHandle or an ErrorCode per key."""
        for key in keys:
            check_key(key)
        sent = time.monotonic()
        replies = self._call(P.BatchGetReplicaList(list(keys))).results
        return [
            ReadHandle(k, r.size, r.replicas, sent + r.lease_ttl_ms / 1000, r.grant_id) if r.code == ErrorCode.OK
            else code_of(r.code)
            for k, r in zip(keys, replies)
        ]

    def get_size(self, key: str) -> int:
        """Size of the value in bytes (grants a read lease). Raises ObjectNotFound."""
        handle = self.query(key)
        self.release([handle])
        return handle.size

    def read(self, handle: ReadHandle) -> bytes:
        """The value behind ``handle``. Raises LeaseExpired (no bytes; also for a spent
        handle), TransferFailed. The handle is spent afterwards (its grant returned).

        A same-host replica is one memcpy out of the mapped segment.
        """
        if not self._begin([handle])[0]:
            raise LeaseExpired(f"read handle of {handle.key!r} was already used: query again")
        try:
            out = self._read_bytes(handle)
        finally:
            self._finish([handle])
        handle.check_lease()
        return out

    def read_into(self, handle: ReadHandle, buf) -> int:
        """Copy the value behind ``handle`` into writable ``buf``; returns its size.

        Raises BufferOverflow (the message gives the value's and the buffer's sizes),
        LeaseExpired (buf content then undefined), TransferFailed.
        """
        n = self.batch_read_into([handle], [buf])[0]
        if n == ErrorCode.BUFFER_OVERFLOW:
            raise BufferOverflow(f"read of {handle.key!r}: the value is {handle.size} bytes, "
                                 f"the buffer {len(_destination(buf))} bytes")
        return self._check_read(n, handle)

    def batch_read_into(self, handles: Sequence[ReadHandle], bufs: Sequence) -> list[int]:
        """Copy each handle's value into its buffer: same-host replicas by memcpy, the
        rest with one TCP request per node. Per item the size or a negative ErrorCode
        (BUFFER_OVERFLOW, LEASE_EXPIRED, TRANSFER_FAIL); the lease is checked after the
        copy, so a late copy is never reported as a success. Every handle is spent
        afterwards (a spent one is LEASE_EXPIRED here, nothing copied)."""
        if len(handles) != len(bufs):
            raise InvalidParams("need as many buffers as handles")
        dsts = [_destination(buf) for buf in bufs]
        fresh = self._begin(handles)
        try:
            out, jobs = [], []
            for i, (h, dst, ok) in enumerate(zip(handles, dsts, fresh)):
                if not ok:
                    out.append(int(ErrorCode.LEASE_EXPIRED))
                elif len(dst) < h.size:
                    out.append(int(ErrorCode.BUFFER_OVERFLOW))
                else:
                    out.append(h.size)
                    jobs.append((i, h.replicas, [(0, dst[: h.size])]))
            done = self._read_all(jobs)
        finally:
            self._finish([h for h, ok in zip(handles, fresh) if ok])
        now = time.monotonic()
        for i, _, _ in jobs:
            if not done.get(i):
                out[i] = int(ErrorCode.TRANSFER_FAIL)
            elif now > handles[i].deadline:
                out[i] = int(ErrorCode.LEASE_EXPIRED)
            elif isinstance(bufs[i], RegisteredBuffer):
                bufs[i].after_read(0, out[i])
        return out

    def batch_read_ranges(self, handles: Sequence[ReadHandle], ranges: Sequence[Sequence[tuple[int, object]]]) -> list[list[int]]:
        """Copy only the requested byte ranges of each handle's value.

        ``ranges[i]``: (offset in the value, writable destination) pairs for
        ``handles[i]``; each reads len(destination) bytes. Only these bytes move (one
        exchange per node for the whole batch). Returns, per handle, per range: bytes
        copied, or a negative ErrorCode: INVALID_PARAMS (range outside the value, empty
        or read-only destination: nothing moves for it), TRANSFER_FAIL, LEASE_EXPIRED
        (the copy ended after the lease, or the handle was spent: its destination
        content is undefined). Every handle is spent afterwards."""
        if len(handles) != len(ranges):
            raise InvalidParams("need one list of ranges per handle")
        out: list[list[int]] = []
        jobs = []
        fresh = self._begin(handles)
        try:
            for i, (h, wanted, ok) in enumerate(zip(handles, ranges, fresh)):
                codes, frags = _plan_fragments(h.size, wanted)
                if not ok:
                    codes = [c if c < 0 else int(ErrorCode.LEASE_EXPIRED) for c in codes]
                out.append(codes)
                if frags and ok:
                    jobs.append((i, h.replicas, frags))
            done = self._read_all(jobs)
        finally:
            self._finish([h for h, ok in zip(handles, fresh) if ok])
        now = time.monotonic()
        for i, _, _ in jobs:
            failure = None if done.get(i) else ErrorCode.TRANSFER_FAIL
            if failure is None and now > handles[i].deadline:
                failure = ErrorCode.LEASE_EXPIRED
            if failure is not None:
                out[i] = [c if c < 0 else int(failure) for c in out[i]]
        return out

    def get(self, key: str) -> bytes:
        """The value of ``key``. Raises ObjectNotFound, LeaseExpired, TransferFailed."""
        return self.read(self.query(key))

    def get_into(self, key: str, buf) -> int:
        """Copy the value of ``key`` into the writable buffer ``buf``; returns its size.

        Raises ObjectNotFound, BufferOverflow (buf too small), LeaseExpired (buf content
        is then undefined), TransferFailed.
        """
        return self.read_into(self.query(key), buf)

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys``; None for a miss (not found, lease expired, transfer failed).

        One RPC for the replica lists; same-host values are one memcpy each, the rest
        one TCP request per node."""
        handles = self.batch_query(keys)
        found = [i for i, h in enumerate(handles) if isinstance(h, ReadHandle)]
        bufs = [bytearray(handles[i].size) for i in found]
        out: list[bytes | None] = [None] * len(handles)
        # bytearray then bytes: two copies, but one exchange per node for the whole batch
        for i, n, buf in zip(found, self.batch_read_into([handles[i] for i in found], bufs), bufs):
            out[i] = bytes(buf) if n >= 0 else None
        return out

    def batch_get_into(self, keys: Sequence[str], bufs: Sequence) -> list[int]:
        """Copy each value into its buffer; per item the size, or a negative ErrorCode
        (OBJECT_NOT_FOUND, BUFFER_OVERFLOW, LEASE_EXPIRED, TRANSFER_FAIL)."""
        if len(keys) != len(bufs):
            raise InvalidParams("batch_get_into needs as many buffers as keys")
        handles = self.batch_query(keys)
        idx = [i for i, h in enumerate(handles) if isinstance(h, ReadHandle)]
        out = [int(h) if not isinstance(h, ReadHandle) else 0 for h in handles]
        for i, n in zip(idx, self.batch_read_into([handles[i] for i in idx], [bufs[i] for i in idx])):
            out[i] = n
        return out

    @staticmethod
    def _check_read(n: int, handle: ReadHandle) -> int:
        if n < 0:
            raise_for(n, f"read of {handle.key!r}: {code_name(n)}")
        return n

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
        for key in keys:
            check_key(key)
        return [c == ErrorCode.OK for c in self._call(P.BatchExistKey(list(keys))).codes]

    def remove(self, key: str, force: bool = False) -> None:
        """Remove ``key``. Raises ObjectNotFound, ObjectHasLease (unless ``force``)."""
        check_key(key)
        raise_for(self._call(P.Remove(key, force)).code, f"remove {key!r}")

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[ErrorCode]:
        """One ErrorCode per key (OK, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE)."""
        for key in keys:
            check_key(key)
        return [code_of(c) for c in self._call(P.BatchRemove(list(keys), force)).codes]

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

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close every connection and mapping (queued ReadDones go first). Safe to call twice."""
        with self._grant_lock:
            self._closing, flusher = True, self._flusher
        if flusher is not None:
            self._done_waiting.set()
            flusher.join(self.timeout_s)
        done = self._take_done()
        if done and getattr(self._local, "chan", None) is not None:
            self._local.chan.notify(P.ReadDone(done))
        with self._lock:
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


def _item(key: str, replica_num: int, upsert: bool, soft_pin: bool | None, soft_pin_ttl_ms: int | None,
          hard_pin: bool, preferred_segment: str) -> P.PutItem:
    """The PutItem of one put (size filled in later). Raises InvalidParams for a TTL
    given without ``soft_pin=True`` or a negative one (Mooncake refuses both)."""
    if soft_pin_ttl_ms is not None and (soft_pin is not True or soft_pin_ttl_ms < 0):
        raise InvalidParams("soft_pin_ttl_ms needs soft_pin=True and must be >= 0")
    action = P.SOFT_PIN_PRESERVE if soft_pin is None else P.SOFT_PIN_ENABLE if soft_pin else P.SOFT_PIN_DISABLE
    return P.PutItem(key, 0, replica_num, upsert, action, bool(hard_pin), preferred_segment,
                     -1 if soft_pin_ttl_ms is None else int(soft_pin_ttl_ms))


def _source(buf, offset: int, size: int) -> memoryview:
    """``size`` bytes of ``buf`` at ``offset`` (a RegisteredBuffer is made current
    first). Raises InvalidParams when the range is outside the buffer."""
    if isinstance(buf, RegisteredBuffer):
        view = buf.region(offset, size)
        buf.before_write(offset, size)
        return view
    view = as_byte_view(buf)
    if offset < 0 or size < 0 or offset + size > len(view):
        raise InvalidParams(f"[{offset}, +{size}) exceeds the {len(view)}-byte buffer")
    return view[offset : offset + size]


def _pieces(replica: P.ReplicaDesc, views: list[memoryview]) -> list[tuple[P.ReplicaDesc, memoryview]]:
    """The replica's byte range cut into one range per source view, in order (a gather
    write of one value: each view lands right after the previous one)."""
    if len(views) == 1:
        return [(replica, views[0])]
    out, offset = [], replica.offset
    for view in views:
        out.append((msgspec.structs.replace(replica, offset=offset, length=len(view)), view))
        offset += len(view)
    return out


def _plan_fragments(size: int, wanted) -> tuple[list[int], list[tuple[int, memoryview]]]:
    """Per (offset in the value, destination) pair: its length, or INVALID_PARAMS for an
    empty or read-only destination or a range outside the ``size``-byte value; and the
    valid fragments to read."""
    codes, frags = [], []
    for src, buf in wanted:
        try:
            dst = _destination(buf)
        except InvalidParams:
            dst = None
        if dst is None or not len(dst) or src < 0 or src + len(dst) > size:
            codes.append(int(ErrorCode.INVALID_PARAMS))
            continue
        codes.append(len(dst))
        frags.append((src, dst))
    return codes, frags


def _destination(buf) -> memoryview:
    """Writable byte view to receive into (a RegisteredBuffer's host bytes).
    Raises InvalidParams for read-only memory."""
    if not isinstance(buf, RegisteredBuffer):
        return as_byte_view(buf, writable=True)
    if buf.view.readonly:
        raise InvalidParams("registered buffer is read-only: it cannot receive a value")
    return buf.view


__all__ = ["Client", "KVPoolError", "ReadHandle", "check_key"]
