"""The router in front of the vLLM instances of ``kvpool bench serve``.

- ``least_loaded``: the instance with the fewest requests in flight (ties: in turn).
- ``prefix``: asks kvpool's master where the prompt's blocks are. Each instance saves
  its blocks on its own host's segment first (the connector's ``segment`` key), so a
  block's replica names the instance that computed it, and that instance most likely
  still holds it in its local prefix cache. The prompt's vLLM block hashes
  (:func:`kvpool.cache.compat.vllm_block_hashes`, the request's ``cache_salt`` in the
  first block's extra keys, as vLLM computes them) become store keys
  (:class:`kvpool.integrations.vllm.keys.KeySpace`), one ``batch_query`` asks for
  their replicas (the read grants are handed back at once), and the request goes to
  the instance whose segment holds the longest run of leading blocks, unless it has
  ``balance`` more requests in flight than the least loaded one (then, as when
  nothing is found, to the least loaded).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.cache.compat import vllm_block_hashes
from kvpool.errors import ErrorCode

POLICIES = ("least_loaded", "prefix")
# Requests in flight the holder may have beyond the least loaded and still win: 0, a
# tie-breaker. Every instance reaches the store, so the one that lacks a prefix loads
# it (tens of ms) where waiting behind one more request costs a whole prefill (seconds):
# measured in `bench serve`'s full run, a balance of 2 queued the sessions of a
# document on one instance and left (c) at 0.61x (b)'s goodput at 1.34 req/s.
DEFAULT_BALANCE = 0


class Router:
    """Picks an instance per request and counts requests in flight.

    Args:
        instances: how many instances (0 .. n-1).
        policy: one of :data:`POLICIES`.
        segments: per instance, the store segment its connector saves to ("prefix").
        client: a :class:`kvpool.client.Client` of the shared store ("prefix").
        keys: the instances' KeySpace; hash_seed: vLLM's NONE_HASH seed.
        balance: requests in flight an instance may have beyond the least loaded and
            still win on its prefix.
    """

    def __init__(self, instances: int, policy: str = "least_loaded",
                 segments: Sequence[str] = (), client=None, keys=None,
                 hash_seed: str = "vllm-none-hash", balance: int = DEFAULT_BALANCE):
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, got {policy!r}")
        if policy == "prefix" and (client is None or keys is None or len(segments) != instances):
            raise ValueError("prefix routing needs a store client, the KeySpace and one "
                             "segment per instance")
        self.n, self.policy, self.segments = instances, policy, list(segments)
        self.client, self.keys, self.hash_seed, self.balance = client, keys, hash_seed, balance
        self.in_flight = [0] * instances
        self._turn = 0
        self.decisions = {"prefix": 0, "load": 0}

    def prefix_blocks(self, prompt: Sequence[int], salt: str) -> list[int]:
        """Per instance, the leading blocks of ``prompt`` whose stored replica lies on
        that instance's segment (one master round trip)."""
        size = self.keys.block_size
        # vLLM 0.32 (generate_block_hash_extra_keys): the first block's extra keys
        # carry (("cache_salt", salt),)
        first = (("cache_salt", salt),) if salt else None
        hashes = vllm_block_hashes(prompt[:(len(prompt) - 1) // size * size], size,
                                   self.hash_seed, [first] + [None] * (len(prompt) // size))
        if not hashes:
            return [0] * self.n
        keys = self.keys.store_keys(hashes, 0, 0, salt, "")
        handles = self.client.batch_query(keys)
        found = [h for h in handles if not isinstance(h, ErrorCode)]
        if found:
            self.client.release(found)
        held = [0] * self.n
        open_ = set(range(self.n))
        for h in handles:
            where = set() if isinstance(h, ErrorCode) else {r.segment.name for r in h.replicas}
            for i in list(open_):
                if self.segments[i] in where:
                    held[i] += 1
                else:
                    open_.discard(i)
            if not open_:
                break
        return held

    def pick(self, prompt: Sequence[int], salt: str = "") -> int:
        """The instance for a request (blocking: the prefix lookup is one RPC)."""
        least = min(range(self.n), key=lambda i: (self.in_flight[i], (i - self._turn) % self.n))
        self._turn = (self._turn + 1) % self.n
        if self.policy == "prefix":
            held = self.prefix_blocks(prompt, salt)
            best = max(range(self.n), key=lambda i: (held[i], -self.in_flight[i]))
            if held[best] and self.in_flight[best] - self.in_flight[least] <= self.balance:
                self.decisions["prefix"] += 1
                return best
        self.decisions["load"] += 1
        return least

    def started(self, i: int) -> None:
        self.in_flight[i] += 1

    def finished(self, i: int) -> None:
        self.in_flight[i] -= 1
