"""The client's side of allocation leases: the lease it puts into, bump-allocated.

A lease (:class:`~kvpool.protocol.AllocLeaseResp`) is a region of one segment this
client allocates values from itself: each value takes the next 64-aligned range, so
no range is handed out twice and a commit never overlaps an earlier one. A lease is
used for new values only until its deadline minus a margin, measured on this client's
clock from when it sent the AllocLease (never later than the master's grant); a value
that does not fit retires it and a new one is asked for, and one whose use ended
retires too (the client's lease keeper thread sees to it when no put comes). A retired
lease is returned (ReturnLease) once no write into it is in flight: the master then
frees its unused space at once, instead of holding it for the release timeout as it
does for an expired lease. Every method is thread-safe (one lock, held for no I/O).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from kvpool.protocol import ReplicaDesc

ALIGN = 64  # bytes; the master's allocation alignment: every value starts on one
MARGIN = 0.25  # share of a lease's TTL at its end in which no new value is placed
RETRY_S = 0.1  # seconds without a lease after the master refused one or granted a short one
# (a full pool: eviction soon makes room again; at most 10 AllocLease a second are spent)


@dataclass(slots=True, eq=False)
class ClientLease:
    """Lease ``lease_id`` over ``region``; ``use_until``: the time (the leases' clock) after which
    no value is placed in it; ``next``: offset of the next free byte (aligned);
    ``writing``: placements not yet finished; ``retired``: no more placements."""

    lease_id: int
    region: ReplicaDesc
    use_until: float
    next: int
    writing: int = 0
    retired: bool = False


def _rounded(size: int) -> int:
    return max(ALIGN, -(-size // ALIGN) * ALIGN)


class LocalLeases:
    """This client's current lease and the retired ones still being written into.

    ``want``: the lease size to ask the master for (bytes); ``max_value``: the largest
    value (bytes) put through a lease: half the last lease granted, else half of
    ``want``; a grant shorter than ``want`` lowers it for RETRY_S only (the pool was
    nearly full then, or the master grants small leases: either way larger values go
    the PutStart way meanwhile, then a lease of ``want`` is asked for again). ``clock``:
    time.monotonic by default.
    """

    def __init__(self, want: int, clock=time.monotonic):
        self.want = want
        self.clock = clock
        self.granted = want  # bytes of the last lease granted
        self._granted_at = 0.0  # when (clock) it was installed
        self.current: ClientLease | None = None
        self._lock = threading.Lock()
        self.refill = threading.Lock()  # one AllocLease at a time
        self._returns: list[int] = []  # retired, no write in flight: to return
        self._draining: dict[int, ClientLease] = {}  # retired, writes in flight
        self._retry_at = 0.0

    @property
    def max_value(self) -> int:
        if self.granted < self.want and self.clock() - self._granted_at >= RETRY_S:
            return self.want // 2  # a short grant is not the rule for ever
        return self.granted // 2

    def place(self, sizes: list[int]) -> tuple[ClientLease, list[int]] | None:
        """Offsets in the current lease for values of ``sizes`` bytes, in order: for as
        many of them as fit (at least the first; the rest are the caller's to put
        otherwise). One placement: call :meth:`finish` once its writes and commit are
        over. None when the lease is missing, past its use, or too full for the first."""
        with self._lock:
            lease = self.current
            if lease is None or self.clock() >= lease.use_until:
                return None
            end = lease.region.offset + lease.region.length
            offsets, pos = [], lease.next
            for size in sizes:
                rounded = _rounded(size)
                if pos + rounded > end:
                    break
                offsets.append(pos)
                pos += rounded
            if not offsets:
                return None
            lease.next, lease.writing = pos, lease.writing + 1
            return lease, offsets

    def wants_lease(self) -> bool:
        """False while the master's last refusal is recent (RETRY_S)."""
        return self.clock() >= self._retry_at

    def refused(self) -> None:
        """The master granted no lease: ask again only after RETRY_S."""
        self._retry_at = self.clock() + RETRY_S

    def install(self, lease_id: int, region: ReplicaDesc, sent_at: float, ttl_ms: int) -> None:
        """Make a granted lease current (the previous one retires); ``sent_at``: the
        time (``clock``) at which the AllocLease was sent."""
        use_until = sent_at + ttl_ms / 1000 * (1 - MARGIN)
        with self._lock:
            self._retire(self.current)
            self.current = ClientLease(lease_id, region, use_until, region.offset)
            self.granted, self._granted_at = region.length, self.clock()

    def retire_current(self) -> None:
        """Stop placing in the current lease."""
        with self._lock:
            self._retire(self.current)

    def retire_used_up(self) -> float | None:
        """Retire the current lease if its use is over; returns the time (``clock``) at
        which the (remaining) current lease's use ends, None when there is none."""
        with self._lock:
            lease = self.current
            if lease is not None and self.clock() >= lease.use_until:
                self._retire(lease)
                lease = None
            return None if lease is None else lease.use_until

    def has_returns(self) -> bool:
        return bool(self._returns)  # a plain read: a stale answer only delays a return

    def finish(self, lease: ClientLease, drop: bool = False) -> None:
        """One placement in ``lease`` is over (written and committed, or given up);
        ``drop``: the lease is unusable (refused, a stale epoch): place no more in it."""
        with self._lock:
            lease.writing -= 1
            if drop and self.current is lease:
                self._retire(lease)
            if lease.retired and lease.writing == 0 and self._draining.pop(lease.lease_id, None):
                self._returns.append(lease.lease_id)

    def take_returns(self, everything: bool = False) -> list[int]:
        """Ids of leases to return now (``everything``: also the current one and those
        still being written into: the client is closing)."""
        with self._lock:
            if everything:
                self._retire(self.current)
                self._returns.extend(self._draining)
                self._draining.clear()
            out, self._returns = self._returns, []
            return out

    def _retire(self, lease: ClientLease | None) -> None:
        if lease is None or lease.retired:
            return
        lease.retired = True
        if self.current is lease:
            self.current = None
        if lease.writing:
            self._draining[lease.lease_id] = lease
        else:
            self._returns.append(lease.lease_id)
