"""The put path of :class:`~kvpool.client.Client`: a lease commit, or PutStart/PutEnd.

A put of one replica (no preferred segment, at most half a lease) takes its place in
the client's allocation lease (:mod:`kvpool.client.lease`), writes it and commits it
(PutCommit): one master round trip; a batch commits all its items at once. Any other
put, and one whose lease the master no longer knows or whose write failed (a stale
mount epoch: the master restarted, the segment was mounted again), goes the other way:
it asks the master for replica places (PutStart / BatchPutStart), writes every replica,
then commits (PutEnd) or revokes (PutRevoke). Either way the bytes go through the
transfer engine straight from the caller's buffers (a value made of several parts is a
gather write), and put() returns and raises the same.
"""

from __future__ import annotations

import contextlib
import numbers
import threading
import time
from typing import Callable, Sequence

import msgspec

from kvpool import protocol as P
from kvpool.client import pipeline
from kvpool.client.keys import check_key, key_list
from kvpool.client.lease import ClientLease
from kvpool.errors import (ErrorCode, InvalidParams, KVPoolError, RpcFailed, TransferFailed, code_name, code_of,
                           raise_for)
from kvpool.rpc import RpcChannel
from kvpool.transfer import as_byte_view
from kvpool.transfer.buffers import RegisteredBuffer
from kvpool.transfer.request import Cancel, Op, TransferRequest, TransferStatus

# PutEnd's and PutRevoke's answers for a put the master does not have in flight
_FORGOTTEN = (ErrorCode.OBJECT_NOT_FOUND, ErrorCode.INVALID_WRITE)
# A put's commit (PutCommit, PutEnd) follows its write. A master idle through a long
# write sleeps, and waking it cost ~100 us on the 2-vCPU VM of docs/bench.md, so the
# put sends a Wake as its write ends (:meth:`PutPath._waker`): writes of at least
# WAKE_MIN_BYTES in all (shorter ones end within the master's own busy poll, 300 us),
# asking it to poll WAKE_BASE_US plus the bytes at WAKE_MIN_RATE (bytes per us: 1 GB/s);
# the commit's answer ends the poll sooner.
WAKE_MIN_BYTES = 256 << 10
WAKE_BASE_US = 200
WAKE_MIN_RATE = 1000


