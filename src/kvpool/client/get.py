"""The get path of :class:`~kvpool.client.Client`: replica lists, leases, copies.

A read asks the master for the replica list (GetReplicaList / BatchGetReplicaList),
which grants a lease; the bytes are copied from the cheapest reachable replica (local,
shm, tcp; the next one on failure) and the lease is checked after the copy, so a late
copy never counts as a success.
"""

from __future__ import annotations

import time
from typing import Sequence

from kvpool import protocol as P
from kvpool.client import pipeline
from kvpool.client.grants import ReadHandle
from kvpool.client.hints import copy_timeout
from kvpool.client.keys import check_key, check_keys
from kvpool.errors import (BufferOverflow, ErrorCode, InvalidParams, KVPoolError, LeaseExpired, TransferFailed,
                           code_name, code_of, raise_for)
from kvpool.transfer import as_byte_view
from kvpool.transfer.buffers import RegisteredBuffer
from kvpool.transfer.epoch import MOUNT_WAIT_S
from kvpool.transfer.request import Cancel, Op, TransferRequest, TransferStatus, Transport

_OK = int(ErrorCode.OK)  # a plain int: an enum member's lookup costs per key of a batch


class GetPath:
    """The get methods of :class:`~kvpool.client.Client` (a mixin: it uses the client's
    ``_call``, ``engine``, ``timeout_s`` and the read grants of
    :class:`~kvpool.client.grants.ReadGrants`)."""

    def query(self, key: str) -> ReadHandle:
        """Ask where ``key``'s replicas are and take a read lease (no bytes move).

        Returns a ReadHandle to pass to :meth:`read` / :meth:`read_into` before
        ``handle.deadline``. Raises ObjectNotFound, InvalidParams.
        """
        check_key(key)
        sent = time.monotonic()
        return self._granted(key, self._call(P.GetReplicaList(key)), sent)

    def _granted(self, key: str, reply: P.GetResp, sent: float) -> ReadHandle:
        """The handle of a GetReplicaList ``reply`` to a request sent at ``sent``
        (time.monotonic). Raises ObjectNotFound (the key's location hint is dropped)."""
        if reply.code != ErrorCode.OK:
            self.hints.forget(key)
            raise_for(reply.code, f"{key!r}: {code_name(reply.code)}")
        return ReadHandle(key, reply.size, reply.replicas, sent + reply.lease_ttl_ms / 1000, reply.grant_id)

    def _query_hinted(self, key: str, copy) -> tuple[ReadHandle, object]:
        """:meth:`query` of ``key``, with a copy from its location hint while the master
        answers (:mod:`kvpool.client.hints`): ``copy(transport, replica, size)`` returns
        what it copied, or None/False. Returns (handle, what was copied): the handle is
        spent (its grant returned) when the copy counts; else the copy is None and the
        handle is to be read as usual. Raises ObjectNotFound, InvalidParams."""
        check_key(key)
        hint = self.hints.get(key)
        route = self.engine.route(hint.replica.segment) if hint is not None else None
        copied = []
        during = None if route is None else (lambda: copied.append(copy(route, hint.replica, hint.size)))
        sent = time.monotonic()
        reply = self._call(P.GetReplicaList(key), during=during)
        handle = self._granted(key, reply, sent)
        if copied and copied[0] and hint.confirmed_by(reply):
            self.hints.count("confirmed")
            self.release([handle])
            handle.check_lease()
            return handle, copied[0]
        if copied:
            self.hints.count("missed")
        ranked = self._ranked(reply.replicas)
        if ranked:
            self.hints.note(key, ranked[0][0], reply)
        return handle, None

    def batch_query(self, keys: Sequence[str]) -> list[ReadHandle | ErrorCode]:
        """:meth:`query` for many keys in one RPC: a ReadHandle or an ErrorCode per key.
        Raises InvalidParams (a bad key), KVPoolError (a malformed reply: its grants are
        returned)."""
        return self._batch_query(check_keys(keys))

    def _batch_query(self, keys: Sequence[str], during=None) -> list[ReadHandle | ErrorCode]:
        """:meth:`batch_query` of checked ``keys``; ``during`` runs while the master
        answers (:meth:`~kvpool.rpc.RpcChannel.call`)."""
        sent = time.monotonic()
        reply = self._call(P.BatchGetReplicaList(list(keys)), during=during)
        deadline, segments, replicas = sent + reply.lease_ttl_ms / 1000, reply.segments, reply.replicas
        out: list[ReadHandle | ErrorCode] = []
        try:
            for k, r in zip(keys, reply.results):
                if r.code != _OK:
                    out.append(code_of(r.code))
                elif len(r.places) == 1 and r.places[0][0] < len(segments):  # one replica: no list to build
                    at, offset = r.places[0]
                    out.append(ReadHandle(k, r.size, [P.ReplicaDesc(segments[at], offset, r.size)], deadline,
                                          r.grant_id))
                else:
                    out.append(ReadHandle(k, r.size, replicas(r), deadline, r.grant_id))
        except KVPoolError:  # a malformed reply: none of it is read, every grant goes back
            self.release([ReadHandle(k, r.size, [], deadline, r.grant_id)
                          for k, r in zip(keys, reply.results) if r.code == _OK])
            raise
        return out

    def _pipelined(self, keys: list[str], item_bytes: int, read) -> None:
        """Query ``keys`` (checked: :func:`check_keys`) chunk by chunk
        (:mod:`kvpool.client.pipeline`; ``item_bytes``: the values' size, 0 when
        unknown: then the first chunk's answer decides), calling ``read(start, handles,
        deadline)`` for each chunk (``start``: the index of its
        first key; a ReadHandle or an ErrorCode per key; ``deadline``: the batch's, for
        every copy) while the master answers the next chunk's query. Raises what a
        query or a read raised, after returning the grants of every chunk not read."""
        if not keys:
            return
        # one deadline for the whole batch: a node that stopped answering costs the
        # client's timeout once, not once per chunk (6.1 s instead of 1.0 before this)
        deadline = time.monotonic() + self.timeout_s
        granted: list[ReadHandle] = []  # released on a failure (a no-op for those read)

        def query(lo: int, hi: int, during=None) -> list:
            got = self._batch_query(keys[lo:hi], during=during)
            granted.extend(h for h in got if isinstance(h, ReadHandle))
            return got

        chunks = pipeline.get_spans(len(keys), item_bytes)
        try:
            handles = query(*chunks[0])
            if not item_bytes and len(chunks) > 2 and _largest(handles) >= pipeline.LARGE_VALUE:
                chunks = [chunks[0], (chunks[0][1], len(keys))]  # large values: no more chunks
            for k, (start, _) in enumerate(chunks):
                if k + 1 == len(chunks):
                    read(start, handles, deadline)
                    return
                this_chunk = pipeline.Overlap(lambda start=start, handles=handles: read(start, handles, deadline))
                handles = query(*chunks[k + 1], this_chunk)
                this_chunk.finish()
        except BaseException:
            self.release(granted)
            raise

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
        dst = _destination(buf)
        if len(dst) < handle.size:
            raise BufferOverflow(f"read of {handle.key!r}: the value is {handle.size} bytes, "
                                 f"the buffer {len(dst)} bytes")
        if not self._begin([handle])[0]:
            raise LeaseExpired(f"read handle of {handle.key!r} was already used: query again")
        try:  # one engine read in this thread: none of batch_read_into's bookkeeping
            copied = self._read_one(self._ranked(handle.replicas), [(0, dst[: handle.size])])
        finally:
            self._finish([handle])
        if not copied:
            raise TransferFailed(f"read of {handle.key!r}: no replica could be read")
        handle.check_lease()
        if isinstance(buf, RegisteredBuffer):
            buf.after_read(0, handle.size)
        return handle.size

    def batch_read_into(self, handles: Sequence[ReadHandle], bufs: Sequence) -> list[int]:
        """Copy each handle's value into its buffer: same-host replicas by memcpy, the
        rest with one TCP request per node. Per item the size or a negative ErrorCode
        (BUFFER_OVERFLOW, LEASE_EXPIRED, TRANSFER_FAIL); the lease is checked after the
        copy, so a late copy is never reported as a success. Every handle is spent
        afterwards (a spent one is LEASE_EXPIRED here, nothing copied)."""
        if len(handles) != len(bufs):
            raise InvalidParams("need as many buffers as handles")
        return self._read_handles(handles, [_destination(buf) for buf in bufs], bufs)

    def _read_handles(self, handles: Sequence[ReadHandle], dsts: Sequence[memoryview], bufs: Sequence,
                      deadline: float | None = None, own: bool = False) -> list[int]:
        """:meth:`batch_read_into` into the writable byte views ``dsts`` of ``bufs``, the
        copies given up at ``deadline`` (time.monotonic; None: the client's timeout from now).
        ``own``: the handles were made by the caller's own query and no one else holds
        them, so no read of them can be in progress or done: no bookkeeping per handle
        before the copies, only their grants returned after."""
        fresh = [True] * len(handles) if own else self._begin(handles)
        try:
            out, jobs = [], []
            for i, (h, dst, ok) in enumerate(zip(handles, dsts, fresh)):
                size = h.size
                if not ok:
                    out.append(int(ErrorCode.LEASE_EXPIRED))
                elif len(dst) < size:
                    out.append(int(ErrorCode.BUFFER_OVERFLOW))
                else:
                    out.append(size)
                    jobs.append((i, h.replicas, [(0, dst if len(dst) == size else dst[:size])]))
            done = self._read_all(jobs, deadline)
        finally:
            if own:
                self.release(handles)
            else:
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

    def open_views(self, handles: Sequence[ReadHandle]) -> "ValueViews":
        """Zero-copy access to values in same-host segments: per handle, a byte view of
        its value where a replica is mapped in this process (shm or in-process), else
        None (read that handle with :meth:`batch_read_into`: it is left unspent).

        For an engine that copies a value straight into its own memory in pieces (vLLM's
        per-layer blocks) without a staging copy. The views stay valid and the grants
        held until :meth:`ValueViews.close`, which says per handle whether the bytes
        copied out of its view may be kept (mount epoch unchanged, lease not expired);
        a view must not be used after it. The caller checks the bytes themselves (page
        header and checksum): a view is of the store's memory, not a snapshot.
        """
        routes: dict = {}
        found = []
        deadline = time.monotonic() + MOUNT_WAIT_S  # one wait for a mount in progress, for all
        for h in handles:
            hit = None
            for desc, transport in self._ranked(h.replicas, routes):
                hit = transport.value_view(desc.segment, desc.offset, h.size, deadline)
                if hit is not None:
                    break
            found.append(hit)
        began = self._begin([h for h, hit in zip(handles, found) if hit is not None])
        held = iter(began)
        found = [hit if hit is not None and next(held) else None for hit in found]
        return ValueViews(self, list(handles), found)

    def get(self, key: str) -> bytes:
        """The value of ``key``. Raises ObjectNotFound, LeaseExpired, TransferFailed.

        A key read before is copied from where it was while the master answers, and
        kept only if the answer confirms it (:mod:`kvpool.client.hints`)."""
        def copy(transport: Transport, replica: P.ReplicaDesc, size: int):
            return transport.read_bytes(replica.segment, replica.offset, size,
                                        time.monotonic() + copy_timeout(size, self.timeout_s), Cancel())

        handle, value = self._query_hinted(key, copy)
        return self.read(handle) if value is None else value

    def get_into(self, key: str, buf) -> int:
        """Copy the value of ``key`` into the writable buffer ``buf``; returns its size.

        Raises ObjectNotFound, BufferOverflow (buf too small), LeaseExpired, TransferFailed
        (buf content is then undefined). A key read before is copied as in :meth:`get`.
        """
        dst = _destination(buf)

        def copy(transport: Transport, replica: P.ReplicaDesc, size: int) -> bool:
            return size <= len(dst) and self.engine.read_into(transport, replica.segment, replica.offset, dst[:size],
                                                              copy_timeout(size, self.timeout_s))

        handle, copied = self._query_hinted(key, copy)
        if not copied:
            return self.read_into(handle, buf)
        if isinstance(buf, RegisteredBuffer):
            buf.after_read(0, handle.size)
        return handle.size

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys``; None for a miss (not found, lease expired, transfer failed).

        Pipelined (:mod:`kvpool.client.pipeline`): the replica lists of the next chunk
        of keys are asked for while this one is copied; same-host values are one
        memcpy each, the rest one TCP request per node and chunk. Raises InvalidParams
        (a bad key) before anything is asked."""
        keys = check_keys(keys)
        out: list[bytes | None] = [None] * len(keys)

        def read(start: int, handles: list, deadline: float) -> None:
            found = [j for j, h in enumerate(handles) if isinstance(h, ReadHandle)]
            bufs = [bytearray(handles[j].size) for j in found]
            # bytearray then bytes: two copies, but one exchange per node for the chunk
            got = self._read_handles([handles[j] for j in found], [memoryview(b) for b in bufs], bufs, deadline,
                                     own=True)
            for j, n, buf in zip(found, got, bufs):
                out[start + j] = bytes(buf) if n >= 0 else None

        self._pipelined(keys, 0, read)
        return out

    def batch_get_into(self, keys: Sequence[str], bufs: Sequence) -> list[int]:
        """Copy each value into its buffer; per item the size, or a negative ErrorCode
        (OBJECT_NOT_FOUND, BUFFER_OVERFLOW, LEASE_EXPIRED, TRANSFER_FAIL). Pipelined as
        :meth:`batch_get`. Raises InvalidParams (a bad key or a read-only buffer)
        before anything is asked or copied."""
        keys = check_keys(keys)
        if len(keys) != len(bufs):
            raise InvalidParams("batch_get_into needs as many buffers as keys")
        dsts = [_destination(buf) for buf in bufs]
        out = [int(ErrorCode.TRANSFER_FAIL)] * len(keys)  # until a chunk's read says otherwise

        def read(start: int, handles: list, deadline: float) -> None:
            found = []
            for j, h in enumerate(handles):
                if isinstance(h, ReadHandle):
                    found.append(j)
                else:
                    out[start + j] = int(h)
            got = self._read_handles([handles[j] for j in found], [dsts[start + j] for j in found],
                                     [bufs[start + j] for j in found], deadline, own=True)
            for j, n in zip(found, got):
                out[start + j] = n

        self._pipelined(keys, len(dsts[0]) if dsts else 0, read)
        return out

    def _ranked(self, replicas: list[P.ReplicaDesc], routes: dict | None = None) -> list[tuple[P.ReplicaDesc, Transport]]:
        """Reachable replicas with their transport, cheapest first (local, shm, tcp).
        ``routes`` caches segment name -> transport across the items of one batch."""
        routes = {} if routes is None else routes
        if len(replicas) == 1:  # the common case, once per key of a batch: no list to sort
            d = replicas[0]
            name = d.segment.name
            transport = routes[name] if name in routes else routes.setdefault(name, self.engine.route(d.segment))
            return [(d, transport)] if transport is not None else []
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

    def _read_all(self, jobs: list[tuple[int, list[P.ReplicaDesc], list[tuple[int, memoryview]]]],
                  deadline: float | None = None) -> dict[int, bool]:
        """Copy ranges of one replica of each item into destinations; {index: copied}.

        A job is (item index, replicas, [(offset in the value, destination view)]): each
        fragment reads len(destination) bytes. Each item reads its cheapest replica
        first (all items of one node in one exchange); the items that failed try their
        next replica, and so on. An item is copied only when all its fragments are.
        The reads of the cheapest replicas are given up at ``deadline`` (time.monotonic;
        None: the client's timeout from now), each next replica's at the client's
        timeout from when it is tried (a failover gets the time a single read gets).
        """
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        if len(jobs) > 1:
            local = self._read_local(jobs, deadline)
            if local is not None:
                return local
        routes: dict = {}
        options = {i: self._ranked(replicas, routes) for i, replicas, _ in jobs}
        frags = {i: fragments for i, _, fragments in jobs}
        done = {i: False for i in frags}
        if len(jobs) == 1:  # a single read: no request batch
            i = jobs[0][0]
            done[i] = self._read_one(options[i], frags[i], deadline)
            return done
        # whole values whose cheapest copy is in this host's memory gain nothing from a
        # request batch: a loop of memcpys per segment, then the next replica if need be
        local = {i for i in frags if options[i] and options[i][0][1].in_place and len(frags[i]) == 1}
        done.update(self._read_in_place(local, options, frags, deadline))
        for i in local:
            if not done[i]:
                done[i] = self._read_one(options[i][1:], frags[i])
        pending, attempt = [i for i in frags if options[i] and i not in local], 0
        while pending:
            owners, reqs = [], []
            for i in pending:
                item_reqs = _fragment_reads(options[i][attempt][0], frags[i])
                owners.extend([i] * len(item_reqs))
                reqs.extend(item_reqs)
            ok = dict.fromkeys(pending, True)
            timeout = pipeline.left(deadline) if attempt == 0 else None
            for i, status in zip(owners, self.engine.transfer(reqs, timeout)):
                ok[i] = ok[i] and status == TransferStatus.COMPLETED
            done.update(ok)
            attempt += 1
            pending = [i for i in pending if not done[i] and attempt < len(options[i])]
        return done

    def _read_local(self, jobs: list, deadline: float) -> dict[int, bool] | None:
        """:meth:`_read_all` in one pass when every job is one fragment of a value with
        one replica, in this host's memory (a batch get of small values from a local or
        mapped segment, the common case): no per-key ranking or bookkeeping, one
        :meth:`Transport.read_many` per segment mount. None when any job is not such a
        read (the general path then reads them all)."""
        def in_place(d: P.ReplicaDesc) -> Transport | None:
            transport = self.engine.route(d.segment)
            return transport if transport is not None and transport.in_place else None

        groups = _segment_groups(((i, replicas[0], fragments[0]) if len(replicas) == 1 and len(fragments) == 1
                                  else None for i, replicas, fragments in jobs), in_place)
        return None if groups is None else _copy_groups(groups, deadline)

    def _read_in_place(self, items: set[int], options: dict, frags: dict, deadline: float) -> dict[int, bool]:
        """:meth:`_read_all` of ``items``, each one whole value whose cheapest replica
        is in this host's memory: one :meth:`Transport.read_many` per segment mount (all
        its items kept or none); {index: copied}."""
        transports = {(d.segment.name, d.segment.epoch): transport for d, transport in (options[i][0] for i in items)}
        groups = _segment_groups(((i, options[i][0][0], frags[i][0]) for i in items),
                                 lambda d: transports[(d.segment.name, d.segment.epoch)])
        return _copy_groups(groups, deadline)

    def _read_one(self, options: list[tuple[P.ReplicaDesc, Transport]],
                  fragments: list[tuple[int, memoryview]], deadline: float | None = None) -> bool:
        """:meth:`_read_all` of one item: its fragments from its cheapest replica
        (``options``: :meth:`_ranked`), else the next one; True once all of them were
        copied from one replica. A single fragment (a whole value: get_into) is one
        engine read, no request batch. ``deadline`` (time.monotonic) bounds the read of
        the first replica; each next one gets the engine's timeout (None: all do)."""
        for k, (d, transport) in enumerate(options):
            timeout = pipeline.left(deadline) if k == 0 else None
            if len(fragments) == 1:
                src, dst = fragments[0]
                if self.engine.read_into(transport, d.segment, d.offset + src, dst, timeout):
                    return True
            elif all(status == TransferStatus.COMPLETED
                     for status in self.engine.transfer(_fragment_reads(d, fragments), timeout)):
                return True
        return False

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


