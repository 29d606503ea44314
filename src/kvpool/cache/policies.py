"""Write and prefetch policies of the tiered cache (SGLang HiCache's names).

Write policies (L1 -> L2):
    write_through            every page written to L1 is copied to L2 at once
    write_through_selective  a page is copied to L2 once it was matched SELECTIVE_HITS times
    write_back               a page is copied to L2 only when L1 evicts it

Prefetch policies (L3 -> L2 of a prompt's uncached tail, decided when the request is
scheduled, i.e. when ``match(..., prefetch=handle)`` is called):
    best_effort    stop now; keep the batches that already landed
    wait_complete  wait until every planned page landed (or the prefetch failed)
    timeout        wait at most ``timeout_base_s + timeout_per_1k_tokens_s * tokens/1000``
                   from the prefetch's start, then stop; keep what landed
"""

from __future__ import annotations

import dataclasses

from kvpool.errors import InvalidParams

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
SELECTIVE_HITS = 2


def check_write_policy(policy: str) -> str:
    if policy not in WRITE_POLICIES:
        raise InvalidParams(f"write policy must be one of {WRITE_POLICIES}, got {policy!r}")
    return policy


@dataclasses.dataclass(frozen=True)
class PrefetchConfig:
    """When and how long to prefetch.

    Attributes:
        threshold_tokens: prefetch only a tail of at least this many tokens (page-aligned).
        policy: one of PREFETCH_POLICIES.
        timeout_base_s, timeout_per_1k_tokens_s: the timeout policy's budget (seconds).
        batch_pages: pages read from L3 per batch; every finished batch is kept.
    """

    threshold_tokens: int = 256
    policy: str = "best_effort"
    timeout_base_s: float = 1.0
    timeout_per_1k_tokens_s: float = 0.25
    batch_pages: int = 8

    def __post_init__(self) -> None:
        if self.policy not in PREFETCH_POLICIES:
            raise InvalidParams(f"prefetch policy must be one of {PREFETCH_POLICIES}, "
                                f"got {self.policy!r}")
        if self.batch_pages < 1 or self.threshold_tokens < 0:
            raise InvalidParams("prefetch batch_pages must be >= 1 and threshold >= 0")

    def timeout_s(self, tokens: int) -> float:
        """The timeout policy's budget for a prefetch of ``tokens`` tokens, in seconds."""
        return self.timeout_base_s + self.timeout_per_1k_tokens_s * tokens / 1000
