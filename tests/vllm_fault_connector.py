"""A KVPoolConnector that damages the store between vLLM's lookup and its load.

Loaded by a real vLLM engine in tests (``kv_connector_module_path:
"vllm_fault_connector"``, with tests/ on PYTHONPATH). ``kv_connector_extra_config``
``"faults"``: one entry per load the worker runs, in order: ``null`` (leave it),
``"corrupt:K"`` (flip one payload byte of block K of that load: its checksum fails) or
``"remove:K"`` (remove block K's object: the read finds nothing).
"""

from __future__ import annotations

from kvpool.cache.codec import HEADER_SIZE
from kvpool.integrations.vllm.connector import KVPoolConnector


class FaultyKVPoolConnector(KVPoolConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.faults = list(extra.get("faults", []))

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if meta.loads and self.faults:
            fault = self.faults.pop(0)
            if fault:
                self._damage(meta.loads[0], *fault.split(":"))
        super().start_load_kv(forward_context, **kwargs)

    def _damage(self, run, mode: str, index: str) -> None:
        w = self.worker
        key = w.keys.store_keys([run.block_hashes[int(index)]], w.tp_rank, w.pp_rank,
                                run.cache_salt, run.lora)[0]
        if mode == "remove":
            self.store.call("fault", lambda c: c.remove(key, force=True))
            return
        page = bytearray(self.store.call("fault", lambda c: c.get(key)))
        page[HEADER_SIZE + 100] ^= 0xFF
        self.store.call("fault", lambda c: c.upsert(key, bytes(page)))
