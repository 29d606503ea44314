"""KV-cache bytes: per token, per page, per request and for a whole pool.

Inputs are a :class:`~kvpool.plan.spec.ModelSpec`, a KV dtype, a state dtype and a
TP × PP layout. Every per-token element and every convolution-state element is stored
at the KV dtype (``fp8`` = 1 byte, ``bf16``/``fp16`` = 2, ``fp32`` = 4; per-block
scales of fp8 formats are not counted). The recurrent state of linear-attention and
Mamba layers is stored at the state dtype: ``state_dtype`` when given, else the
config's ``mamba_ssm_cache_dtype`` / ``mamba_ssm_dtype``, else the KV dtype (as
vLLM's ``mamba_ssm_cache_dtype`` does, the conv state stays at the cache dtype).

Hybrid models: layers are grouped by kind (:class:`LayerGroup`). Full-attention and
MLA layers grow per token; a sliding layer grows per token up to its window, then is
capped (``window_cap_bytes`` per request); a chunked layer likewise up to its chunk; a
recurrent layer keeps a fixed state per request whatever the length.

Sharding rules (Megatron-LM tensor parallelism, Shoeybi et al. 2019, as serving
engines apply it to the KV cache):

- TP splits KV heads: a rank holds ``kv_heads / tp`` heads, or with more ranks than
  heads one head, each head replicated ``tp / kv_heads`` times. Any other ``tp`` is
  refused as vLLM refuses it (:func:`check_tp`): ``num_attention_heads % tp == 0``,
  and ``kv_heads % tp == 0`` or ``tp % kv_heads == 0``. Linear-attention
  and SSM state splits the same way by its heads (Mamba-1 by its channels); the
  Mamba-2 B/C convolution channels split by group, ``ceil(n_groups / tp)`` groups a
  rank, so with fewer groups than ranks they are replicated (vLLM's
  ``extra_groups_for_head_shards`` in ``layers/mamba/mamba_utils.py``).
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
from kvpool.plan.layout import CHUNKED, FULL, SLIDING
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
class ElemBytes:
    """Bytes per element: ``kv`` for per-token and convolution state, ``state`` for
    the recurrent state."""

    kv: int
    state: int


@dataclass(frozen=True)
class LayerGroup:
    """Layers of one kind (and window, and mixer), whole model, before TP/PP.

    - ``layers``: their 0-based indices as text (``"3-47 step 4"``); ``indices``: as a
      tuple.
    - ``token_bytes``: bytes per token of all of them, before any window cap.
    - ``window``: the sliding window or attention chunk in tokens (None: unbounded);
      ``window_cap_bytes``: the most a request holds for them (``token_bytes · window``;
      0 when unbounded).
    - ``state_bytes``: fixed bytes per request, ``recurrent_bytes`` (at the state
      dtype) plus ``conv_bytes`` (at the KV dtype).
    """

    kind: str
    mixer: str
    layers: str
    indices: tuple[int, ...]
    count: int
    token_bytes: int
    window: int | None
    window_cap_bytes: int
    state_bytes: int
    recurrent_bytes: int
    conv_bytes: int


@dataclass(frozen=True)
class KVPlan:
    """Sizes in bytes. ``*_rank`` fields are for one rank of the largest PP stage;
    ``pool_all_ranks`` sums every rank, replicas included.

    - ``per_token`` / ``per_token_rank``: per-token cache of all layers, uncapped
      (what a page holds per token).
    - ``per_page`` / ``per_page_rank``: ``page_size`` tokens.
    - ``state_per_request``: fixed state of all recurrent layers (whole model);
      ``state_dtype`` is the recurrent state's dtype and ``state_dtype_source`` says
      where it came from (``--state-dtype``, ``config <field>``, or ``KV dtype``).
    - ``per_request`` / ``per_request_rank``: ``tokens`` tokens (sliding and chunked
      layers capped at their window) plus the fixed state.
    - ``pool`` / ``pool_rank``: ``requests`` such requests.
    - ``groups``: the per-kind breakdown (:class:`LayerGroup`), in layer order.
    """

    model: str
    kv_dtype: str
    state_dtype: str
    state_dtype_source: str
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

    def token_bytes_by_kind(self) -> dict[str, int]:
        """Bytes per token (whole model, uncapped) summed per layer kind."""
        out: dict[str, int] = {}
        for g in self.groups:
            out[g.kind] = out.get(g.kind, 0) + g.token_bytes
        return out

    def state_bytes_by_kind(self) -> dict[str, int]:
        """Fixed bytes per request (whole model) summed per recurrent layer kind."""
        out: dict[str, int] = {}
        for g in self.groups:
            if g.state_bytes:
                out[g.kind] = out.get(g.kind, 0) + g.state_bytes
        return out


def resolve_state_dtype(spec: ModelSpec, kv_dtype: str,
                        state_dtype: str | None = None) -> tuple[str, str]:
    """The recurrent-state dtype and where it came from: ``state_dtype`` when given
    (``"--state-dtype"``), else the config's field (``"config <field>"``; a value of
    ``auto`` means the model dtype, taken here as the KV dtype), else ``kv_dtype``
    (``"KV dtype"``). Raises UserError on an unknown dtype name, naming the config
    field when it came from there."""
    if state_dtype is not None:
        dtype_bytes(state_dtype)
        return state_dtype, "--state-dtype"
    if spec.state_dtype and spec.state_dtype != "auto":
        if spec.state_dtype.lower() not in DTYPE_BYTES:
            raise UserError(f"config field {spec.state_dtype_field}={spec.state_dtype!r} is "
                            f"not a dtype kvpool knows ({', '.join(DTYPE_BYTES)}); "
                            "give --state-dtype")
        return spec.state_dtype, f"config {spec.state_dtype_field}"
    return kv_dtype, "KV dtype"


class InvalidTP(UserError, ValueError):
    """A tensor-parallel size the model's heads cannot be split over (vLLM refuses it)."""


