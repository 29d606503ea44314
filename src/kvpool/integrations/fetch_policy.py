"""Skip a prefix hit whose fetch would take longer than recomputing it.

A connector that finds ``k`` tokens in kvpool beyond what the engine already holds
asks :meth:`FetchPolicy.worth_fetching`; the prediction is the planner's
(:mod:`kvpool.plan.link`): load = round trips + KV bytes over the link's payload
bandwidth, against the compute those tokens would cost in this prompt's prefill.
The decision is all-or-nothing (the gain is convex in the tokens loaded).

Engine config keys (vLLM: ``kv_connector_extra_config``), planner defaults otherwise:
``skip_slow_fetch`` (bool, default True), ``link_gbit`` (line rate of the path to the
store in Gbit/s; without it ``bandwidth_gbps``, payload GB/s, default the planner's),
``link_delay_ms`` (one way, default 0), ``linear_gflops``, ``attention_gflops``
(effective speeds of this engine, as ``kvpool plan prefill --measure`` fits them),
``attention_kernel`` ("causal" or "masked").
"""

from __future__ import annotations

from kvpool.errors import UserError
from kvpool.integrations.extra_config import flag, number
from kvpool.plan.link import Link, fetch_seconds, recompute_seconds
from kvpool.plan.prefill import (DEFAULT_ATTENTION_FLOPS, DEFAULT_BANDWIDTH_GBPS,
                                 DEFAULT_LINEAR_FLOPS, Rates)
from kvpool.plan.spec import ModelSpec, check_flops, spec_from_config


KEYS = frozenset({"skip_slow_fetch", "link_gbit", "link_delay_ms", "bandwidth_gbps",
                  "linear_gflops", "attention_gflops", "attention_kernel"})  # what from_config reads


class FetchPolicy:
    """Whether loading a found prefix beats recomputing it (module docstring).

    Args:
        spec: the model (:func:`kvpool.plan.spec.spec_from_config`).
        rates: compute speeds (the bandwidth field is not used).
        bandwidth: payload bytes/s of the path to the store; latency_s: seconds per load.
        kv_dtype: KV element type name ("fp32", "bf16", ...); tp, pp: this rank's shard.
    """

    def __init__(self, spec: ModelSpec, rates: Rates, bandwidth: float, latency_s: float,
                 kv_dtype: str, tp: int = 1, pp: int = 1):
        self.spec, self.rates, self.kv_dtype, self.tp, self.pp = spec, rates, kv_dtype, tp, pp
        self.bandwidth, self.latency_s = bandwidth, latency_s

    @classmethod
    def from_config(cls, extra: dict, model_config: dict, kv_dtype: str, tp: int = 1,
                    pp: int = 1) -> "FetchPolicy | None":
        """The policy of engine config ``extra`` for a model's config.json dict, or None
        when ``skip_slow_fetch`` is off. Raises UserError for a value that is not a
        positive number (delay: >= 0) or a model the planner cannot describe."""
        if not flag(extra, "skip_slow_fetch", True):
            return None
        rates = Rates(linear=number(extra, "linear_gflops", DEFAULT_LINEAR_FLOPS / 1e9) * 1e9,
                      attention=number(extra, "attention_gflops", DEFAULT_ATTENTION_FLOPS / 1e9) * 1e9,
                      attention_kernel=str(extra.get("attention_kernel", "causal")))
        if extra.get("link_gbit") is not None:
            link = Link(number(extra, "link_gbit", 0.0), number(extra, "link_delay_ms", 0.0, zero_ok=True))
            bandwidth, latency = link.bandwidth, link.latency_s
        else:
            bandwidth = number(extra, "bandwidth_gbps", DEFAULT_BANDWIDTH_GBPS) * 1e9
            latency = 0.0
            if not bandwidth > 0:
                raise UserError(f"bandwidth_gbps must be > 0, got {bandwidth / 1e9:g}")
        spec = spec_from_config(model_config, source="the engine's model config")
        check_flops(spec)  # now, not at the first lookup
        return cls(spec, rates, bandwidth, latency, kv_dtype, tp, pp)

    def fetch_s(self, tokens: int) -> float:
        """Predicted seconds to load ``tokens`` tokens of KV."""
        return fetch_seconds(self.spec, tokens, self.bandwidth, self.latency_s, self.kv_dtype,
                             self.tp, self.pp)

    def recompute_s(self, prompt: int, computed: int, tokens: int) -> float:
        """Predicted compute seconds of tokens ``computed .. computed + tokens`` of a
        ``prompt``-token prefill."""
        return recompute_seconds(self.spec, prompt, computed, tokens, self.rates)

    def worth_fetching(self, prompt: int, computed: int, tokens: int) -> bool:
        """True when loading ``tokens`` found tokens after ``computed`` ones is predicted
        faster than computing them (``computed + tokens < prompt``)."""
        return self.fetch_s(tokens) < self.recompute_s(prompt, computed, tokens)
