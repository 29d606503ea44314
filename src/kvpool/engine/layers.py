"""Which cache each decoder layer of a transformers model keeps, and its state checkpoints.

The kinds are read from the cache layers transformers builds for the config
(``DynamicCache(config=...)``), so they are what the model will really use:

    full     ``DynamicLayer``: keys and values of every token
    sliding  ``DynamicSlidingWindowLayer``: the last ``sliding_window - 1`` tokens
    linear   ``LinearAttentionLayer`` (Gated DeltaNet, Mamba, short convolutions): per
             state a recurrent tensor and a convolution window, fixed size per request

A checkpoint is the state of every linear layer after some token, flat in one tensor
(one object: its parts are stored and evicted together, K17): per layer and state, the
recurrent tensor, then the newest ``K - 1`` columns of the convolution window. transformers
keeps ``K`` columns, but its oldest is never read: a decode step convolves the last
``K - 1`` kept inputs with the new one (``causal_conv1d_update`` over ``K + 1`` columns,
keeping the last output), and a prefill after a state concatenates the window before the
new inputs and keeps the outputs of the new ones, each of which reaches back ``K - 1``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from kvpool.errors import UserError

FULL, SLIDING, LINEAR = "full", "sliding", "linear"


@dataclasses.dataclass(frozen=True)
class StatePart:
    """One tensor of a checkpoint: layer ``layer``, state ``state``, ``conv`` or
    recurrent, stored as ``shape`` (a conv window without its oldest column) at
    ``offset`` elements into the flat checkpoint; ``dtype`` is the layer's own."""

    layer: int
    state: int
    conv: bool
    shape: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Cache kinds of a model's layers.

    Attributes:
        kinds: FULL, SLIDING or LINEAR per decoder layer.
        window: the sliding layers' ``sliding_window`` (tokens), 0 without them.
        rows: the attention layers in the engine's KV buffer order: full layers first,
            then sliding ones (each group's pages are then one view of the buffer).
        state_parts: the parts of one checkpoint (empty without linear layers).
        state_dtype: dtype of a checkpoint (the widest of its parts: a cast is lossless).
    """

    kinds: tuple[str, ...]
    window: int
    rows: tuple[int, ...]
    state_parts: tuple[StatePart, ...] = ()
    state_dtype: torch.dtype | None = None

    @property
    def dense(self) -> bool:
        """Every layer is full attention (the dense engine path)."""
        return all(k == FULL for k in self.kinds)

    def count(self, kind: str) -> int:
        return sum(k == kind for k in self.kinds)

    @property
    def state_numel(self) -> int:
        return sum(p.numel for p in self.state_parts)

    def describe(self) -> str:
        """A stable text of the layout for the cache namespace, e.g.
        ``"layers=LLLF;window=0;state=1408"``."""
        letters = {FULL: "F", SLIDING: "S", LINEAR: "L"}
        return (f"layers={''.join(letters[k] for k in self.kinds)};window={self.window};"
                f"state={self.state_numel}")


def layer_plan(model) -> LayerPlan:
    """The :class:`LayerPlan` of a transformers causal LM (on CPU).

    With linear layers, one token is run once through the model to learn the shapes and
    dtypes of their states. Raises UserError for a cache layer kind the engine cannot
    page (e.g. compressed or indexed attention), naming the layer.
    """
    config = model.config
    cache = DynamicCache(config=config)
    kinds, window = [], 0
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionLayer) and not isinstance(layer, DynamicLayer):
            kinds.append(LINEAR)
        elif type(layer) is DynamicSlidingWindowLayer:
            kinds.append(SLIDING)
            if window and layer.sliding_window != window:
                raise UserError(f"layer {i}: sliding windows of {window} and "
                                f"{layer.sliding_window} tokens in one model are not supported")
            window = layer.sliding_window
        elif type(layer) is DynamicLayer:
            kinds.append(FULL)
        else:
            raise UserError(f"layer {i} keeps a {type(layer).__name__} cache, which kvpool "
                            "cannot page")
    rows = tuple([i for i, k in enumerate(kinds) if k == FULL]
                 + [i for i, k in enumerate(kinds) if k == SLIDING])
    plan = LayerPlan(tuple(kinds), window, rows)
    if LINEAR not in kinds:
        return plan
    parts = _probe_states(model, kinds)
    return dataclasses.replace(plan, state_parts=parts, state_dtype=max(
        (p.dtype for p in parts), key=lambda d: torch.finfo(d).bits))


def _probe_states(model, kinds: list[str]) -> tuple[StatePart, ...]:
    """Run one token to see the linear layers' state tensors (shapes, dtypes)."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long), cache=cache, use_cache=True,
              logits_to_keep=1)
    parts, offset = [], 0
    for i, kind in enumerate(kinds):
        if kind != LINEAR:
            continue
        layer = cache.layers[i]
        for s in range(layer.number_of_states):
            for conv, tensor in ((False, layer.recurrent_states[s]), (True, layer.conv_states[s])):
                if tensor is None:
                    continue
                shape = tuple(tensor.shape[1:])  # batch 1
                if conv:
                    shape = shape[:-1] + (shape[-1] - 1,)
                parts.append(StatePart(i, s, conv, shape, offset, tensor.dtype))
                offset += math.prod(shape)
    return tuple(parts)


def snapshot(plan: LayerPlan, cache) -> torch.Tensor:
    """The checkpoint of ``cache`` now: a new flat tensor ``[plan.state_numel]`` of
    ``plan.state_dtype`` (a copy: the request goes on updating its own states)."""
    out = torch.empty(plan.state_numel, dtype=plan.state_dtype)
    for part in plan.state_parts:
        layer = cache.layers[part.layer]
        src = (layer.conv_states[part.state][0, ..., 1:] if part.conv
               else layer.recurrent_states[part.state][0])
        out[part.offset:part.offset + part.numel].view(part.shape).copy_(src)
    return out


def restore(plan: LayerPlan, cache, state: torch.Tensor) -> None:
    """Give the linear layers of a fresh ``cache`` (batch 1) the states of checkpoint
    ``state``, copied into new tensors of their own dtypes (the checkpoint itself is
    never written). The conv window's oldest column (never read) is zero."""
    for part in plan.state_parts:
        layer = cache.layers[part.layer]
        src = state[part.offset:part.offset + part.numel].view(part.shape)
        dtype = part.dtype
        if part.conv:
            window = torch.zeros((1, *part.shape[:-1], part.shape[-1] + 1), dtype=dtype)
            window[0, ..., 1:].copy_(src)
            layer.lazy_initialization(conv_states=window, state_idx=part.state,
                                      conv_kernel_size=window.shape[-1])
            layer.conv_states[part.state].copy_(window)
        else:
            tensor = src.to(dtype).unsqueeze(0)
            layer.lazy_initialization(recurrent_states=tensor, state_idx=part.state)
            layer.recurrent_states[part.state].copy_(tensor)
        # transformers sets this at a layer's first update; a restored state is a past
        layer.has_previous_state[part.state] = True
