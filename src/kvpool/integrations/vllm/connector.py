"""``KVPoolConnector``: kvpool as a vLLM v1 KV connector (``KVConnectorBase_V1``).

vLLM builds one instance in its scheduler process (role SCHEDULER) and one per worker
(role WORKER), with the three-argument constructor of vLLM 0.32. Load it with::

    --kv-transfer-config '{"kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"master": "127.0.0.1:50051"}}'

``kv_role``: ``kv_both`` loads and saves, ``kv_producer`` only saves (a prefill
instance), ``kv_consumer`` only loads (a decode instance). Extra config keys:
``master`` ("host:port", default ``$KVPOOL_MASTER`` or 127.0.0.1:50051), ``force_tcp``
(move bytes over TCP even on one host), ``timeout_s`` (10), ``retry_s`` (seconds
between reconnection attempts while kvpool is down, 30; made on a thread, so that vLLM's
scheduler pays one ``timeout_s`` per outage), ``save_queue`` (save batches
in flight at most, 8: a step whose saves find it full skips them), ``metrics_port`` (serve
the ``kvpool_vllm_*`` Prometheus counters of this process; 0 = off; the same counts reach
vLLM's own log and ``/metrics`` as ``vllm:kvpool_*``, :mod:`kvpool.integrations.vllm.stats`), ``layerwise_load``
(false, the default: same-host pages are copied, every layer, before the forward pass;
true: layer by layer while it runs, for hosts with a core to spare beside the engine's), ``segment`` (the
store segment to place saved blocks on first: this instance's host, so that the master
knows which instance computed a block), and the fetch-or-recompute policy's keys
(:mod:`kvpool.integrations.fetch_policy`: ``skip_slow_fetch``, default on, ``link_gbit``,
``link_delay_ms``, ``bandwidth_gbps``, ``linear_gflops``, ``attention_gflops``).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorRole)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpool.config import env
from kvpool.errors import UserError
from kvpool.integrations.extra_config import flag, master as master_spec, number, warn_unknown, whole
from kvpool.integrations.fetch_policy import KEYS as POLICY_KEYS
from kvpool.integrations.fetch_policy import FetchPolicy
from kvpool.integrations.vllm.keys import REPRODUCIBLE_HASHES, KeySpace, model_changes
from kvpool.integrations.vllm.meta import KVPoolMetadata
from kvpool.integrations.vllm.scheduler import SchedulerSide
from kvpool.integrations.vllm.stats import KVPoolPromMetrics, KVPoolStats, take
from kvpool.integrations.vllm.store import GuardedStore, serve_metrics
from kvpool.integrations.vllm.worker import WorkerSide

# Under "vllm." so that vLLM's log configuration (handlers, level, format) applies.
# the kv_connector_extra_config keys this connector reads (README "vLLM"), and the fetch policy's
EXTRA_KEYS = frozenset({"master", "force_tcp", "timeout_s", "retry_s", "segment", "save_queue",
                        "layerwise_load", "metrics_port"}) | POLICY_KEYS
logger = init_logger("vllm.kvpool")
DEFAULT_MASTER = "127.0.0.1:50051"


def _kv_dtype(vllm_config) -> str:
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        return str(cache_dtype)
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def key_space(vllm_config) -> KeySpace:
    """The KeySpace of a vLLM configuration (both roles compute the same one)."""
    par = vllm_config.parallel_config
    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    if algo not in REPRODUCIBLE_HASHES:
        logger.warning("kvpool: prefix_caching_hash_algo=%s gives block hashes that other "
                       "vLLM processes cannot reproduce unless PYTHONHASHSEED is shared", algo)
    return KeySpace(vllm_config.model_config.model, _kv_dtype(vllm_config),
                    vllm_config.cache_config.block_size, vllm_config.device_config.device_type,
                    tp_size=par.tensor_parallel_size, pp_size=par.pipeline_parallel_size,
                    hash_algo=algo, revision=vllm_config.model_config.revision,
                    changes=model_changes(getattr(vllm_config.model_config, "hf_overrides", None),
                                          getattr(vllm_config.model_config, "quantization", None)))


def fetch_policy(extra: dict, vllm_config, keys: KeySpace) -> FetchPolicy | None:
    """The fetch-or-recompute policy of the connector's extra config: None when off, or
    when its values or the model cannot be used (then every hit is loaded, and vLLM's
    log says why: a policy is an optimisation, never a reason not to serve)."""
    par = vllm_config.parallel_config
    try:
        return FetchPolicy.from_config(extra, vllm_config.model_config.hf_config.to_dict(),
                                       keys.dtype, par.tensor_parallel_size,
                                       par.pipeline_parallel_size)
    except UserError as exc:
        logger.warning("kvpool: fetch-or-recompute policy off (%s); every hit is loaded", exc)
        return None


class KVPoolConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by a kvpool cluster (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST  # pooled host memory (local or remote hosts)

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        extra = tc.kv_connector_extra_config or {}
        warn_unknown(extra, EXTRA_KEYS, logger, "kv_connector_extra_config")
        self.master = master_spec(extra, "master", env("MASTER") or DEFAULT_MASTER)
        store = GuardedStore.shared(self.master, flag(extra, "force_tcp", False),
                                    number(extra, "timeout_s", 10.0), logger,
                                    retry_s=number(extra, "retry_s", 30.0))
        keys = key_space(vllm_config)
        self.store = store
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(keys, store, load=tc.kv_role != "kv_producer",
                                           save=tc.kv_role != "kv_consumer", log=logger,
                                           policy=fetch_policy(extra, vllm_config, keys))
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            # staging for one request of max_model_len tokens, touched once up front
            rows = -(-vllm_config.model_config.max_model_len // keys.block_size)
            self.worker = WorkerSide(keys, store, get_tp_group().rank_in_group,
                                     get_pp_group().rank_in_group, logger, staging_rows=rows,
                                     segment=str(extra.get("segment", "")),
                                     max_batches=whole(extra, "save_queue", 8),
                                     layerwise=flag(extra, "layerwise_load", False))
            serve_metrics(whole(extra, "metrics_port", 0, lowest=0, highest=65535))
        logger.info("kvpool: %s connector (%s) on master %s%s", role.name.lower(), tc.kv_role,
                    self.master, " over TCP" if store.force_tcp else "")

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # the sender copies every layer of the step's blocks after the step

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._get_connector_metadata())

    def handle_preemptions(self, kv_connector_metadata) -> None:
        self.worker.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        return self.worker.get_finished(finished_req_ids) or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVPoolStats | None:
        """The counts gained since the last step's report, or None (vLLM asks after every
        step, in both roles: each count is reported once per process)."""
        data = take()
        return KVPoolStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPoolStats:
        """A stats object of a report's ``data`` (a copy: vLLM aggregates into it)."""
        return KVPoolStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """vLLM's ``vllm:kvpool_*`` Prometheus counters (:class:`KVPoolPromMetrics`)."""
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.store.close()

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVPoolMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        return self.scheduler.request_finished(request, block_ids)
