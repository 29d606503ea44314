"""Log lines for a condition that recurs (a put placed short, a failing mount, a full
data port): said at once, then at most once per interval, with how often it happened
in between, so that a flood costs a line a minute, not a line per event."""

from __future__ import annotations

import threading
import time
from typing import Callable


class Throttle:
    """At most one line per ``every_s`` seconds of ``clock`` (seconds, monotonic; tests
    pass a fake one). Thread safe.

    :meth:`due` counts occurrences (``total``: all of them) and says whether a line is
    due: the occurrences since the last line (this call's included) when it is, else 0.
    The first occurrence is due; a call that counts none when none is untold says nothing
    and leaves the interval as it was."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic):
        self.every_s, self.clock = every_s, clock
        self._lock = threading.Lock()
        self._said: float | None = None  # clock() of the last line
        self._unsaid = 0  # occurrences since the last line
        self.total = 0  # occurrences counted in all

    def due(self, occurrences: int = 1) -> int:
        """Count ``occurrences``; the number since the last line if one is due now
        (``every_s`` passed since it, or none yet), else 0."""
        with self._lock:
            self._unsaid += occurrences
            self.total += occurrences
            now = self.clock()
            if not self._unsaid or (self._said is not None and now - self._said < self.every_s):
                return 0
            self._said, unsaid, self._unsaid = now, self._unsaid, 0
            return unsaid
