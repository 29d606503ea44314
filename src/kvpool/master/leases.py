"""Read grants and zombies: what keeps a retired version's buffers allocated.

Every replica list the master hands out is a read grant with an id (kvpool's addition;
Mooncake keeps old buffers until the lease ends). An upserted-over or force-removed
version's buffers stay allocated (a :class:`~kvpool.master.objects.Zombie`) only while a
grant on that version is in flight, i.e. neither reported done by its reader (ReadDone)
nor expired; a taken-over put's buffers stay until its release timeout, because the dead
writer might still be writing. Times are seconds of the master's clock.

The number of zombie buffers and their (aligned) bytes are kept as zombies come and go,
so a stats request costs nothing per zombie.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from kvpool.master.objects import Grants, Replica, Zombie

Free = Callable[[list[Replica]], None]


class ReadGrants:
    """Open read grants (by id) and zombies over one master's segments.

    ``free(replicas)`` returns buffers to their segments; ``rounded(length)`` is the
    aligned size an allocation of ``length`` bytes takes (for the byte count);
    ``first_id``: the first grant id (random per master incarnation, never 0);
    ``idle(grants)``: called when the last open grant of a version that is not retired
    closes (the object table then drops its record of reads).
    """

    def __init__(self, free: Free, rounded: Callable[[int], int], first_id: int = 1,
                 idle: Callable[[Grants], None] | None = None):
        self._free, self._rounded, self._idle = free, rounded, idle
        # id -> (deadline, the version's Grants); in grant order, which is deadline
        # order (one TTL for all), so expiry pops the front
        self.open: OrderedDict[int, tuple[float, Grants]] = OrderedDict()
        self.zombies: dict[Zombie, None] = {}  # an ordered set
        self.zombie_buffers = 0
        self.zombie_bytes = 0
        self._next_id = first_id

    def grant(self, grants: Grants, deadline: float) -> int:
        """Open a grant on the version counted by ``grants``, ending at ``deadline``;
        returns its id (never 0)."""
        grant_id, self._next_id = self._next_id, self._next_id + 1
        self.open[grant_id] = (deadline, grants)
        grants.open += 1
        if deadline > grants.latest:  # not max(): this runs once per key of every get
            grants.latest = deadline
        return grant_id

    def done(self, grant_ids: list[int]) -> int:
        """Close the grants of ``grant_ids`` (unknown ids ignored); returns how many closed."""
        closed = 0
        for gid in grant_ids:
            entry = self.open.pop(gid, None)
            if entry is not None:
                closed += 1
                self._close(entry[1])
        return closed

    def expire(self, now: float) -> int:
        """Close every grant whose deadline passed; returns how many."""
        expired = 0
        while self.open:
            deadline, grants = self.open[next(iter(self.open))]
            if deadline > now:
                break
            self.open.popitem(last=False)
            expired += 1
            self._close(grants)
        return expired

    def retire(self, replicas: list[Replica], grants: Grants, now: float) -> None:
        """Take a version out of readers' reach: its buffers are freed now, or, while
        grants on it are in flight, kept as a zombie until the last of them closes."""
        if not replicas:
            return
        if grants.open and grants.latest > now:
            grants.zombie = Zombie(replicas, grants.latest, grants)
            self._hold(grants.zombie)
        else:
            self._free(replicas)

    def hold_until(self, replicas: list[Replica], free_at: float) -> None:
        """Keep an abandoned put's buffers until ``free_at``."""
        self._hold(Zombie(replicas, free_at))

    def free_due(self, now: float) -> None:
        """Free every zombie whose time has come."""
        for z in [z for z in self.zombies if z.free_at <= now]:
            self._release(z)

    def drop_segment(self, name: str) -> None:
        """Forget zombie buffers on segment ``name`` (being unmounted)."""
        for z in [z for z in self.zombies if any(r.segment == name for r in z.replicas)]:
            self._count(z, -1)
            z.replicas = [r for r in z.replicas if r.segment != name]
            if z.replicas:
                self._count(z, 1)
            else:
                del self.zombies[z]

    def held(self, by_readers: bool) -> list[Zombie]:
        """Zombies of retired versions (``by_readers``) or of abandoned puts."""
        return [z for z in self.zombies if (z.grants is not None) == by_readers]

    def nbytes(self, zombies: list[Zombie]) -> int:
        """Aligned bytes held by ``zombies``."""
        return sum(self._rounded(r.length) for z in zombies for r in z.replicas)

    def _close(self, grants: Grants) -> None:
        grants.open -= 1
        if grants.open == 0:
            if grants.zombie is not None:
                self._release(grants.zombie)
            elif self._idle is not None:
                self._idle(grants)

    def _hold(self, zombie: Zombie) -> None:
        self.zombies[zombie] = None
        self._count(zombie, 1)

    def _release(self, zombie: Zombie) -> None:
        if zombie in self.zombies:  # a zombie goes once: by its grants or its time
            del self.zombies[zombie]
            self._count(zombie, -1)
            self._free(zombie.replicas)

    def _count(self, zombie: Zombie, sign: int) -> None:
        self.zombie_buffers += sign * len(zombie.replicas)
        self.zombie_bytes += sign * self.nbytes([zombie])
