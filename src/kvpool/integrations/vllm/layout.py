"""vLLM's paged KV tensors seen as blocks, and one stored page per block.

A stored page holds one block of every layer in kvpool's ``layer_first`` order,
``[L, 2, H_kv, block_size, head_dim]`` (K then V), the page shape of kvpool's own engine.
Each vLLM layout is turned into a strided *block view* ``[num_blocks, 2, H_kv,
block_size, head_dim]`` of the engine's tensor (no copy), so that saving a block of a
layer is one strided copy into its page and loading is one ``index_copy_`` back:

- CPU attention (``vllm/v1/attention/backends/cpu_attn.py``, layout LBHNC): per layer
  ``[num_blocks, H_kv, block_size, 2 * head_dim]``, whose block ``[H_kv, 2 * block_size,
  head_dim]`` view holds the block's K rows then its V rows per head.
- CUDA flash-attention (``vllm/v1/attention/backends/flash_attn.py``): per layer
  ``[2, num_blocks, block_size, H_kv, head_dim]``.

This module imports no vLLM, so its conversions are tested on plain tensors.
"""

from __future__ import annotations

import torch

from kvpool.errors import InvalidParams

CPU = "cpu_lbhnc"
FLASH = "flash_2bnhd"


def block_view(kv: torch.Tensor, layout: str, block_size: int) -> torch.Tensor:
    """The ``[num_blocks, 2, H_kv, block_size, head_dim]`` view of one layer's cache.

    ``kv``: the layer's tensor as vLLM registered it (CPU: ``[nb, H, B, 2D]``;
    FLASH: ``[2, nb, B, H, D]``). Raises InvalidParams when the shape does not fit.
    """
    if layout == CPU:
        if kv.dim() != 4 or kv.shape[2] != block_size or kv.shape[3] % 2:
            raise InvalidParams(f"CPU KV cache must be [blocks, heads, {block_size}, 2*head_dim], "
                                f"got {tuple(kv.shape)}")
        nb, heads, _, two_d = kv.shape
        return kv.view(nb, heads, 2, block_size, two_d // 2).transpose(1, 2)
    if layout == FLASH:
        if kv.dim() != 5 or kv.shape[0] != 2 or kv.shape[2] != block_size:
            raise InvalidParams(f"flash-attention KV cache must be [2, blocks, {block_size}, "
                                f"heads, head_dim], got {tuple(kv.shape)}")
        return kv.permute(1, 0, 3, 2, 4)
    raise InvalidParams(f"unknown KV layout {layout!r} (known: {CPU}, {FLASH})")


def detect_layout(kv: torch.Tensor, block_size: int) -> str:
    """CPU or FLASH from a layer tensor's rank and shape; InvalidParams if neither."""
    if kv.dim() == 4 and kv.shape[2] == block_size:
        return CPU
    if kv.dim() == 5 and kv.shape[0] == 2 and kv.shape[2] == block_size:
        return FLASH
    raise InvalidParams(f"KV cache of shape {tuple(kv.shape)} (block size {block_size}) is "
                        "neither vLLM's CPU [blocks, heads, block, 2*head_dim] nor "
                        "flash-attention's [2, blocks, block, heads, head_dim] layout")


def gather_blocks(view: torch.Tensor, block_ids: list[int], out: torch.Tensor) -> None:
    """``out[i] = view[block_ids[i]]`` for one layer: ``out`` ``[n, 2, H, B, D]`` on the CPU.

    On the CPU each block is one strided copy into its page. A device tensor is
    gathered on the device first, then copied to the host in one transfer.
    """
    if view.device.type == "cpu":
        for i, block in enumerate(block_ids):
            out[i].copy_(view[block])
    else:
        ids = torch.tensor(block_ids, device=view.device)
        out.copy_(view.index_select(0, ids))


def scatter_blocks(view: torch.Tensor, block_ids: list[int], src: torch.Tensor) -> None:
    """``view[block_ids[i]] = src[i]`` for one layer (one ``index_copy_``)."""
    ids = torch.tensor(block_ids, device=view.device)
    view.index_copy_(0, ids, src.to(view.device, non_blocking=True))
