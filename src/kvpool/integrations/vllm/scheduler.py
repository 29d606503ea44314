"""Scheduler side of the connector: which blocks to load from kvpool and which to save.

Lookup (``get_num_new_matched_tokens``): the blocks beyond vLLM's local hit, up to the
last full block before the prompt's final token (K15: vLLM must compute at least one
token), are checked in one ``batch_is_exist`` call for every rank's object; the hit is
the longest run present for all ranks. An existence check grants a read lease, so a
counted block stays readable until the load (within the lease, K17); a block that
still fails to load is reported to vLLM as a load error and recomputed. With a
:class:`~kvpool.integrations.fetch_policy.FetchPolicy`, a hit whose load is predicted
slower than recomputing it is skipped (counted in ``kvpool_vllm_fetch_skipped_blocks``).

Saves: every full block a step computes, whose hash vLLM knows, is saved once per
request; blocks vLLM found locally or loaded are not saved again. Saves run in the
worker's background sender, which copies the blocks out of vLLM's cache after the
step: a finished request that had saves planned keeps its blocks
(``request_finished`` returns True) until the workers name it in ``finished_sending``.
"""

from __future__ import annotations

from kvpool.integrations.fetch_policy import FetchPolicy
from kvpool.integrations.vllm.keys import KeySpace
from kvpool.integrations.vllm.meta import BlockRun, KVPoolMetadata
from kvpool.integrations.vllm.store import LOOKUP_BLOCKS, GuardedStore, counter

FETCH_SKIPPED = counter("fetch_skipped_blocks", "blocks found in kvpool but recomputed because "
                        "loading them was predicted slower")


def request_namespace(request) -> tuple[str, str]:
    """(cache_salt, lora name) of a vLLM request ("" when absent)."""
    lora = getattr(request, "lora_request", None)
    return getattr(request, "cache_salt", None) or "", (lora.lora_name if lora else "")


class SchedulerSide:
    """Per-request bookkeeping of the connector in vLLM's scheduler process."""

    def __init__(self, keys: KeySpace, store: GuardedStore, load: bool, save: bool, log,
                 policy: FetchPolicy | None = None, group: int = 0):
        self.keys, self.store, self.load, self.save, self.log = keys, store, load, save, log
        self.policy = policy
        self.group = group  # the KV cache group whose block table this side reads
        self.block_size = keys.block_size
        self._requests: dict[str, object] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._saved: dict[str, int] = {}  # blocks of the request not to save (again)
        self._matched: dict[str, tuple[int, int]] = {}  # req -> (first block, blocks found)
        self._loads: list[BlockRun] = []
        self._saving: set[str] = set()  # requests with saves planned (the workers' view too)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (block-aligned) that kvpool holds."""
        self._matched.pop(request.request_id, None)
        if not self.load:
            return 0, False
        start = num_computed_tokens // self.block_size
        end = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        if end <= start:
            return 0, False
        hashes = request.block_hashes[start:end]
        salt, lora = request_namespace(request)
        keys = [k for tp, pp in self.keys.ranks()
                for k in self.keys.store_keys(hashes, tp, pp, salt, lora)]
        present = self.store.call("lookup", lambda c: c.batch_is_exist(keys))
        if present is None:
            return 0, False
        ranks = len(self.keys.ranks())
        found = 0
        while found < len(hashes) and all(present[r * len(hashes) + found] for r in range(ranks)):
            found += 1
        LOOKUP_BLOCKS.labels("hit").inc(found)
        LOOKUP_BLOCKS.labels("miss").inc(len(hashes) - found)
        if found and self.policy and not self.policy.worth_fetching(
                request.num_tokens, num_computed_tokens, found * self.block_size):
            FETCH_SKIPPED.inc(found)
            return 0, False
        if found:
            self._matched[request.request_id] = (start, found)
        return found * self.block_size, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Plan the load of the matched blocks into the blocks vLLM just allocated."""
        self._requests[request.request_id] = request
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or matched is None:
            return
        start, _ = matched
        count = num_external_tokens // self.block_size
        ids = blocks.get_block_ids()[self.group][start:start + count]
        salt, lora = request_namespace(request)
        self._loads.append(BlockRun(request.request_id, salt, lora, start,
                                    list(request.block_hashes[start:start + count]), list(ids)))

    def build_connector_meta(self, so) -> KVPoolMetadata:
        """This step's loads (planned at allocation) and saves (blocks it completes)."""
        meta = KVPoolMetadata(loads=self._loads, preempted=set(so.preempted_req_ids or ()))
        self._loads = []
        for new in so.scheduled_new_reqs:
            self._block_ids[new.req_id] = list(new.block_ids[self.group])
            self._saved[new.req_id] = new.num_computed_tokens // self.block_size
            self._plan_save(meta, new.req_id,
                            new.num_computed_tokens + so.num_scheduled_tokens[new.req_id])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self._block_ids[req_id] = list(new_ids[self.group]) if new_ids else []
            elif new_ids:
                self._block_ids.setdefault(req_id, []).extend(new_ids[self.group])
            self._plan_save(meta, req_id,
                            cached.num_computed_tokens[i] + so.num_scheduled_tokens[req_id])
        return meta

    def _plan_save(self, meta: KVPoolMetadata, req_id: str, computed_after: int) -> None:
        request = self._requests.get(req_id)
        if not self.save or request is None or self.store.down:
            return
        ids = self._block_ids.get(req_id, [])
        start = self._saved.get(req_id, 0)
        end = min(computed_after // self.block_size, len(request.block_hashes), len(ids))
        if end <= start:
            return
        salt, lora = request_namespace(request)
        meta.saves.append(BlockRun(req_id, salt, lora, start,
                                   list(request.block_hashes[start:end]), ids[start:end]))
        self._saved[req_id] = end
        self._saving.add(req_id)

    def update_connector_output(self, output) -> None:
        """Blocks that failed to load are recomputed by vLLM: save them again from the
        first failed block of each affected request."""
        bad = getattr(output, "invalid_block_ids", None)
        if not bad:
            return
        for req_id, ids in self._block_ids.items():
            first = next((i for i, b in enumerate(ids) if b in bad), None)
            if first is not None and self._saved.get(req_id, 0) > first:
                self._saved[req_id] = first

    def request_finished(self, request, block_ids) -> tuple[bool, None]:
        """Forget the request; True (vLLM keeps its blocks) when saves of it were
        planned: the workers may still be copying them out, and name the request in
        ``finished_sending`` once they are done (at their next step when they are)."""
        for table in (self._requests, self._block_ids, self._saved, self._matched):
            table.pop(request.request_id, None)
        delay = request.request_id in self._saving
        self._saving.discard(request.request_id)
        return delay, None
