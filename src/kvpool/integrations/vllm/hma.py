"""``KVPoolHMAConnector``: the connector with vLLM's hybrid memory allocator (``SupportsHMA``).

A connector that implements ``SupportsHMA`` keeps vLLM's hybrid allocator on: a model
with sliding-window layers (gpt-oss, Gemma 3) then has one KV cache group per kind of
layer, each with its own block table (``block_ids`` is a tuple, one list per group), and
a sliding-window group holds only the blocks inside its window (older positions are
vLLM's null block). Load it with ``"kv_connector": "KVPoolHMAConnector",
"kv_connector_module_path": "kvpool.integrations.vllm.hma"`` and the extra config of
``KVPoolConnector``.

Each attention group gets the plain connector's scheduler and worker sides over its own
layers, block table and namespace (the group in the key space: :class:`GroupPlan`).
A lookup asks the store once for every group's blocks and combines them by each group's
hit policy (:func:`kvpool.cache.hybrid.restorable_prefixes`, the rule of kvpool's own
hybrid cache): a full-attention group needs every block before the hit, a sliding group
only the ``ceil((W - 1) / B)`` blocks before it (it loads only those). Mamba groups
(state blocks, not paged KV) are refused with a clear error. A model with one group
behaves exactly as under ``KVPoolConnector`` (same keys).

vLLM turns the hybrid allocator off on CPU, so this path runs on GPU builds; kvpool's
tests drive it with vLLM's own spec classes and CPU tensors.
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, SupportsHMA
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from kvpool.cache.hybrid import restorable_prefixes, trailing_pages
from kvpool.integrations.vllm.connector import KVPoolConnector, key_space, logger
from kvpool.integrations.vllm.keys import KeySpace
from kvpool.integrations.vllm.meta import KVPoolMetadata
from kvpool.integrations.vllm.scheduler import SchedulerSide, request_namespace
from kvpool.integrations.vllm.store import LOOKUP_BLOCKS
from kvpool.integrations.vllm.worker import WorkerSide


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One KV cache group: its index, layers, and how many blocks before a hit it needs
    (``trailing``: None for every block, full attention; ``n`` for a sliding window)."""

    index: int
    layers: tuple[str, ...]
    trailing: int | None
    tag: str

    def first_block(self, hit: int, start: int) -> int:
        """First block this group loads for a hit of ``hit`` blocks after ``start``
        local ones."""
        return start if self.trailing is None else max(start, hit - self.trailing)


def group_plans(kv_cache_config) -> list[GroupPlan]:
    """The groups of a vLLM ``KVCacheConfig``. Raises NotImplementedError for a group
    that is neither full attention nor a sliding window (Mamba states, chunked local
    attention, ...), naming it."""
    groups = kv_cache_config.kv_cache_groups
    plans = []
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
            raise NotImplementedError(
                f"kvpool: KV cache group {i} ({type(spec).__name__}, layers "
                f"{group.layer_names[:2]}...) is not paged attention KV; kvpool's vLLM "
                "connector stores full-attention and sliding-window groups only")
        # a FullAttentionSpec with a window (hybrid allocator off) holds every block
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        trailing = trailing_pages(window, spec.block_size) if window else None
        tag = "" if len(groups) == 1 else (
            f"hma-group={i}/{len(groups)}:{'window=' + str(window) if window else 'full'}")
        plans.append(GroupPlan(i, tuple(group.layer_names), trailing, tag))
    return plans


def combined_hit(plans: list[GroupPlan], present: list[list[bool]], start: int) -> int:
    """Blocks of the hit: the longest prefix every group can restore, at least ``start``
    (the blocks vLLM holds locally). ``present[g][i]``: group ``g`` holds block ``i``
    (blocks before ``start`` count as held)."""
    end = len(present[0]) if present else start
    pools = [(p.trailing, flags) for p, flags in zip(plans, present)]
    return max([h for h in restorable_prefixes(end, pools) if h > start], default=start)


def lookup(store, spaces: list[KeySpace], hashes, salt: str, lora: str, start: int
           ) -> list[list[bool]] | None:
    """Per group, per block from 0: held by every rank in the store (one existence call
    for all groups; blocks before ``start``, held by vLLM, count as held). None when
    kvpool cannot be reached."""
    keys = [k for space in spaces for tp, pp in space.ranks()
            for k in space.store_keys(hashes, tp, pp, salt, lora)]
    flags = store.call("lookup", lambda c: c.batch_is_exist(keys))
    if flags is None:
        return None
    ranks, n = len(spaces[0].ranks()), len(hashes)
    present = []
    for g in range(len(spaces)):
        base = g * ranks * n
        present.append([True] * start + [all(flags[base + r * n + i] for r in range(ranks))
                                         for i in range(n)])
    return present


