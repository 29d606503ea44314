"""KV pages <-> the transformers cache of a decoder-only model.

A page holds ``page_size`` consecutive tokens of every layer, in the "layer_first"
layout of the cache namespace: a tensor of shape ``[L, 2, H_kv, page_size, D]``
(L layers, 2 = key then value, H_kv KV heads, D head dim) in the model's dtype.
transformers keeps per layer ``keys`` and ``values`` of shape ``[1, H_kv, T, D]``
(batch 1 here). Keys are stored after RoPE, so a page is only valid at the positions
it was computed for; a prefix page is, by construction.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


def page_shape(config, page_size: int) -> tuple[int, int, int, int, int]:
    """Shape ``(L, 2, H_kv, page_size, D)`` of one page for a HF model ``config``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (config.num_hidden_layers, 2, config.num_key_value_heads, page_size, head_dim)


def pages_to_cache(pages: torch.Tensor, config) -> DynamicCache:
    """Build a DynamicCache holding the tokens of ``pages`` in order.

    Args:
        pages: ``[n, L, 2, H_kv, P, D]``, n >= 1 pages of one sequence, in page order.
        config: the model's config (gives the per-layer cache types).
    Returns: a cache whose ``get_seq_length()`` is ``n * P``.
    """
    n, layers, _, heads, page_size, dim = pages.shape
    # [n, L, 2, H, P, D] -> [L, 2, H, n, P, D] -> [L, 2, 1, H, n*P, D]: the one copy
    seq = pages.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, 1, heads, n * page_size, dim)
    return seq_cache(seq, n * page_size, config)


def kv_buffer(page_shape_: tuple[int, ...], capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised KV of one sequence of up to ``capacity`` tokens, in the layout the
    model reads: ``[L, 2, 1, H_kv, capacity, D]`` (per layer keys then values, batch 1)."""
    layers, _, heads, _, dim = page_shape_
    return torch.empty((layers, 2, 1, heads, capacity, dim), dtype=dtype)


def pages_view(seq: torch.Tensor, num_pages: int, page_size: int) -> torch.Tensor:
    """The first ``num_pages * page_size`` tokens of ``seq`` (see :func:`kv_buffer`) seen
    as pages ``[n, L, 2, H_kv, P, D]``: a view, for ``PrefixCache.load(m, out=...)``,
    which then copies each page once, straight into the layout the model reads."""
    tokens = seq[:, :, 0, :, :num_pages * page_size]          # [L, 2, H, n*P, D]
    return tokens.unflatten(3, (num_pages, page_size)).permute(3, 0, 1, 2, 4, 5)


def seq_cache(seq: torch.Tensor, length: int, config) -> DynamicCache:
    """A DynamicCache whose layers hold the first ``length`` tokens of ``seq``
    ``[L, 2, 1, H_kv, capacity, D]`` and write later tokens in place (shared memory).

    Stock DynamicLayer concatenates every update onto the whole cache, a full copy of
    the KV per forward (the prefix again at prefill, all of it at each decode step);
    here the tokens land in the free part of ``seq``. Past ``capacity`` a layer falls
    back to concatenating.
    """
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        keys, values = seq[i, 0], seq[i, 1]
        if type(layer) is DynamicLayer:
            cache.layers[i] = InPlaceLayer(keys, values, length)
        else:  # a sliding-window or other special layer keeps its own update
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys[..., :length, :], values[..., :length, :]
    return cache


class InPlaceLayer(DynamicLayer):
    """A DynamicLayer over preallocated storage ``[1, H_kv, capacity, D]`` per keys and
    values; ``keys``/``values`` are views of the filled part."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self._keys, self._values = keys, values
        self.device = keys.device
        self.keys, self.values = keys[..., :length, :], values[..., :length, :]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            return super().update(key_states, value_states, *args, **kwargs)
        self._keys[..., start:end, :].copy_(key_states)
        self._values[..., start:end, :].copy_(value_states)
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values


class InPlaceSlidingLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer over preallocated storage ``[1, H_kv, capacity, D]`` per keys
    and values, holding the first ``length`` tokens of a sequence.

    Every token's keys and values are written into the storage (so a request's pages can
    be stored, as for full layers); attention sees what transformers' own layer shows: the
    last ``window - 1`` tokens before the new ones, then the new ones. After a cached
    prefix only those last ``window - 1`` need to be in the storage: older positions are
    never read. Past ``capacity`` it falls back to transformers' concatenation.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int, window: int):
        super().__init__(sliding_window=window)
        self._keys, self._values = keys, values
        self.device = keys.device
        self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)
        self.is_initialized = True
        self.cumulative_length = length
        self._show(length)

    def _show(self, end: int) -> None:
        lo = max(0, end - (self.sliding_window - 1))
        self.keys, self.values = self._keys[..., lo:end, :], self._values[..., lo:end, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.cumulative_length
        end = start + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            return super().update(key_states, value_states, *args, **kwargs)
        self._keys[..., start:end, :].copy_(key_states)
        self._values[..., start:end, :].copy_(value_states)
        lo = max(0, start - (self.sliding_window - 1))
        self.cumulative_length = end
        self._show(end)
        return self._keys[..., lo:end, :], self._values[..., lo:end, :]
