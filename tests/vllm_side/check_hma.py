"""KVPoolHMAConnector's pieces in vLLM's own venv, on CPU tensors and a real kvpool cluster.

vLLM turns its hybrid memory allocator off on CPU, so no vLLM engine here runs with
several KV cache groups; this checks the connector's side of it with vLLM's own spec
classes: the group plans of a KVCacheConfig (full attention + a sliding window; a Mamba
group refused), the hit policies, and per-group saves and loads of vLLM CPU-layout
caches through the store. Prints one JSON object of named checks (true = passed).
Run by tests/test_vllm_hma.py with the vLLM interpreter.
"""

from __future__ import annotations

import json
import logging

import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        MambaSpec, SlidingWindowSpec)

from kvpool.integrations.vllm.hma import _with_group, combined_hit, group_plans, lookup
from kvpool.integrations.vllm.keys import KeySpace
from kvpool.integrations.vllm.meta import BlockRun, KVPoolMetadata
from kvpool.integrations.vllm.store import GuardedStore
from kvpool.integrations.vllm.worker import WorkerSide
from kvpool.launch import Cluster

B, H, D, NB, W = 32, 2, 8, 8, 48
FULL_LAYERS = ["model.layers.1.self_attn.attn"]
WINDOW_LAYERS = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
log = logging.getLogger("check_hma")


def config(*groups) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=list(groups))


def attention_groups():
    full = FullAttentionSpec(block_size=B, num_kv_heads=H, head_size=D, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=B, num_kv_heads=H, head_size=D, dtype=torch.float32,
                               sliding_window=W)
    return [KVCacheGroupSpec(FULL_LAYERS, full), KVCacheGroupSpec(WINDOW_LAYERS, window)]


def caches(fill: bool) -> dict[str, torch.Tensor]:
    """vLLM CPU-layout KV caches, [blocks, H, B, 2D] per layer."""
    g = torch.Generator().manual_seed(3)
    return {n: (torch.randn((NB, H, B, 2 * D), generator=g) if fill else torch.zeros((NB, H, B, 2 * D)))
            for n in FULL_LAYERS + WINDOW_LAYERS}


def main() -> dict[str, bool]:
    checks = {}
    plans = group_plans(config(*attention_groups()))
    checks["plans"] = ([p.trailing for p in plans] == [None, 2]
                       and plans[1].layers == tuple(WINDOW_LAYERS) and plans[0].tag != plans[1].tag)
    checks["one_group_keeps_the_plain_keys"] = group_plans(config(attention_groups()[0]))[0].tag == ""
    mamba = MambaSpec(block_size=B, shapes=((4, 4),), dtypes=(torch.float32,))
    try:
        group_plans(config(attention_groups()[0], KVCacheGroupSpec(["model.layers.3.mixer"], mamba)))
        checks["mamba_refused"] = False
    except NotImplementedError as exc:
        checks["mamba_refused"] = "not paged attention KV" in str(exc)
    present = [[True] * 6, [False, False, False, True, True, True]]
    checks["window_needs_only_its_blocks"] = combined_hit(plans, present, 0) == 6
    present[1][5] = False
    checks["a_missing_window_block_ends_the_hit_earlier"] = combined_hit(plans, present, 0) == 5

    base = KeySpace("tiny-hma", "float32", B, "cpu")
    spaces = [_with_group(base, p.tag) for p in plans]
    hashes = [bytes([i]) * 32 for i in range(6)]
    ids = list(range(1, 7))  # vLLM block id of block i
    with Cluster(segment_size="64MiB") as cluster:
        store = GuardedStore(cluster.master_addr, False, 10.0, log)
        a, b = caches(True), caches(False)
        for caches_of, reader in ((a, False), (b, True)):
            # built as KVPoolHMAConnector builds them: whole loads
            workers = [WorkerSide(s, store, 0, 0, log, staging_rows=8, layerwise=False)
                       for s in spaces]
            for plan, worker in zip(plans, workers):
                worker.register_kv_caches({n: caches_of[n] for n in plan.layers})
            if not reader:
                # the full group saves blocks 0..5; the window group holds 3..5 only
                for worker, first in zip(workers, (0, 3)):
                    meta = KVPoolMetadata(saves=[BlockRun("r", "", "", first, hashes[first:], ids[first:])])
                    worker.wait_for_save(meta)
                    worker.close()  # the background sender has stored them
                continue
            held = lookup(store, spaces, hashes, "", "", 0)
            hit = combined_hit(plans, held, 0)
            checks["lookup_through_the_store"] = hit == 6 and held[1][:3] == [False] * 3
            for plan, worker in zip(plans, workers):
                first = plan.first_block(hit, 0)
                worker.start_load_kv(KVPoolMetadata(loads=[BlockRun("r", "", "", first, hashes[first:hit],
                                                                    ids[first:hit])]))
                checks[f"group_{plan.index}_no_load_errors"] = not worker.get_block_ids_with_load_errors()
        loaded = [1, 2, 3, 4, 5, 6]
        checks["full_blocks_loaded"] = all(torch.equal(a[n][loaded], b[n][loaded]) for n in FULL_LAYERS)
        window = [5, 6]  # blocks 4 and 5: the window before the hit
        checks["window_blocks_loaded"] = all(torch.equal(a[n][window], b[n][window]) for n in WINDOW_LAYERS)
        checks["older_window_blocks_not_loaded"] = all(not b[n][1:5].any() for n in WINDOW_LAYERS)
        store.close()
    return checks


if __name__ == "__main__":
    print(json.dumps(main()))
