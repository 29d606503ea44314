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
    cache = DynamicCache(config=config)
    for layer, (keys, values) in zip(cache.layers, zip(seq[:, 0], seq[:, 1])):
        # set the layer's tensors directly: DynamicLayer.update would cat them onto an
        # empty tensor, a second full copy of the prefix
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return cache

def cache_to_pages(cache: DynamicCache, num_pages: int, page_size: int) -> torch.Tensor:
    """Copy the first ``num_pages`` full pages out of ``cache``.

    Returns: a new contiguous tensor ``[num_pages, L, 2, H_kv, page_size, D]``.
    Raises: ValueError when the cache holds fewer than ``num_pages * page_size`` tokens.
    """
    tokens = num_pages * page_size
    if cache.get_seq_length() < tokens:
        raise ValueError(f"cache holds {cache.get_seq_length()} tokens, need {tokens}")
    # [L, 2, 1, H, T, D] restricted to the first `tokens` positions
    kv = torch.stack([torch.stack((layer.keys[0, :, :tokens], layer.values[0, :, :tokens]))
                      for layer in cache.layers])
    layers, _, heads, _, dim = kv.shape
    return (kv.reshape(layers, 2, heads, num_pages, page_size, dim)
            .permute(3, 0, 1, 2, 4, 5).contiguous())
