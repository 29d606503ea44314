"""Puts placed with fewer replicas than asked: counted, and logged now and then.

Placement is best effort, as Mooncake's allocation strategy is: a put asking for more
replicas than there are segments with room is stored with as many as fit (refused only
when none fits). A client says so, without a line per put.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from kvpool.throttle import Throttle

log = logging.getLogger("kvpool.client")
SHORTFALL_LOG_S = 60.0  # a put placing fewer replicas than asked is logged at most this often per client


class ReplicaShortfall:
    """Puts that placed fewer replicas than their ``replica_num`` (best effort: fewer
    segments with room than asked, as in Mooncake): ``count`` of them in all, and a
    WARNING at most once per ``every_s`` seconds of ``clock``, with how many there were
    since the last one. Thread safe."""

    def __init__(self, every_s: float = SHORTFALL_LOG_S, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self._log = Throttle(every_s, clock)

    @property
    def count(self) -> int:
        """Puts (batch items) placed short, since the client started."""
        return self._log.total

    def note(self, what: str, puts: int = 1) -> None:
        """Count ``puts`` short puts; log ``what`` (e.g. "put 'k': 1 of 3 replicas
        placed") unless a warning went out less than ``every_s`` ago."""
        untold = self._log.due(puts)
        if untold:
            log.warning("%s: fewer segments with room than replica_num (best effort, as in Mooncake); "
                        "%d put(s) placed short since the last such warning (said at most every %.0f s)",
                        what, untold, self.every_s)
