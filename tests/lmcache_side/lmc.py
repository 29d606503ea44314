"""LMCache 0.5.6's own classes on CPU for the kvpool connector checks.

Builds LMCache's engine config from the YAML a user writes, its metadata, its
LocalCPUBackend (MixedMemoryAllocator on CPU) and the connector through LMCache's own
plugin loading (``CreateConnector`` with ``plugin://kvpool``), on an asyncio loop thread
as LMCache runs it. Chunk contents are derived from the chunk hash, so another process
can check them. Run as a script it is a second LMCache instance:
``python lmc.py MASTER load|store HASH...`` prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import threading

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import CreateConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

torch.set_num_threads(1)
CHUNK = 16
KV_SHAPE = (2, 2, CHUNK, 2, 8)  # layers, K/V, chunk tokens, kv heads, head size
YAML = """\
chunk_size: {chunk}
local_cpu: true
max_local_cpu_size: 0.05
pre_caching_hash_algorithm: {algorithm}
remote_storage_plugins: ["kvpool"]
extra_config:
  remote_storage_plugin.kvpool.module_path: kvpool.integrations.lmcache
  remote_storage_plugin.kvpool.class_name: KVPoolConnector
  kvpool.master: {master}
"""


class Instance:
    """One LMCache instance's storage side: config, CPU backend, connector, loop."""

    def __init__(self, master: str, algorithm: str = "sha256_cbor", extra: str = ""):
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write(YAML.format(chunk=CHUNK, algorithm=algorithm, master=master) + extra)
        self.config = LMCacheEngineConfig.from_file(f.name)
        self.metadata = LMCacheMetadata(model_name="org/model", world_size=1, local_world_size=1, worker_id=0,
                                        local_worker_id=0, kv_dtype=torch.float32, kv_shape=KV_SHAPE,
                                        chunk_size=CHUNK)
        self.cpu = LocalCPUBackend(self.config, self.metadata, dst_device="cpu")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.connector = CreateConnector("plugin://kvpool", self.loop, self.cpu, self.config,
                                         self.metadata, plugin_name="kvpool")
        self.kvpool = self.connector._connector

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def key(self, chunk_hash: int) -> CacheEngineKey:
        return CacheEngineKey("org/model", 1, 0, chunk_hash, torch.float32)

    def chunk(self, chunk_hash: int, tokens: int = CHUNK):
        """A MemoryObj from LMCache's allocator holding the chunk of ``chunk_hash``."""
        obj = self.cpu.allocate(self.metadata.get_shapes(), self.metadata.get_dtypes(), None)
        full = expected(chunk_hash, obj.tensor.shape)
        if tokens < CHUNK:
            obj = self.kvpool.reshape_partial_chunk(obj, tokens * self.kvpool.single_token_size)
        obj.tensor.copy_(full[:, :, :tokens])
        return obj

    def close(self):
        self.run(self.connector.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def expected(chunk_hash: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(chunk_hash % (1 << 62))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32)


def matches(obj, chunk_hash: int) -> bool:
    full = expected(chunk_hash, (*obj.tensor.shape[:2], CHUNK, *obj.tensor.shape[3:]))
    return torch.equal(obj.tensor, full[:, :, :obj.tensor.shape[2]])


def main(master: str, op: str, hashes: list[int]) -> dict:
    inst = Instance(master)
    keys = [inst.key(h) for h in hashes]
    if op == "load":
        hit = inst.run(inst.connector.batched_async_contains("peer", keys))
        objs = inst.run(inst.connector.batched_get_non_blocking("peer", keys))
        out = {"hit": hit, "loaded": len(objs), "tokens": [o.tensor.shape[2] for o in objs],
               "correct": [matches(o, h) for o, h in zip(objs, hashes)]}
        for o in objs:
            o.ref_count_down()
    else:
        inst.run(inst.connector.batched_put(keys, [inst.chunk(h) for h in hashes]))
        out = {"stored": [inst.kvpool.exists_sync(k) for k in keys]}
    inst.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], [int(h) for h in sys.argv[3:]])), flush=True)
