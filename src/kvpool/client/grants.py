"""Read grants of :class:`~kvpool.client.Client`: handles, and ReadDone sent back.

Each replica list the master hands out carries a grant id. Once the copy of a handle has
finished (success or failure) the handle is spent (reading it again fails with
LEASE_EXPIRED: query again) and its grant id is queued for ``ReadDone``, a message the
master never answers: it rides in the same write as this client's next request, or, if
none comes within :data:`DONE_DELAY_S`, goes alone from a small flusher thread (see
:mod:`kvpool.client.client` for the figures).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from kvpool import protocol as P
from kvpool.errors import LeaseExpired
from kvpool.rpc import RpcChannel

DONE_DELAY_S = 0.01  # a ReadDone waits this long for a request to ride on, then goes alone


@dataclass(slots=True)  # one per key of a batch get: slots make it cheaper to build and read
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


class ReadGrants:
    """The grant bookkeeping part of :class:`~kvpool.client.Client` (a mixin: it uses
    the client's ``_grant_lock``, ``_done``, ``_done_waiting``, ``_flusher``,
    ``_closing``, ``master_addr`` and ``timeout_s``)."""

    def _take_done(self) -> list[int]:
        with self._grant_lock:
            done, self._done = self._done, []
        return done

    def _flush_done(self) -> None:
        """Flusher thread: sends queued grant ids that found no request to ride on
        within DONE_DELAY_S, on a master connection of its own."""
        chan = RpcChannel(self.master_addr, self.timeout_s, local=not self.force_tcp)
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
