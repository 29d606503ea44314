"""Capacity and prefill planning from a model's ``config.json`` (``kvpool plan``).

- :mod:`kvpool.plan.spec`: config fields -> per-layer cache shape and FLOPs.
- :mod:`kvpool.plan.layout`: which layer is which (attention, sliding, recurrent, ...).
- :mod:`kvpool.plan.recurrent`: per-request state of linear-attention / Mamba layers.
- :mod:`kvpool.plan.kv`: KV bytes per token, page, request, pool; TP/PP sharding.
- :mod:`kvpool.plan.prefill`: prefill FLOPs with a cached prefix, TTFT, break-even.
- :mod:`kvpool.plan.fit`: effective FLOP/s and overhead fitted from cold runs.
- :mod:`kvpool.plan.measure`: predicted vs measured TTFT on the reference engine.
"""

from kvpool.plan.kv import KVPlan, LayerGroup, dtype_bytes, plan_kv
from kvpool.plan.spec import Layer, ModelSpec, configs_dir, load_spec, spec_from_config

__all__ = ["KVPlan", "Layer", "LayerGroup", "ModelSpec", "configs_dir", "dtype_bytes", "load_spec",
           "plan_kv", "spec_from_config"]
