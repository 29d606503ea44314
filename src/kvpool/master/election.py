"""Leader election of HA masters on an etcd lease, and the fence of a leader that lost it.

Every master of a group runs :class:`Election` in a thread of its own. A master leads
while it holds the election key: it grants an etcd lease of ``ttl_s`` seconds and
creates the key (its advertised address as the value) attached to that lease in one
transaction that succeeds only when the key does not exist. It renews the lease every
``ttl_s / 3``. A standby tries the same transaction every ``ttl_s / 4``; the key is gone
when the leader revoked its lease (a clean stop) or etcd let it expire (the leader died
or stalled), so a standby takes over at most ``ttl_s + ttl_s / 4`` after the last
renewal of a dead leader, plus one round of its nodes mounting again.

The fence: the leader's right to grant ends at a deadline on its own monotonic clock,
``t0 + SAFETY * ttl`` where ``t0`` is taken *before* sending the request that granted or
renewed the lease (etcd starts the TTL when the request arrives, after ``t0``), so the
deadline passes before etcd can expire the lease and before any standby can create the
key, as long as the two clocks run at rates within ``1 - SAFETY`` (10 %) of each other.
The master checks :meth:`Election.refusal` before and after every request and before its
upkeep tick: a leader paused past its deadline (SIGSTOP, a long GC, a partition from
etcd) refuses everything from the moment it runs again, even before its renewal thread
has noticed, and then stops (``on_lost``). So two masters never both grant. Grants it
handed out before the deadline cannot be used against memory the next leader assigns:
the node fences the old mount epoch before it mounts with the new leader (K18).

A master that lost the lead never leads again in the same process (its metadata may be
stale): it stops, and its supervisor starts it again, as a standby.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvpool.etcd import Etcd, EtcdError
from kvpool.masters import DEFAULT_KEY

log = logging.getLogger("kvpool.master")
SAFETY = 0.9  # share of the lease TTL the leader trusts its own clock for


class Election:
    """Leader election for the master advertising ``value`` (its "host:port") under
    ``key`` on ``etcd``, with leases of ``ttl_s`` seconds (etcd may grant more).

    ``on_elected()`` is called once when this master starts to lead, ``on_lost()`` once
    when it stops leading (from the election thread; both must be thread-safe).
    ``clock``: monotonic seconds (tests step a fake one).
    """

    def __init__(self, etcd: Etcd, value: str, ttl_s: int = 5, key: str = DEFAULT_KEY,
                 on_elected: Callable[[], None] = lambda: None, on_lost: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic):
        self.etcd, self.value, self.ttl_s, self.key = etcd, value, ttl_s, key
        self.on_elected, self.on_lost = on_elected, on_lost
        self.clock = clock
        self.leader_until = 0.0  # leading while clock() < this (0: not leading)
        self.led = False  # this master has led (then lost: it never leads again)
        self.fenced = False  # its deadline passed once: it never grants again (leading())
        self.leader = ""  # the leader's address as last read from etcd
        self.lease_id = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ the fence

    def leading(self) -> bool:
        """True while this master may grant: it holds the key and its deadline is ahead.
        Once the deadline has passed it stays False for good, even if a late renewal
        then succeeds: requests refused meanwhile may have changed this master's memory
        after their handlers ran, changes no node was told of, so this incarnation must
        not serve again (it exits; a standby that takes its place rebuilds from the
        nodes' indexes). Before, a renewal that came back late restored the lead, and
        acknowledged commits were lost at the next failover."""
        if self.fenced:
            return False
        if self.clock() < self.leader_until:
            return True
        self.fenced = self.led
        return False

    def refusal(self) -> str | None:
        """None while leading, else why this master refuses requests."""
        if self.leading():
            return None
        if self.led:
            return "this master lost the lead (its etcd lease ran out); ask the new leader"
        return f"standby master; the leader is {self.leader or 'not known yet'}"

    # ------------------------------------------------------------ the thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvpool-election", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop campaigning; a leader revokes its lease so a standby takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.ttl_s)
        if self.leading():
            self.leader_until = 0.0
            try:
                self.etcd.revoke(self.lease_id)
            except EtcdError as exc:
                log.warning("could not revoke the leader lease: %s", exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.campaign():
                    break
            except EtcdError as exc:
                log.warning("election: %s", exc)
            self._stop.wait(self.ttl_s / 4)
        else:
            return
        self.on_elected()
        self._renew_until_lost()

    def campaign(self) -> bool:
        """One try to become the leader; True when this master now leads."""
        t0 = self.clock()
        lease_id, ttl = self.etcd.grant(self.ttl_s)
        if self.etcd.create(self.key, self.value, lease_id):
            self.ttl_s = ttl
            self.leader_until = t0 + SAFETY * ttl  # before led: leading() never sees led
            self.lease_id, self.led = lease_id, True  # with no deadline (that would fence it)
            self.leader = self.value
            log.info("elected leader (%s), lease %x of %d s", self.key, lease_id, ttl)
            return True
        self.etcd.revoke(lease_id)
        self.leader = self.etcd.get(self.key) or ""
        return False

    def renew(self) -> bool:
        """Renew the lease once; False when etcd says it is gone. Raises EtcdError."""
        t0 = self.clock()
        if not self.leading():
            return False  # fenced: no renewal restores the right to grant
        ttl = self.etcd.keepalive(self.lease_id)
        if ttl <= 0 or not self.leading():  # the lease is gone, or the deadline passed meanwhile
            return False
        self.leader_until = max(self.leader_until, t0 + SAFETY * ttl)
        return True

    def _renew_until_lost(self) -> None:
        why = ""
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not self.renew():
                    why = ("its deadline passed before a renewal came back" if self.fenced
                           else "etcd says the lease is gone")
                    break
            except EtcdError as exc:
                log.warning("lease renewal failed: %s", exc)
            if not self.leading():
                why = "no renewal succeeded before the deadline"
                break
        if self._stop.is_set():
            return
        self.leader_until = 0.0
        log.error("lost the lead (%s): etcd lease %x; refusing every request", why, self.lease_id)
        self.on_lost()