class PutPath:
    """The put methods of :class:`~kvpool.client.Client` (a mixin: it uses the client's
    ``_call``, ``engine``, ``host_id``, ``master_addr``, ``timeout_s``, ``_lock``,
    ``_closing``, and keeps ``owner_id``, ``leases`` (a
    :class:`~kvpool.client.lease.LocalLeases`, or None: no allocation leases),
    ``_keeper`` (the lease keeper thread), ``_lease_wake`` (wakes it) and
    ``replica_shortfall`` (a :class:`~kvpool.client.shortfall.ReplicaShortfall`))."""

    def put(self, key: str, value, replica_num: int = 1, *, soft_pin: bool | None = None,
            soft_pin_ttl_ms: int | None = None, hard_pin: bool = False, preferred_segment: str = "") -> int:
        """Store ``value`` (bytes-like or C-contiguous numpy array) under ``key``.

        Args: replica_num: copies on distinct segments (best effort); soft_pin: True
        soft-pins the object (evicted only after unpinned ones) for ``soft_pin_ttl_ms``
        (None = the master's --soft-pin-ttl, at most its --max-soft-pin-ttl), False
        clears a soft pin, None keeps an existing one (an upsert; a new object has
        none) - Mooncake's SoftPinAction ENABLE / DISABLE / PRESERVE; hard_pin: never
        evicted; preferred_segment: segment name to place the first replica on.

        Returns the number of replicas stored (best effort, as Mooncake places them:
        1..replica_num; fewer when fewer segments have room, e.g. replica_num above the
        live nodes). A put placed short is counted in ``replica_shortfall.count`` and
        logged at WARNING (logger ``kvpool.client``) at most once per
        :data:`~kvpool.client.shortfall.SHORTFALL_LOG_S` seconds per client.
        Raises ObjectExists (K01: nothing is stored), NoSpace, InvalidParams (empty key
        or value, a TTL without soft_pin=True or above the maximum), ObjectNotReady
        (another put of key in flight), TransferFailed (with the transport's cause;
        TIMEOUT once the client's ``timeout_s`` is spent: the put's writes, into its
        allocation lease and then the PutStart way, share that one deadline), RpcFailed
        (the master did not answer: its waits share that deadline too, so a put returns
        within about 1.25 x ``timeout_s`` whichever step hangs; whether a put whose commit
        went unanswered was applied, a query tells; also when the master forgot the put
        twice: a master restarted or failed over during it is tried once more).
        """
        return self._put(key, value, _item(key, replica_num, False, soft_pin, soft_pin_ttl_ms, hard_pin,
                                           preferred_segment))

    def upsert(self, key: str, value, replica_num: int = 1, *, soft_pin: bool | None = None,
               soft_pin_ttl_ms: int | None = None, hard_pin: bool = False, preferred_segment: str = "") -> int:
        """Like :meth:`put` but replaces an existing value; readers see old or new whole.
        By default (``soft_pin=None``) an existing soft pin is kept, as in Mooncake."""
        return self._put(key, value, _item(key, replica_num, True, soft_pin, soft_pin_ttl_ms, hard_pin,
                                           preferred_segment))

    def put_from(self, key: str, buf, size: int, replica_num: int = 1, *, offset: int = 0, **kw) -> int:
        """Put ``size`` bytes of ``buf`` starting at byte ``offset`` (zero-copy source:
        a RegisteredBuffer, or any object :meth:`register_buffer` accepts). Returns the
        replicas stored; raises InvalidParams when the range exceeds the buffer."""
        return self.put(key, _source(buf, offset, size), replica_num, **kw)

    def batch_put_from(self, keys: Sequence[str], bufs: Sequence, sizes: Sequence[int],
                       replica_num: int = 1, **kw) -> list[ErrorCode]:
        """:meth:`batch_put` of ``sizes[i]`` bytes at the start of ``bufs[i]`` (zero copy).
        An item whose size exceeds its buffer is INVALID_PARAMS."""
        keys = key_list(keys)
        try:
            same = len(keys) == len(bufs) == len(sizes)
        except TypeError:  # None or a number for the buffers or the sizes
            same = False
        if not same:
            raise InvalidParams("batch_put_from needs lists of as many buffers and sizes as keys")
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
        deadline = time.monotonic() + self.timeout_s  # one for every step of the put
        if self._leasable(item):
            code = next(iter(self._put_leased([item], [[src]], deadline)), None)
            if code == ErrorCode.OK:
                return 1
            if code is not None:
                # the client checked key and size: a refused commit is about its pin
                why = " (soft-pin TTL above the master's --max-soft-pin-ttl?)" if code == ErrorCode.INVALID_PARAMS else ""
                raise_for(code, f"put {key!r}: {code_name(code)}{why}")
            if not pipeline.left(deadline):
                raise TransferFailed(f"put {key!r}: TIMEOUT: the client's timeout_s "
                                     f"({self.timeout_s:g} s) ran out writing into its "
                                     "allocation lease; not tried the PutStart way")
        placed = self._put_started_one(key, item, src, deadline)
        if placed is None and pipeline.left(deadline):
            # the master that answered never heard of this put: it restarted, or another
            # took over (HA), between PutStart and PutEnd, so nothing of it was committed;
            # its bytes are still in the caller's buffer: once more, on that master
            placed = self._put_started_one(key, item, src, deadline)
        if placed is None:
            raise RpcFailed(f"put {key!r}: the master forgot the put while it was written "
                            "(a master restart or failover); nothing was stored")
        return placed

    def _put_started_one(self, key: str, item: P.PutItem, src: memoryview, deadline: float) -> int | None:
        """The PutStart / write / PutEnd way of :meth:`put`: the replicas stored, or None
        when the master does not know the put at its end (it answered PutEnd, or the
        PutRevoke of a failed write, OBJECT_NOT_FOUND or INVALID_WRITE: another
        incarnation, or the put was discarded), which :meth:`_put` tries once more."""
        reply = self._call(P.PutStart(item, self.host_id), idempotent=False, deadline=deadline)
        detail = f": {reply.message}" if reply.message else ""
        raise_for(reply.code, f"put {key!r}: {code_name(reply.code)}{detail}")
        token = P.PutToken(key, reply.put_id)
        jobs = [(0, d, src) for d in reply.replicas]
        written, why = self._write_all(jobs, deadline, self._waker(len(src) * len(jobs)))
        if not written[0]:
            revoked = self._revoke(P.PutRevoke(token), deadline)
            if revoked is not None and revoked.code in _FORGOTTEN:
                return None  # e.g. a write under the old master's mount epoch, fenced
            raise TransferFailed(f"put {key!r}: writing a replica failed ({why})")
        code = self._call(P.PutEnd(token), deadline=deadline).code
        if code in _FORGOTTEN:
            return None
        raise_for(code, f"put {key!r}: PutEnd refused")
        if len(reply.replicas) < item.replica_num:
            self.replica_shortfall.note(f"put {key!r}: {len(reply.replicas)} of "
                                        f"{item.replica_num} replicas placed")
        return len(reply.replicas)

    def batch_put(self, keys: Sequence[str], values: Sequence, replica_num: int = 1, *,
                  upsert: bool = False, soft_pin: bool | None = None, soft_pin_ttl_ms: int | None = None,
                  hard_pin: bool = False, preferred_segment: str = "") -> list[ErrorCode]:
        """Put many objects: those a lease takes with one PutCommit per lease filled
        (per chunk for 32 or more values of 64 KiB and more copied in this process, each
        committed while the next is written: :mod:`kvpool.client.pipeline`), the rest
        with one BatchPutStart, one BatchPutEnd (and one BatchPutRevoke) RPC. Options as
        in :meth:`put`, for every item.

        Returns one ErrorCode per item: OK, OBJECT_ALREADY_EXISTS (also for the second of
        a duplicated key, K02), NO_AVAILABLE_HANDLE, INVALID_PARAMS, TRANSFER_FAIL...
        An item placed with fewer than ``replica_num`` replicas is OK (as in Mooncake),
        counted and logged as in :meth:`put`; ``query(key).replicas`` lists them.
        Items the master forgot in a restart or failover are put again once, as in
        :meth:`put`. Raises InvalidParams for options that are wrong for every item.
        """
        keys, values = key_list(keys), list(values)
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
        keys, parts = key_list(keys), list(parts)  # keys checked per item below
        if len(keys) != len(parts):
            raise InvalidParams("batch_put_parts needs one list of parts per key")
        template = _item("", replica_num, upsert, soft_pin, soft_pin_ttl_ms, hard_pin, preferred_segment)
        codes = [ErrorCode.OK] * len(keys)
        srcs, sent = [], []
        for i, (key, item_parts) in enumerate(zip(keys, parts)):
            try:
                check_key(key)
                if len(item_parts) == 1:  # the usual value: one buffer
                    view = as_byte_view(item_parts[0])
                    views = [view] if len(view) else []
                else:
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
        rest = list(range(len(items)))
        settled: set[int] = set()
        deadline = time.monotonic() + self.timeout_s  # one for the batch's writes into leases
        leased = self._leasable_items(items)
        while leased:  # lease after lease, as long as the next items find a place
            done = self._put_leased([items[k] for k in leased], [srcs[k] for k in leased], deadline)
            for k, code in zip(leased, done):
                if code is not None:
                    codes[sent[k]] = code
                    settled.add(k)
            if not done or None in done:  # no place, or a failed write or lease: the PutStart way
                break
            leased = leased[len(done):]
        rest = [k for k in rest if k not in settled]
        for attempt in range(2):  # in the time left: the PutStart way may place them on another node
            if not rest:
                break
            try:
                started, forgotten = self._put_started([items[k] for k in rest], [srcs[k] for k in rest],
                                                       deadline)
            except RpcFailed:
                if not attempt:
                    raise
                break  # no master took the retry: the forgotten items keep their first codes
            for k, code in zip(rest, started):
                codes[sent[k]] = code
            # as in put(): items the master forgot in a restart or failover, once more
            rest = [rest[j] for j in forgotten]
        return codes

    def _put_started(self, items: list[P.PutItem], srcs: list[list[memoryview]],
                     deadline: float) -> tuple[list[ErrorCode], list[int]]:
        """Put ``items`` (values: the concatenation of ``srcs[i]``) with one PutStart,
        one PutEnd and one PutRevoke RPC, writes given up at ``deadline``
        (time.monotonic). Returns one code per item, and the indexes of the items the
        master did not know at their end (as in :meth:`_put_started_one`: nothing of
        them committed; their codes say why they failed if not tried again). Past
        ``deadline`` already: every item is TRANSFER_FAIL (as a timed-out write is),
        nothing sent."""
        if not pipeline.left(deadline):
            return [ErrorCode.TRANSFER_FAIL] * len(items), []
        codes = [ErrorCode.OK] * len(items)
        forgotten: list[int] = []
        results = self._call(P.BatchPutStart(items, self.host_id), idempotent=False, deadline=deadline).results
        jobs, tokens = [], {}
        for i, (item, views, res) in enumerate(zip(items, srcs, results)):
            codes[i] = code_of(res.code)
            if res.code == ErrorCode.OK:
                tokens[i] = P.PutToken(item.key, res.put_id)
                jobs.extend((i, piece, view) for d in res.replicas for piece, view in _pieces(d, views))
        written, _ = self._write_all(jobs, deadline, self._waker(sum(len(view) for _, _, view in jobs)))
        good = [i for i in tokens if written[i]]
        bad = [i for i in tokens if not written[i]]
        if bad:
            revoked = self._revoke(P.BatchPutRevoke([tokens[i] for i in bad]), deadline)
            for i in bad:
                codes[i] = ErrorCode.TRANSFER_FAIL
            if revoked is not None:  # e.g. writes under the old master's mount epoch, fenced
                forgotten += [i for i, code in zip(bad, revoked.codes) if code in _FORGOTTEN]
        if good:
            ends = self._call(P.BatchPutEnd([tokens[i] for i in good]), deadline=deadline).codes
            for i, code in zip(good, ends):
                codes[i] = code_of(code)
            forgotten += [i for i in good if codes[i] in _FORGOTTEN]
            short = [i for i in good if codes[i] == ErrorCode.OK
                     and len(results[i].replicas) < items[i].replica_num]
            if short:
                self.replica_shortfall.note(
                    f"batch put: {len(short)} of {len(items)} items placed short (item "
                    f"{items[short[0]].key!r}: {len(results[short[0]].replicas)} of "
                    f"{items[short[0]].replica_num} replicas)", len(short))
        return codes, sorted(forgotten)

    def _revoke(self, request: P.PutRevoke | P.BatchPutRevoke, deadline: float):
        """Withdraw puts whose writes failed, best effort: a revoke the master does not
        answer must not hide why the put failed (the write), and the master discards a
        put never ended after ``put_start_discard_timeout`` anyway (K04). Returns the
        reply (None: no answer)."""
        with contextlib.suppress(RpcFailed):
            return self._call(request, deadline=deadline)
        return None

    # ------------------------------------------------------------ allocation leases

    def _leasable(self, item: P.PutItem) -> bool:
        """Whether ``item`` may go through an allocation lease: one replica, no preferred
        segment, at most half a lease."""
        return bool(self._leasable_items([item]))

    def _leasable_items(self, items: list[P.PutItem]) -> list[int]:
        """The indexes of the ``items`` that may go through an allocation lease
        (:meth:`_leasable`), in order."""
        leases = self.leases
        if leases is None:
            return []
        limit = leases.max_value
        return [k for k, item in enumerate(items)
                if item.replica_num == 1 and not item.preferred_segment and item.size <= limit]

    def _put_leased(self, items: list[P.PutItem], srcs: list[list[memoryview]],
                    deadline: float | None = None) -> list[ErrorCode | None]:
        """Place a prefix of ``items`` in the lease (as many as fit), write them and
        commit them, pipelined where that pays (:mod:`kvpool.client.pipeline`,
        ``put_spans``: chunk k is committed while chunk k+1 is written; a commit follows
        its chunk's writes). One code per
        placed item (the list is as long as the prefix placed: empty when none was);
        None: put it the PutStart way (the lease refused or unknown to the master, the
        write failed). Writes are given up at ``deadline`` (time.monotonic; None: the
        client's timeout from now)."""
        placed = self._place([item.size for item in items], deadline)
        if placed is None:
            return []
        lease, offsets = placed
        codes: list[ErrorCode | None] = [None] * len(offsets)
        try:
            route = self.engine.route(lease.region.segment)
            in_place = route is not None and route.in_place
            chunks = pipeline.put_spans(len(offsets), items[0].size, in_place)
            written: dict[int, bool] = {}
            if in_place:
                def write(start: int, end: int, wake: Callable[[], None] | None = None) -> None:
                    ok = self._write_lease_in_place(route, lease.region.segment, offsets[start:end],
                                                    srcs[start:end], deadline, wake)
                    written.update(dict.fromkeys(range(start, end), ok))
            else:
                jobs: list[list] = []
                for i, (offset, views) in enumerate(zip(offsets, srcs)):
                    desc = msgspec.structs.replace(lease.region, offset=offset, length=items[i].size)
                    jobs.append([(i, piece, view) for piece, view in _pieces(desc, views)])

                def write(start: int, end: int, wake: Callable[[], None] | None = None) -> None:
                    written.update(self._write_all([job for item_jobs in jobs[start:end] for job in item_jobs],
                                                   deadline, wake)[0])

            # the first commit only: the later ones are sent while the next chunk is written
            write(*chunks[0], self._waker(sum(items[i].size for i in range(*chunks[0]))))
            for k, (start, end) in enumerate(chunks):
                nxt = None if k + 1 == len(chunks) else pipeline.Overlap(lambda k=k: write(*chunks[k + 1]))
                ready = [i for i in range(start, end) if written[i]]
                if ready:
                    commit = P.PutCommit(self.owner_id, lease.lease_id,
                                         [_commit_item(items[i], offsets[i]) for i in ready])
                    # sent again when its reply is lost: the master answers OK for what it applied
                    for i, code in zip(ready, self._call(commit, during=nxt, deadline=deadline).codes):
                        codes[i] = None if code == ErrorCode.LEASE_EXPIRED else code_of(code)
                if nxt is not None:
                    nxt.finish()  # written now if no commit carried it; what it raised, raised
        finally:
            # a failed write (a stale mount epoch?) or an unknown lease: place no more in it
            self.leases.finish(lease, drop=None in codes)
            self._wake_keeper()
        return codes

    def _write_lease_in_place(self, transport, segment: P.SegmentInfo, offsets: list[int],
                              srcs: list[list[memoryview]], deadline: float | None,
                              wake: Callable[[], None] | None) -> bool:
        """Write values placed in a lease on ``segment``, which ``transport`` copies in
        this process (value i, the concatenation of ``srcs[i]``, at ``offsets[i]``):
        one ``write_many`` for them all, as :meth:`_write_in_place` does, without a
        request per value; ``wake`` (if given) called first. True when every copy was
        made (False: a stale mount epoch, no memory for the pages; the values then go
        the PutStart way, which says what failed). ``deadline``: time.monotonic, None:
        the client's timeout from now."""
        ranges = []
        for pos, views in zip(offsets, srcs):
            for view in views:  # a gather write: each part right after the previous one
                ranges.append((pos, view))
                pos += len(view)
        if wake is not None:
            wake()
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        return transport.write_many(segment, ranges, deadline, Cancel())

    def _place(self, sizes: list[int], deadline: float | None = None) -> tuple[ClientLease, list[int]] | None:
        """Offsets for (a prefix of) values of ``sizes`` in the current lease, asking
        the master for a new lease when it is missing, full or near its end; None: no
        lease to be had, or the first value does not fit in the one granted (the put
        goes the PutStart way, which says what is wrong). Raises the AllocLease's
        RpcFailed when it leaves no time before ``deadline``: the master did not answer
        within the put's timeout, and the PutStart way would get no time to say so."""
        leases = self.leases
        placed = leases.place(sizes)
        if placed is not None or not leases.wants_lease():
            return placed
        with leases.refill:
            placed = leases.place(sizes)  # another thread may have got one meanwhile
            if placed is not None:
                return placed
            sent = time.monotonic()
            try:
                reply = self._call(P.AllocLease(self.owner_id, leases.want, self.host_id), idempotent=False,
                                   deadline=deadline)
            except KVPoolError as exc:
                reply, failed = None, exc  # the PutStart way will say what is wrong
            else:
                failed = None
            if reply is None or reply.code != ErrorCode.OK:
                leases.retire_current()
                leases.refused()
                if isinstance(failed, RpcFailed) and deadline is not None and not pipeline.left(deadline):
                    raise failed
            else:
                leases.install(reply.lease_id, reply.region, sent, reply.ttl_ms)
                placed = leases.place(sizes)
                if placed is None:  # a small segment's lease: back at once, not held unused
                    leases.retire_current()
                self._start_keeper()
                self._lease_wake.set()  # the keeper learns the new lease's end of use
        # at once, not by the keeper: a put through PutStart may need that space next
        self._return_leases(deadline=deadline)
        return placed

    def _waker(self, nbytes: int) -> Callable[[], None] | None:
        """For a write of ``nbytes`` in all that this thread's commit follows: a callable
        that sends a :class:`~kvpool.protocol.Wake` on this thread's master connection
        (once, however often called; a failed send only means no poll), or None when the
        write is too short to need one (:data:`WAKE_MIN_BYTES`)."""
        if nbytes < WAKE_MIN_BYTES:
            return None
        chan, wake, once = self._channel(), P.Wake(WAKE_BASE_US + nbytes // WAKE_MIN_RATE), threading.Lock()

        def send() -> None:  # lanes may report their payloads sent from several threads at once
            if once.acquire(blocking=False):
                chan.notify(wake)
        return send

    def _return_leases(self, everything: bool = False, deadline: float | None = None) -> None:
        """Send ReturnLease, on this thread's connection, for the retired leases no write
        is in flight into (``everything``: all, the client is closing), waiting for the
        master until ``deadline`` (time.monotonic; None: the client's timeout). Best
        effort: a lease not returned expires on the master."""
        ids = self.leases.take_returns(everything)
        if ids:
            with contextlib.suppress(KVPoolError, OSError):
                self._call(P.ReturnLease(self.owner_id, ids), deadline=deadline)

    def _wake_keeper(self) -> None:
        """Have the lease keeper return retired leases (a put never waits for it)."""
        if self.leases.has_returns():
            self._lease_wake.set()

    def _keep_leases(self) -> None:
        """Lease keeper thread, on a master connection of its own: returns retired
        leases, and retires the current one when its use ends, so that an idle client's
        lease is freed at once rather than expiring (the master would hold its unused
        space for the release timeout)."""
        chan = RpcChannel(self.master_addr, self.timeout_s, local=not self.force_tcp)
        until = self.leases.retire_used_up()
        try:
            while True:
                self._lease_wake.wait(None if until is None else max(0.0, until - time.monotonic()) + 0.001)
                self._lease_wake.clear()
                if self._closing:
                    return
                until = self.leases.retire_used_up()
                ids = self.leases.take_returns()
                if ids:
                    with contextlib.suppress(KVPoolError, OSError):
                        chan.call(P.ReturnLease(self.owner_id, ids))
        finally:
            chan.close()

    def _start_keeper(self) -> None:
        with self._lock:
            if self._keeper is None and not self._closing:
                self._keeper = threading.Thread(target=self._keep_leases, name="kvpool-lease-keeper", daemon=True)
                self._keeper.start()

    def _write_all(self, jobs: list[tuple[int, P.ReplicaDesc, memoryview]],
                   deadline: float | None = None, wake: Callable[[], None] | None = None) -> tuple[dict[int, bool], str]:
        """Write every (item index, replica, source) job by ``deadline`` (time.monotonic;
        None: the client's timeout from now). ``wake`` (:meth:`_waker`) is called before
        a copy in this process (the master then polls through it) or else once a
        transport has handed the payload to the kernel (the node still taking it in).
        Returns ({index: all its writes OK}, why the failed ones failed: status and the
        transports' reasons)."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        if len(jobs) == 1:  # a single put: the engine's one-copy write, no request batch
            return self._write_one(*jobs[0], deadline, wake)
        ok: dict[int, bool] = {i: True for i, _, _ in jobs}
        why, rest = self._write_in_place(jobs, ok, deadline, wake)
        if not rest:
            return ok, why
        reqs = [TransferRequest(Op.WRITE, src, 0, d.segment, d.offset, d.length) for _, d, src in rest]
        result = self.engine.transfer(reqs, pipeline.left(deadline), wake)
        for k, ((i, _, _), status) in enumerate(zip(rest, result)):
            ok[i] = ok[i] and status == TransferStatus.COMPLETED
            if status != TransferStatus.COMPLETED and not why:
                why = result.describe(k)
        return ok, why

    def _write_in_place(self, jobs: list[tuple[int, P.ReplicaDesc, memoryview]],
                        ok: dict[int, bool], deadline: float,
                        wake: Callable[[], None] | None = None) -> tuple[str, list]:
        """Write the jobs whose segment is in this host's memory, one
        :meth:`Transport.write_many` per segment (a loop of memcpys: no request objects,
        no batch; ``wake``, if given, called before the first); their items' entries of
        ``ok`` turn False when that failed. Returns (why the first failure failed, the
        other jobs)."""
        groups: dict[tuple[str, int], list] = {}
        for job in jobs:
            groups.setdefault((job[1].segment.name, job[1].segment.epoch), []).append(job)
        why, rest = "", []
        for group in groups.values():
            segment = group[0][1].segment
            transport = self.engine.route(segment)
            if transport is None or not transport.in_place:
                rest.extend(group)
                continue
            if wake is not None:
                wake()
            cancel = Cancel()
            if not transport.write_many(segment, [(d.offset, src) for _, d, src in group], deadline, cancel):
                for i, _, _ in group:
                    ok[i] = False
                why = why or "FAILED: " + "; ".join(cancel.reasons)
        return why, rest

    def _write_one(self, i: int, replica: P.ReplicaDesc, src: memoryview,
                   deadline: float, wake: Callable[[], None] | None = None) -> tuple[dict[int, bool], str]:
        """:meth:`_write_all` of the one job (``i``, ``replica``, ``src``)."""
        transport = self.engine.route(replica.segment)
        if transport is None:
            return {i: False}, f"INVALID: no transport reaches segment {replica.segment.name}"
        if wake is not None and transport.in_place:
            wake()
            wake = None
        cancel = Cancel(wake)
        if self.engine.write_from(transport, replica.segment, replica.offset, src, pipeline.left(deadline), cancel):
            return {i: True}, ""
        return {i: False}, "FAILED: " + "; ".join(cancel.reasons)


def _item(key: str, replica_num: int, upsert: bool, soft_pin: bool | None, soft_pin_ttl_ms: int | None,
          hard_pin: bool, preferred_segment: str) -> P.PutItem:
    """The PutItem of one put (size filled in later). Raises InvalidParams for a
    ``replica_num`` below 1, or a TTL given without ``soft_pin=True`` or a negative one
    (Mooncake refuses all three), and either above what the wire carries (the master's
    own limits are lower: its reply says which)."""
    if isinstance(replica_num, bool) or not isinstance(replica_num, numbers.Integral) or \
            not 1 <= replica_num <= P.MAX_REPLICAS:
        raise InvalidParams(f"replica_num must be an int in 1..{P.MAX_REPLICAS}, got {replica_num!r}")
    if soft_pin_ttl_ms is not None and (soft_pin is not True or not isinstance(soft_pin_ttl_ms, numbers.Integral)
                                        or not 0 <= soft_pin_ttl_ms <= P.MAX_TTL_MS):
        raise InvalidParams(f"soft_pin_ttl_ms needs soft_pin=True and must be an int in 0..{P.MAX_TTL_MS}, "
                            f"got {soft_pin_ttl_ms!r}")
    action = P.SOFT_PIN_PRESERVE if soft_pin is None else P.SOFT_PIN_ENABLE if soft_pin else P.SOFT_PIN_DISABLE
    return P.PutItem(key, 0, int(replica_num), upsert, action, bool(hard_pin), preferred_segment,
                     -1 if soft_pin_ttl_ms is None else int(soft_pin_ttl_ms))


def _commit_item(item: P.PutItem, offset: int) -> P.CommitItem:
    """The PutCommit entry of ``item`` written at ``offset`` of its lease's segment."""
    return P.CommitItem(item.key, offset, item.size, item.upsert, item.soft_pin, item.hard_pin,
                        item.soft_pin_ttl_ms)


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
