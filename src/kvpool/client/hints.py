"""Where a key's value was last seen: location hints for reads that overlap the master.

A single get costs a round trip to the master for the replica list, then the copy. A
client that read a key before knows where its value was: the copy can run while the
master answers (:meth:`~kvpool.rpc.RpcChannel.call`'s ``during``), and the master's
answer decides afterwards whether the bytes copied count. On this 2-vCPU VM a 1 MiB get
over shared memory took 225-235 us as query then copy (56 + 170), against a memcpy of
160 (docs/bench.md).

When a copy made from a hint counts (the argument, in full):

- A commit version is unique within a master incarnation (wall-clock nanoseconds,
  strictly increasing), and a segment's mount epoch is new for every mount by every
  incarnation (:class:`~kvpool.protocol.SegmentInfo`). So (segment name, epoch, offset,
  length, commit version) names one set of bytes that never changes while the version
  is alive: the master frees a replica's buffers only after retiring it (replaced,
  removed, evicted, its segment unmounted), and a retired version never comes back.
- The hint came from a reply that named that replica of that version, so the version
  was alive before the copy began. The new reply names the same replica of the same
  version, so it is alive now, hence it was alive all along: nobody else's bytes were
  in the range while it was copied.
- Anything else (another version, another replica list, not found, a failed copy) is a
  miss: the copy is discarded and the value read again from the new reply, as without a
  hint. The destination then held other bytes meanwhile (get_into's buffer content is
  undefined when a get fails, as in Mooncake).

A copy from a hint over the network is bounded by :func:`copy_timeout`, so a node that
stopped answering costs a get a fraction of a second, not the client's timeout.

Memory is bounded: at most :data:`HINTS_KEPT` keys (oldest dropped first), about 260
bytes each beyond the key string (4 MiB in all; replicas share one SegmentInfo per mount).
"""

from __future__ import annotations

import threading
from collections import Counter

from kvpool import protocol as P

HINTS_KEPT = 16384  # keys whose last replica list is remembered
# a copy from a hint over the network gives up after a base time plus its bytes at this
# rate: a node that stopped answering (its replicas since dropped by the master) costs a
# get that long, not the whole transfer timeout, before the answer's replicas are read
HINT_COPY_BASE_S = 0.1
HINT_COPY_MIN_BPS = 100e6
SEGMENTS_KEPT = 4096  # segment mounts their replicas name (then the memory starts afresh)


def copy_timeout(size: int, timeout_s: float) -> float:
    """Seconds a copy of ``size`` bytes from a hint may take: :data:`HINT_COPY_BASE_S`
    plus the bytes at :data:`HINT_COPY_MIN_BPS`, at most ``timeout_s`` (the client's)."""
    return min(timeout_s, HINT_COPY_BASE_S + size / HINT_COPY_MIN_BPS)


class Hint:
    """The replica to copy from, the value's ``size`` (bytes) and commit ``version``."""

    __slots__ = ("replica", "size", "version")

    def __init__(self, replica: P.ReplicaDesc, size: int, version: int):
        self.replica, self.size, self.version = replica, size, version

    def confirmed_by(self, reply: P.GetResp) -> bool:
        """True when ``reply`` (the master's answer, taken after the copy) shows the
        hinted replica still holds this version: the copy counts (module docstring)."""
        return (reply.code == 0 and reply.version == self.version and reply.size == self.size
                and self.replica in reply.replicas)


class LocationHints:
    """Thread-safe bounded map key -> :class:`Hint`, filled from the master's replies.
    ``kept``: most keys remembered (0 turns hints off)."""

    def __init__(self, kept: int = HINTS_KEPT):
        self.kept = kept
        self.counts: Counter[str] = Counter()  # copies from a hint: "confirmed", "missed"
        self._hints: dict[str, Hint] = {}
        self._segments: dict[P.SegmentInfo, P.SegmentInfo] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> Hint | None:
        return self._hints.get(key)

    def note(self, key: str, replica: P.ReplicaDesc, reply: P.GetResp) -> None:
        """Remember that ``key``'s value (``reply``: an OK GetResp with a version) is
        readable at ``replica``, one of ``reply.replicas``."""
        if not self.kept or not reply.version:
            return
        with self._lock:
            # one SegmentInfo per mount for all hints (a decoded reply brings its own copy)
            segment = self._segments.setdefault(replica.segment, replica.segment)
            if len(self._segments) > SEGMENTS_KEPT:
                self._segments = {segment: segment}
            self._hints.pop(key, None)  # re-inserted last: the oldest go first
            if len(self._hints) >= self.kept:
                del self._hints[next(iter(self._hints))]
            self._hints[key] = Hint(P.ReplicaDesc(segment, replica.offset, replica.length),
                                    reply.size, reply.version)

    def count(self, outcome: str) -> None:
        """Count a copy from a hint: ``outcome`` "confirmed" or "missed"."""
        with self._lock:
            self.counts[outcome] += 1

    def forget(self, key: str) -> None:
        with self._lock:
            self._hints.pop(key, None)
