"""The connector's counters in vLLM's own metrics: its log and its Prometheus endpoint.

vLLM asks a connector for its stats after every step, in the worker
(``get_kv_connector_stats``, sent to the scheduler with the step's output) and in the
scheduler; it sums them (:meth:`KVPoolStats.aggregate`), logs the sum every
``VLLM_LOG_STATS_INTERVAL`` ("KV Transfer metrics: blocks_loaded=5, ...") and adds it
to counters ``vllm:kvpool_*`` on the API server's ``/metrics``, labelled like vLLM's
own (model, engine). The counts are those of :data:`~kvpool.integrations.vllm.store.REGISTRY`
(blocks and bytes loaded and saved, lookups by result, load errors and skipped saves by
reason, ...): :func:`take` reports what each counter gained since the last report of
this process, so that an increment is reported once even where vLLM runs its scheduler
and worker in one process and both ask. Summed over TP workers: a block of a TP=2
instance loaded by both ranks counts 2. Saves end on the connector's sender thread; a
save that ends after an instance's last step is counted in ``kvpool_vllm_*`` only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                    KVConnectorStats)

from kvpool.integrations.vllm.store import LABELS, PREFIX, REGISTRY, samples

_reported: dict[str, int] = {}  # key -> the count last reported by this process
_lock = threading.Lock()  # vLLM's scheduler and worker may ask from two threads


def _key(sample) -> str:
    """``blocks_loaded`` or ``load_errors:checksum``: a counter sample's key in the stats."""
    base = sample.name.removeprefix(PREFIX).removesuffix("_total")
    label = LABELS.get(base)
    return f"{base}:{sample.labels[label]}" if label else base


def take() -> dict[str, int] | None:
    """What every counter of REGISTRY gained since the last call in this process.

    Returns:
        {key: count} with only the counts that grew (keys as :func:`_key`), or None when
        none did (vLLM then has nothing to carry or log for this step).
    """
    with _lock:
        grown = {}
        for sample in samples():
            key, now = _key(sample), int(sample.value)
            if now > _reported.get(key, 0):
                grown[key] = now - _reported.get(key, 0)
                _reported[key] = now
        return grown or None


@dataclass
class KVPoolStats(KVConnectorStats):
    """Counts gained over one or more steps: ``data`` is {key: count} (keys as :func:`take`).

    Serialised by vLLM as ``data`` alone (a dict of str to int), from worker to scheduler
    to the API server.
    """

    def reset(self) -> None:
        """Forget every count."""
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVPoolStats":
        """Add ``other``'s counts to these (in place, as vLLM's own connectors do)."""
        for key, n in other.data.items():
            self.data[key] = self.data.get(key, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counts by key, sorted: what vLLM's log line prints."""
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        """True when nothing was counted."""
        return not self.data


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """One ``vllm:kvpool_<counter>`` Prometheus counter per counter of REGISTRY, with
    vLLM's labels (``labelnames``: model name, engine index) plus the counter's own
    (``result`` or ``reason``) where it has one. vLLM passes the metric classes to use
    (``metric_types``: its multiprocess-aware wrappers where it runs several API servers).
    """

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Counter] = {}
        for family in REGISTRY.collect():
            base = family.name.removeprefix(PREFIX)
            extra = [LABELS[base]] if base in LABELS else []
            self._counters[base] = self._counter_cls(
                name=f"vllm:kvpool_{base}", documentation=f"kvpool: {family.documentation}",
                labelnames=labelnames + extra)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one aggregated report (:class:`KVPoolStats` ``data``) to the counters."""
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for key, n in transfer_stats_data.items():
            base, _, label = key.partition(":")
            counter = self._counters.get(base)
            if counter is not None:
                counter.labels(*labelvalues, *([label] if label else [])).inc(n)