def _segment_groups(reads, transport_of) -> list | None:
    """Group ``reads`` per segment mount (name and epoch: a stale grant fails only its
    own group): each read is (item index, replica, (offset in the value, destination)),
    or None, which gives up (returns None). ``transport_of(replica)`` is asked once
    per group for its transport; None gives up too. Returns groups as
    :func:`_copy_groups` takes them."""
    groups: dict[tuple[str, int], tuple[P.ReplicaDesc, Transport, list[int], list]] = {}
    for read in reads:
        if read is None:
            return None
        i, d, (src, dst) = read
        segment = d.segment
        group = groups.get((segment.name, segment.epoch))
        if group is None:
            transport = transport_of(d)
            if transport is None:
                return None
            group = groups[(segment.name, segment.epoch)] = (d, transport, [], [])
        group[2].append(i)
        group[3].append((d.offset + src, dst))
    return list(groups.values())


def _copy_groups(groups, deadline: float) -> dict[int, bool]:
    """One :meth:`Transport.read_many` per group (replica naming the segment, its
    transport, item indices, (offset in the segment, destination) ranges): all of a
    group's items copied or none; {index: copied}."""
    done: dict[int, bool] = {}
    for replica, transport, items, ranges in groups:
        done.update(dict.fromkeys(items, transport.read_many(replica.segment, ranges, deadline)))
    return done


