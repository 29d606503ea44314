"""KV-cache bytes: per token, per page, per request and for a whole pool.

Inputs are a :class:`~kvpool.plan.spec.ModelSpec`, a KV dtype and a TP × PP layout.
Every cached element is stored at the KV dtype (``fp8`` = 1 byte, ``bf16``/``fp16`` =
2, ``fp32`` = 4); per-block scales of fp8 formats are not counted.

Sharding rules (Megatron-LM tensor parallelism, Shoeybi et al. 2019, as serving
engines apply it to the KV cache):

- TP splits KV heads: a rank holds ``ceil(kv_heads / tp)`` heads, so with fewer
  heads than ranks each head is replicated ``tp / kv_heads`` times. Linear-attention
  and SSM state splits the same way by its heads.
- The MLA latent and the V3.2 indexer key are not per head: every TP rank holds them
  whole (replication, as vLLM and SGLang do for MLA).
- PP splits layers into ``pp`` contiguous stages of ``layers // pp`` layers, the
  first ``layers % pp`` stages one layer longer; per-rank figures are those of the
  stage with the most bytes, the one a pool must be sized for.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvpool.errors import UserError
from kvpool.plan.spec import Layer, ModelSpec

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a KV dtype name (``fp32``, ``bf16``, ``fp16``, ``fp8`` and
    their long spellings). Raises UserError on an unknown name."""
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise UserError(f"unknown KV dtype {name!r}; choose one of "
                        f"{', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class LayerGroup:
    """Layers of one kind. ``token_bytes``: bytes per token of all of them (whole model,
    before any window cap); ``state_bytes``: fixed bytes per request."""

    kind: str
    layers: str
    count: int
    token_bytes: int
    state_bytes: int
    window: int | None


@dataclass(frozen=True)
class KVPlan:
    """Sizes in bytes. ``*_rank`` fields are for one rank of the largest PP stage;
    ``pool_all_ranks`` sums every rank, replicas included.

    - ``per_token`` / ``per_token_rank``: per-token cache of all layers, uncapped
      (what a page holds per token).
    - ``per_page`` / ``per_page_rank``: ``page_size`` tokens.
    - ``per_request`` / ``per_request_rank``: ``tokens`` tokens (sliding layers capped
      at their window) plus the fixed state.
    - ``pool`` / ``pool_rank``: ``requests`` such requests.
    """

    model: str
    kv_dtype: str
    tp: int
    pp: int
    page_size: int
    tokens: int
    requests: int
    per_token: int
    per_token_rank: int
    per_page: int
    per_page_rank: int
    state_per_request: int
    per_request: int
    per_request_rank: int
    pool: int
    pool_rank: int
    pool_all_ranks: int
    groups: tuple[LayerGroup, ...]

    def to_dict(self) -> dict:
        return asdict(self)


def plan_kv(spec: ModelSpec, kv_dtype: str = "bf16", tokens: int = 4096, requests: int = 1,
            tp: int = 1, pp: int = 1, page_size: int = 16) -> KVPlan:
    """Size the KV cache of ``requests`` requests of ``tokens`` tokens each.

    Raises: UserError on a non-positive count or ``pp`` larger than the layer count.
    """
    for name, value in (("tokens", tokens), ("requests", requests), ("tp", tp), ("pp", pp),
                        ("page-size", page_size)):
        if value < 1:
            raise UserError(f"--{name} must be >= 1, got {value}")
    if pp > len(spec.layers):
        raise UserError(f"--pp {pp} is more than the model's {len(spec.layers)} layers")
    nbytes = dtype_bytes(kv_dtype)
    stages = _pp_stages(spec.layers, pp)
    big = max(stages, key=lambda s: _request_bytes(s, tokens, nbytes, tp))
    per_token = _token_bytes(spec.layers, nbytes, 1)
    per_token_rank = _token_bytes(big, nbytes, tp)
    per_request = _request_bytes(spec.layers, tokens, nbytes, 1)
    per_request_rank = _request_bytes(big, tokens, nbytes, tp)
    all_ranks = tp * sum(_request_bytes(s, tokens, nbytes, tp) for s in stages) * requests
    return KVPlan(
        model=spec.name, kv_dtype=kv_dtype, tp=tp, pp=pp, page_size=page_size, tokens=tokens,
        requests=requests, per_token=per_token, per_token_rank=per_token_rank,
        per_page=per_token * page_size, per_page_rank=per_token_rank * page_size,
        state_per_request=sum(layer.state_elems for layer in spec.layers) * nbytes,
        per_request=per_request, per_request_rank=per_request_rank,
        pool=per_request * requests, pool_rank=per_request_rank * requests,
        pool_all_ranks=all_ranks, groups=_groups(spec.layers, nbytes),
    )


def layer_token_elems(layer: Layer, tp: int = 1) -> int:
    """Elements one TP rank caches per token for ``layer`` (KV heads split, latent and
    indexer key whole)."""
    if layer.heads:
        per_head = layer.token_elems // layer.heads
        return per_head * math.ceil(layer.heads / tp) + layer.index_elems
    return layer.token_elems + layer.index_elems


def layer_state_elems(layer: Layer, tp: int = 1) -> int:
    """Elements of fixed per-request state one TP rank holds for ``layer``."""
    if not layer.state_elems:
        return 0
    return layer.state_elems * math.ceil(layer.heads / tp) // layer.heads


def _token_bytes(layers, nbytes: int, tp: int) -> int:
    return sum(layer_token_elems(layer, tp) for layer in layers) * nbytes


def _request_bytes(layers, tokens: int, nbytes: int, tp: int) -> int:
    total = 0
    for layer in layers:
        kept = min(tokens, layer.window) if layer.window else tokens
        total += layer_token_elems(layer, tp) * kept + layer_state_elems(layer, tp)
    return total * nbytes


def _pp_stages(layers: tuple[Layer, ...], pp: int) -> list[tuple[Layer, ...]]:
    base, extra = divmod(len(layers), pp)
    stages, start = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        stages.append(layers[start:start + size])
        start += size
    return stages


def _groups(layers: tuple[Layer, ...], nbytes: int) -> tuple[LayerGroup, ...]:
    order: dict[tuple[str, int | None], list[Layer]] = {}
    for layer in layers:
        order.setdefault((layer.kind, layer.window), []).append(layer)
    return tuple(
        LayerGroup(kind=kind, layers=_ranges([layer.index for layer in group]), count=len(group),
                   token_bytes=_token_bytes(group, nbytes, 1),
                   state_bytes=sum(layer.state_elems for layer in group) * nbytes, window=window)
        for (kind, window), group in order.items())


def _ranges(indices: list[int]) -> str:
    """0-based layer indices as text: ``[0,1,2,5]`` -> ``"0-2,5"``; an evenly spaced
    list of 4 or more, like every other layer, -> ``"0-40 step 2"``."""
    steps = {b - a for a, b in zip(indices, indices[1:])}
    if len(indices) >= 4 and len(steps) == 1 and steps != {1}:
        return f"{indices[0]}-{indices[-1]} step {steps.pop()}"
    parts, start = [], indices[0]
    for prev, cur in zip(indices, indices[1:] + [None]):
        if cur is None or cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(parts)
