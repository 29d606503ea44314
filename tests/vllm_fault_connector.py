"""A KVPoolConnector that damages the store between vLLM's lookup and its load, or
stalls its saves.

Loaded by a real vLLM engine in tests (``kv_connector_module_path:
"vllm_fault_connector"``, with tests/ on PYTHONPATH; engine in the test's process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). ``kv_connector_extra_config``:

- ``"faults"``: one entry per load the worker runs, in order: ``null`` (leave it),
  ``"corrupt:K"`` (flip one payload byte of block K of that load: its checksum fails) or
  ``"remove:K"`` (remove block K's object: the read finds nothing) or ``"stop:PID"``
  (SIGSTOP the kvpool master PID for this load, SIGCONT after it: the load's grant query
  times out, kvpool is unreachable).
- ``"hold_first_save": true``: the sender copies the first save batch only after vLLM
  has finished every request in it, then logs how many of its blocks vLLM still holds
  (``kvpool-test: ... N of M blocks still allocated``, from the scheduler's block pool).
- ``"stop_master_on_save": PID``: SIGSTOP the kvpool master before the first batch put,
  so that the put hangs until the client's timeout (the test sends SIGCONT).
"""

from __future__ import annotations

import os
import signal
import threading

from kvpool.cache.codec import HEADER_SIZE
from kvpool.child import pause_process
from kvpool.integrations.vllm.connector import KVPoolConnector, logger

HOLD_TIMEOUT_S = 600
_block_pool = []  # the scheduler's block pool (the same process as the worker)


class FaultyKVPoolConnector(KVPoolConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.faults = list(extra.get("faults", []))
        self._ended: set[str] = set()
        self._cond = threading.Condition()
        if self.worker is not None:
            sender = self.worker.sender
            if extra.get("hold_first_save"):
                sender.copy_out = self._held_once(sender.copy_out)
            if extra.get("stop_master_on_save"):
                sender.store = self._stop_master_once(sender.store,
                                                      int(extra["stop_master_on_save"]))

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        _block_pool.append(gpu_block_pool)

    def get_finished(self, finished_req_ids):
        with self._cond:
            self._ended |= set(finished_req_ids)
            self._cond.notify_all()
        return super().get_finished(finished_req_ids)

    def _held_once(self, copy_out):
        calls = []

        def held(batch):
            if not calls:
                calls.append(batch)
                with self._cond:
                    ended = self._cond.wait_for(lambda: batch.req_ids <= self._ended,
                                                HOLD_TIMEOUT_S)
                ids = [b for run in batch.runs for b in run.block_ids]
                alive = sum(1 for b in ids if _block_pool[-1].blocks[b].ref_cnt > 0)
                logger.info("kvpool-test: save resumed, request ended %s; %d of %d blocks "
                            "still allocated", ended, alive, len(ids))
            return copy_out(batch)
        return held

    def _stop_master_once(self, store, pid: int):
        calls = []

        def stalled(batch, pages):
            if not calls:
                calls.append(batch)
                pause_process(pid)
                logger.info("kvpool-test: master %d stopped before a batch put", pid)
            return store(batch, pages)
        return stalled

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if meta.loads and self.faults:
            mode, _, arg = (self.faults.pop(0) or "").partition(":")
            if mode == "stop":
                pid = int(arg)
                pause_process(pid)
                logger.info("kvpool-test: master %d stopped for a load", pid)
                try:
                    return super().start_load_kv(forward_context, **kwargs)
                finally:
                    os.kill(pid, signal.SIGCONT)
            if mode:
                self._damage(meta.loads[0], mode, arg)
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
