"""The connector's worker side on plain CPU tensors, against a real kvpool cluster.

Runs in vLLM's environment (the worker imports vLLM's connector metadata class), started
by tests/test_vllm_worker.py; no model and no engine: vLLM's paged caches are random
``[blocks, heads, block, 2*head_dim]`` tensors. Prints one JSON line of results; any
failed check raises (exit status 1).
"""

from __future__ import annotations

import json
import logging

import torch

from kvpool.cache.codec import HEADER_SIZE
from kvpool.integrations.vllm.keys import KeySpace
from kvpool.integrations.vllm.meta import BlockRun, KVPoolMetadata
from kvpool.integrations.vllm.store import GuardedStore
from kvpool.integrations.vllm.worker import WorkerSide
from kvpool.launch import Cluster

LAYERS, HEADS, BLOCK, HEAD_DIM, NUM_BLOCKS = 4, 2, 32, 16, 16
HASHES = [bytes([i]) * 32 for i in range(4)]
log = logging.getLogger("check_worker")
WAYS = [(False, True, "layered"), (False, False, "whole"), (True, False, "staged")]  # force_tcp, layerwise


def caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn":
            torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, generator=g) for i in range(LAYERS)}


def worker(master: str, kv: dict[str, torch.Tensor], force_tcp: bool = False,
           layerwise: bool = True) -> WorkerSide:
    w = WorkerSide(KeySpace("tiny", "float32", BLOCK, "cpu"),
                   GuardedStore(master, force_tcp, 5.0, log), 0, 0, log, layerwise=layerwise)
    w.register_kv_caches(kv)
    return w


def run(blocks: list[int]) -> BlockRun:
    return BlockRun("req", "", "", 0, HASHES[:len(blocks)], blocks)


def save(w: WorkerSide, blocks: list[int]) -> None:
    """Save as a step does, then wait until the background sender has stored it."""
    w.wait_for_save(KVPoolMetadata(saves=[run(blocks)]))
    w.close()


def load(w: WorkerSide, blocks: list[int], wait: bool = True) -> tuple[set[int], str]:
    """Load into ``blocks``, waiting for each layer as vLLM's forward does (unless not
    ``wait``); returns the load errors and how pages were copied: "layered" (straight out
    of shared memory beside the forward), "whole" (out of shared memory, every layer
    before it) or "staged" (read into staging pages)."""
    modes = []
    for name in ("start", "load"):
        real = getattr(w._loader, name)
        setattr(w._loader, name, lambda *a, _n=name, _f=real: modes.append(_n) or _f(*a))
    w.start_load_kv(KVPoolMetadata(loads=[run(blocks)]))
    for name in w.views if wait else ():
        w.wait_for_layer_load(name)
    errors = w.get_block_ids_with_load_errors()
    return errors, {"start": "layered", "load": "whole"}.get(modes[0] if modes else "", "staged")


def same(a: dict, b: dict, pairs) -> bool:
    return all(torch.equal(a[n][x], b[n][y]) for n in a for x, y in pairs)


def main() -> None:
    out = {}
    with Cluster(segment_size="64MiB") as cluster:
        src = caches(1)
        save(worker(cluster.master_addr, src), [1, 2, 3, 4])
        pairs = list(zip([1, 2, 3, 4], [9, 10, 11, 12]))
        for force_tcp, layerwise, expected in WAYS:
            dst = caches(2)
            errors, mode = load(worker(cluster.master_addr, dst, force_tcp, layerwise), [9, 10, 11, 12])
            assert errors == set() and mode == expected, (expected, errors, mode)
            assert same(src, dst, pairs), f"loaded blocks differ ({expected})"
            out[expected] = "same bytes"
        # a forward pass that never waits for a layer may have read blocks before they
        # landed: all are load errors (recomputed), and the worker loads whole from then on
        w = worker(cluster.master_addr, caches(5))
        errors, mode = load(w, [9, 10, 11, 12], wait=False)
        assert (errors, mode, w.layerwise) == ({9, 10, 11, 12}, "layered", False), (errors, mode)
        dst = caches(6)
        w.register_kv_caches(dst)
        errors, mode = load(w, [9, 10, 11, 12], wait=False)
        assert (errors, mode) == (set(), "whole") and same(src, dst, pairs), (errors, mode)
        out["unwaited"] = "recomputed, then whole"
        probe = worker(cluster.master_addr, caches(3))
        keys = probe.keys.store_keys(HASHES, 0, 0, "", "")
        client = probe.store.call("probe", lambda c: c)
        page = bytearray(client.get(keys[1]))
        page[HEADER_SIZE + 100] ^= 0xFF  # its checksum no longer matches
        client.upsert(keys[1], bytes(page))
        client.remove(keys[2], force=True)
        for force_tcp, layerwise, expected in WAYS:
            dst = caches(4)
            errors, _ = load(worker(cluster.master_addr, dst, force_tcp, layerwise), [9, 10, 11, 12])
            # block 10: corrupt (then removed: missing the next times); 11: removed
            assert errors == {10, 11}, (expected, errors)
            assert same(src, dst, [(1, 9), (4, 12)]), "good blocks beside bad ones differ"
            out[f"damaged_{expected}"] = sorted(errors)
        assert not client.is_exist(keys[1]), "a page that failed its check must be removed"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