def tp_fits(spec: ModelSpec, tp: int) -> str:
    """"" when vLLM accepts ``tp`` ranks for ``spec``, else the reason it refuses them:
    ``num_attention_heads`` must be a multiple of ``tp``, and the KV heads of every
    softmax-attention layer must be a multiple of ``tp`` or, with more ranks than KV
    heads, divide ``tp`` (each head then replicated ``tp / kv_heads`` times; vLLM's
    ``QKVParallelLinear``). MLA latents and recurrent layers add no condition here."""
    q_heads = spec.attention_heads
    if q_heads and q_heads % tp:
        return (f"the model's {q_heads} attention heads (num_attention_heads) do not split "
                f"over {tp} ranks: vLLM needs num_attention_heads % tp == 0")
    kv_heads = sorted({layer.heads for layer in spec.layers
                       if layer.kind in (FULL, SLIDING, CHUNKED) and layer.heads})
    for heads in kv_heads:
        if heads % tp and tp % heads:
            return (f"the model's {heads} KV heads (num_key_value_heads) do not split over "
                    f"{tp} ranks: vLLM needs num_key_value_heads % tp == 0, or tp a multiple "
                    "of it (the KV heads replicated)")
    return ""


def check_tp(spec: ModelSpec, tp: int) -> None:
    """Raise :class:`InvalidTP` (a UserError and a ValueError) naming the reason and the
    sizes that do fit, unless vLLM accepts ``tp`` (>= 1) ranks for ``spec`` (see
    :func:`tp_fits`)."""
    reason = tp_fits(spec, tp)
    if reason:
        limit = max([spec.attention_heads] + [layer.heads for layer in spec.layers])
        fit = [str(t) for t in range(1, limit + 1) if not tp_fits(spec, t)]
        raise InvalidTP(f"--tp {tp}: {reason} (sizes that fit: {', '.join(fit)})")