def _fragment_reads(replica: P.ReplicaDesc, fragments: list[tuple[int, memoryview]]) -> list[TransferRequest]:
    """The READ requests of ``fragments`` ((offset in the value, destination) pairs) out
    of ``replica``: each reads len(destination) bytes."""
    return [TransferRequest(Op.READ, dst, 0, replica.segment, replica.offset + src, len(dst))
            for src, dst in fragments]


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


def _largest(handles: list) -> int:
    """The largest value size (bytes) among the ReadHandles of ``handles``; 0 if none."""
    return max((h.size for h in handles if isinstance(h, ReadHandle)), default=0)


def _destination(buf) -> memoryview:
    """Writable byte view to receive into (a RegisteredBuffer's host bytes).
    Raises InvalidParams for read-only memory."""
    if not isinstance(buf, RegisteredBuffer):
        return as_byte_view(buf, writable=True)
    if buf.view.readonly:
        raise InvalidParams("registered buffer is read-only: it cannot receive a value")
    return buf.view


class ValueViews:
    """What :meth:`GetPath.open_views` hands out: ``views[i]`` is a memoryview of
    ``handles[i]``'s value (``size`` bytes) or None. Close it once, when the copies out
    of the views have ended."""

    def __init__(self, client: GetPath, handles: list[ReadHandle], found: list):
        self._client, self.handles = client, handles
        self.views = [hit[0] if hit else None for hit in found]
        self._checks = [hit[1] if hit else None for hit in found]
        self._open = True

    def close(self) -> list[bool]:
        """Per handle: True if the bytes copied out of its view may be kept (it had a
        view, the segment's mount epoch is still the grant's, the lease had not run
        out). Returns the grants of the viewed handles to the master; idempotent after
        the first call (then all False)."""
        if not self._open:
            return [False] * len(self.handles)
        self._open = False
        now = time.monotonic()
        ok = [check is not None and check() and now <= h.deadline
              for h, check in zip(self.handles, self._checks)]
        self._client._finish([h for h, check in zip(self.handles, self._checks) if check])
        self.views = [None] * len(self.handles)
        return ok
