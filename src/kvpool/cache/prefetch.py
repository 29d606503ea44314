"""Prefetch handles: the state of one L3 -> L2 prefetch, readable from any thread.

Completion follows K12: a prefetch is *done* only when its plan exists (how many pages
L3 holds for the tail, on this rank) and every planned page landed.
A plan of zero pages is a real outcome: done at once, with ``planned == 0``.
"""

from __future__ import annotations

import threading
import time

from kvpool.cache.policies import PrefetchConfig
from kvpool.cache.tree import Node

OUTCOMES = ("pending", "complete", "skipped", "cancelled", "failed")


class PrefetchHandle:
    """One prefetch of a prompt's uncached, page-aligned tail.

    Attributes:
        planned: pages the prefetch will read (None until the plan exists).
        landed: pages of the plan now in the tree (L2, or L1 without L2), in order.
        outcome: "pending", then "complete", "skipped" (tail below the threshold, no L3,
            queue full), "cancelled" (stopped by its policy) or "failed" (L3 error,
            vanished or rejected page).
        policy: the prefetch policy applied when the request is scheduled.
        started: time.monotonic() at creation.
    """

    def __init__(self, keys: list[bytes], tokens: list[bytes], first_index: int,
                 tail: Node | None, policy: str):
        self.keys, self.tokens, self.first_index = keys, tokens, first_index
        self.tail = tail            # deepest node this prefetch holds locked
        self.policy = policy
        self.started = time.monotonic()
        self.planned: int | None = None
        self.landed = 0
        self.outcome = "pending"
        self._lock = threading.Lock()
        self._running = False
        self._cancel = False
        self._planned = threading.Event()  # set: plan known, or stopped
        self._finished = threading.Event()

    def done(self) -> bool:
        """True only when the plan exists and every planned page landed (K12)."""
        planned = self.planned
        return planned is not None and self.landed >= planned

    @property
    def finished(self) -> bool:
        """The prefetch stopped (complete, skipped, cancelled or failed)."""
        return self._finished.is_set()

    def wait_plan(self, timeout: float | None = None) -> bool:
        """Wait until ``planned`` is known or the prefetch stopped; True if planned."""
        self._planned.wait(timeout)
        return self.planned is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the prefetch stopped; True if it did within ``timeout`` seconds."""
        return self._finished.wait(timeout)

    def stop(self, config: PrefetchConfig, page_size: int) -> None:
        """Stop as ``self.policy`` says when the request is scheduled (``config`` gives
        the timeout budget; ``page_size`` tokens per page)."""
        if self.policy == "wait_complete":
            self.wait()
        elif self.policy == "timeout":
            tokens = (self.planned if self.planned is not None else len(self.keys)) * page_size
            self.wait(max(0.0, self.started + config.timeout_s(tokens) - time.monotonic()))
        # No wait after cancel: a batch still in flight is dropped when it arrives
        # (the prefetch thread checks under the lock), so scheduling never blocks on it.
        self.cancel()

    # -- used by the cache and its prefetch thread ------------------------------------
    def claim(self) -> bool:
        """The worker takes the job; False when it was cancelled while still queued."""
        with self._lock:
            if self._cancel:
                return False
            self._running = True
            return True

    def set_plan(self, planned: int) -> None:
        self.planned = planned
        self._planned.set()

    def cancelled(self) -> bool:
        return self._cancel

    def cancel(self) -> None:
        """Ask the prefetch to stop after the batch in flight; pages landed stay."""
        with self._lock:
            self._cancel = True
            if not self._running and not self._finished.is_set():
                self.finish("cancelled")

    def finish(self, outcome: str) -> None:
        assert outcome in OUTCOMES
        self.outcome = outcome
        self._finished.set()
        self._planned.set()  # wake wait_plan: a stopped prefetch gets no (further) plan

    def __repr__(self) -> str:
        return (f"PrefetchHandle(planned={self.planned}, landed={self.landed}, "
                f"outcome={self.outcome})")