@dataclasses.dataclass
class HMAMetadata(KVConnectorMetadata):
    """Each group's loads and saves of this step (``groups[g]`` for group ``g``)."""

    groups: list[KVPoolMetadata]


class KVPoolHMAConnector(KVPoolConnector, SupportsHMA):
    """KVPoolConnector with one scheduler/worker side per KV cache group (module doc)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.plans = group_plans(kv_cache_config)
        self._sent_somewhere: set[str] = set()  # requests some group has finished saving
        base = key_space(vllm_config)
        self.spaces = [_with_group(base, p.tag) for p in self.plans]
        if self.scheduler is not None:
            first = self.scheduler
            self.schedulers = [SchedulerSide(space, self.store, first.load, first.save, first.log,
                                             policy=first.policy, group=p.index)
                               for space, p in zip(self.spaces, self.plans)]
        else:
            w = self.worker
            # whole loads: state layers (Mamba) never wait for a layer load
            self.workers = [WorkerSide(space, self.store, w.tp_rank, w.pp_rank, w.log,
                                       staging_rows=w.staging_rows) for space in self.spaces]
        logger.info("kvpool: hybrid allocator on, %d KV cache group(s): %s", len(self.plans),
                    ", ".join(p.tag or "full" for p in self.plans))

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches) -> None:
        for plan, worker in zip(self.plans, self.workers):
            worker.register_kv_caches({n: kv_caches[n] for n in plan.layers if n in kv_caches})

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        for worker, group in zip(self.workers, meta.groups):
            worker.start_load_kv(group)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # each group's sender copies every layer of the step's blocks after the step

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for worker, group in zip(self.workers, meta.groups):
            worker.wait_for_save(group)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        for worker, group in zip(self.workers, kv_connector_metadata.groups):
            worker.handle_preemptions(group)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        """A request is done sending once no group's saves of it are left."""
        done = set().union(*(w.get_finished(finished_req_ids) for w in self.workers))
        self._sent_somewhere |= done
        ready = {r for r in self._sent_somewhere if not any(w.saving(r) for w in self.workers)}
        self._sent_somewhere -= ready
        return ready or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set().union(*(w.get_block_ids_with_load_errors() for w in self.workers))

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Tokens beyond ``num_computed_tokens`` that every group can restore."""
        sides = self.schedulers
        for side in sides:
            side._matched.pop(request.request_id, None)
        if not sides[0].load:
            return 0, False
        block = sides[0].block_size
        start = num_computed_tokens // block
        end = min(len(request.block_hashes), (request.num_tokens - 1) // block)
        if end <= start:
            return 0, False
        present = lookup(self.store, self.spaces, request.block_hashes[start:end],
                         *request_namespace(request), start)
        if present is None:
            return 0, False
        hit = combined_hit(self.plans, present, start)
        LOOKUP_BLOCKS.labels("hit").inc(hit - start)
        LOOKUP_BLOCKS.labels("miss").inc(end - hit)
        if hit > start:
            for plan, side in zip(self.plans, sides):
                first = plan.first_block(hit, start)
                side._matched[request.request_id] = (first, hit - first)
        return (hit - start) * block, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        for side in self.schedulers:
            matched = side._matched.get(request.request_id)
            tokens = matched[1] * side.block_size if matched and num_external_tokens > 0 else 0
            side.update_state_after_alloc(request, blocks, tokens)

    def build_connector_meta(self, scheduler_output) -> HMAMetadata:
        return HMAMetadata([s.build_connector_meta(scheduler_output) for s in self.schedulers])

    def update_connector_output(self, connector_output) -> None:
        for side in self.schedulers:
            side.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        """Forget the request in every group; its blocks are kept while a save of any
        group is in flight (the workers then name it in ``finished_sending``)."""
        delays = [side.request_finished(request, ids)[0]
                  for side, ids in zip(self.schedulers, block_ids)]
        return any(delays), None


def _with_group(space: KeySpace, tag: str) -> KeySpace:
    """A copy of ``space`` whose namespace names KV cache group ``tag``."""
    copy = KeySpace.__new__(KeySpace)
    copy.__dict__.update(space.__dict__)
    copy.group = tag
    return copy
