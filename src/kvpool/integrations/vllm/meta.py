"""What the scheduler side tells the worker side each step (vLLM connector metadata)."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclasses.dataclass
class BlockRun:
    """Consecutive blocks of one request to load or save.

    ``block_hashes[i]`` (vLLM's hash of block ``first_index + i`` of the request) lives
    in vLLM block ``block_ids[i]``; ``cache_salt`` and ``lora`` pick the namespace.
    """

    req_id: str
    cache_salt: str
    lora: str
    first_index: int
    block_hashes: list[bytes]
    block_ids: list[int]


@dataclasses.dataclass
class KVPoolMetadata(KVConnectorMetadata):
    """Loads to run before this step's forward, saves to start after it, and the
    requests vLLM preempted for this step (their blocks are free to reuse)."""

    loads: list[BlockRun] = dataclasses.field(default_factory=list)
    saves: list[BlockRun] = dataclasses.field(default_factory=list)
    preempted: set[str] = dataclasses.field(default_factory=set)