def plan_kv(spec: ModelSpec, kv_dtype: str = "bf16", tokens: int = 4096, requests: int = 1,
            tp: int = 1, pp: int = 1, page_size: int = 16,
            state_dtype: str | None = None) -> KVPlan:
    """Size the KV cache of ``requests`` requests of ``tokens`` tokens each.

    ``state_dtype``: dtype of the recurrent state of linear/Mamba layers (default: see
    :func:`resolve_state_dtype`).
    Raises: UserError on a non-positive count, ``pp`` larger than the layer count, or
    an unknown dtype; :class:`InvalidTP` (also a ValueError) on a ``tp`` the model's
    attention or KV heads cannot be split over (:func:`check_tp`).
    """
    for name, value in (("tokens", tokens), ("requests", requests), ("tp", tp), ("pp", pp),
                        ("page-size", page_size)):
        if value < 1:
            raise UserError(f"--{name} must be >= 1, got {value}")
    check_tp(spec, tp)
    if pp > len(spec.layers):
        raise UserError(f"--pp {pp} is more than the model's {len(spec.layers)} layers")
    state_name, state_source = resolve_state_dtype(spec, kv_dtype, state_dtype)
    b = ElemBytes(kv=dtype_bytes(kv_dtype), state=dtype_bytes(state_name))
    stages = _pp_stages(spec.layers, pp)
    big = max(stages, key=lambda s: _request_bytes(s, tokens, b, tp))
    per_token = _token_bytes(spec.layers, b.kv, 1)
    per_token_rank = _token_bytes(big, b.kv, tp)
    per_request = _request_bytes(spec.layers, tokens, b, 1)
    per_request_rank = _request_bytes(big, tokens, b, tp)
    all_ranks = tp * sum(_request_bytes(s, tokens, b, tp) for s in stages) * requests
    return KVPlan(
        model=spec.name, kv_dtype=kv_dtype, state_dtype=state_name,
        state_dtype_source=state_source, tp=tp, pp=pp, page_size=page_size, tokens=tokens,
        requests=requests, per_token=per_token, per_token_rank=per_token_rank,
        per_page=per_token * page_size, per_page_rank=per_token_rank * page_size,
        state_per_request=sum(_state_bytes(layer, b, 1) for layer in spec.layers),
        per_request=per_request, per_request_rank=per_request_rank,
        pool=per_request * requests, pool_rank=per_request_rank * requests,
        pool_all_ranks=all_ranks, groups=layer_groups(spec.layers, b),
    )


def layer_token_elems(layer: Layer, tp: int = 1) -> int:
    """Elements one TP rank caches per token for ``layer`` (KV heads split, latent and
    indexer key whole)."""
    if layer.heads and layer.token_elems:
        per_head = layer.token_elems // layer.heads
        return per_head * math.ceil(layer.heads / tp) + layer.index_elems
    return layer.token_elems + layer.index_elems


def layer_state_elems(layer: Layer, tp: int = 1) -> tuple[int, int]:
    """(recurrent, convolution) state elements one TP rank holds for ``layer``: split by
    heads, the Mamba-2 group channels by group (``ceil(groups / tp)`` per rank)."""
    if not layer.heads:
        return layer.state_elems, layer.conv_elems
    share = math.ceil(layer.heads / tp)
    grouped = layer.conv_groups * layer.conv_group_elems
    conv = ((layer.conv_elems - grouped) * share // layer.heads
            + math.ceil(layer.conv_groups / tp) * layer.conv_group_elems)
    return layer.state_elems * share // layer.heads, conv


def _state_bytes(layer: Layer, b: ElemBytes, tp: int) -> int:
    recurrent, conv = layer_state_elems(layer, tp)
    return recurrent * b.state + conv * b.kv


def _token_bytes(layers, nbytes: int, tp: int) -> int:
    return sum(layer_token_elems(layer, tp) for layer in layers) * nbytes


def _request_bytes(layers, tokens: int, b: ElemBytes, tp: int) -> int:
    total = 0
    for layer in layers:
        kept = min(tokens, layer.window) if layer.window else tokens
        total += layer_token_elems(layer, tp) * kept * b.kv + _state_bytes(layer, b, tp)
    return total


def _pp_stages(layers: tuple[Layer, ...], pp: int) -> list[tuple[Layer, ...]]:
    base, extra = divmod(len(layers), pp)
    stages, start = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        stages.append(layers[start:start + size])
        start += size
    return stages


def layer_groups(layers: tuple[Layer, ...], b: ElemBytes) -> tuple[LayerGroup, ...]:
    """``layers`` grouped by (kind, window, mixer), in order of first appearance, with
    whole-model bytes (see :class:`LayerGroup`)."""
    order: dict[tuple[str, int | None, str], list[Layer]] = {}
    for layer in layers:
        order.setdefault((layer.kind, layer.window, layer.mixer), []).append(layer)
    groups = []
    for (kind, window, mixer), group in order.items():
        token = _token_bytes(group, b.kv, 1)
        recurrent = sum(layer.state_elems for layer in group) * b.state
        conv = sum(layer.conv_elems for layer in group) * b.kv
        indices = tuple(layer.index for layer in group)
        groups.append(LayerGroup(
            kind=kind, mixer=mixer, layers=_ranges(list(indices)), indices=indices,
            count=len(group), token_bytes=token, window=window,
            window_cap_bytes=token * window if window else 0, state_bytes=recurrent + conv,
            recurrent_bytes=recurrent, conv_bytes=conv))
    return tuple(groups)


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
