"""SGLang's own classes on CPU, for the kvpool HiCache backend checks.

Builds SGLang 0.5.23's real device KV pools (MHATokenToKVPool, MLATokenToKVPool on
device "cpu"), its real host pools (MHATokenToKVPoolHost, MLATokenToKVPoolHost) and the
kvpool backend through SGLang's StorageBackendFactory from the extra-config JSON a user
passes. Page contents are derived from the page key, so another process can check them.

Run as a script it is "engine B": a worker answering one JSON request per stdin line.

SGLang's ``sglang.srt.configs`` imports torchvision at module level for vision-model
configs. PyPI's torchvision wheels are CUDA builds that do not load next to torch's CPU
build, so :func:`install_torchvision_placeholder` registers a module with only the names
those imports bind (no function of it is ever called on the storage path). It runs in
the SGLang check processes only, after transformers has recorded that torchvision is
absent, so nothing else sees it.
"""

from __future__ import annotations

import enum
import json
import os
import sys
import types

EXTRA_CONFIG = ('{"backend_name":"kvpool","module_path":"kvpool.integrations.sglang",'
                '"class_name":"KVPoolHiCacheStorage","interface_v1":1,"master":"127.0.0.1:50051"}')
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PAGE_SIZE = 4
LAYERS = 2
HEADS = 2
HEAD_DIM = 8
DEVICE_TOKENS = 128


def install_torchvision_placeholder() -> None:
    import transformers.utils.import_utils as iu

    iu.is_torchvision_available()  # cached False: transformers keeps its no-torchvision paths
    if "torchvision" in sys.modules:
        return

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    tv = types.ModuleType("torchvision")
    tr = types.ModuleType("torchvision.transforms")
    fn = types.ModuleType("torchvision.transforms.functional")
    tr.InterpolationMode = fn.InterpolationMode = InterpolationMode
    tr.functional, tv.transforms = fn, tr
    sys.modules.update({"torchvision": tv, "torchvision.transforms": tr,
                        "torchvision.transforms.functional": fn})


install_torchvision_placeholder()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

torch.set_num_threads(1)


def host_pool(kind: str, layout: str, host_tokens: int = 1024):
    """SGLang's host pool of ``kind`` ("mha" / "mla") over its real CPU device pool.
    SGLang sizes host pools against free RAM minus a 10 GiB reserve; its budget scope
    books this small pool against a fixed 1 GiB instead."""
    with host_memory_budget_scope(1 << 30):
        return _host_pool(kind, layout, host_tokens)


def _host_pool(kind: str, layout: str, host_tokens: int):
    if kind == "mha":
        dev = MHATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE_SIZE, dtype=torch.float32,
                               head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                               enable_memory_saver=False, enable_alt_stream=False)
        return MHATokenToKVPoolHost(dev._mha_buffer_info(), 2.0, 0, PAGE_SIZE, layout, pin_memory=False,
                                    device="cpu", device_capacity_tokens=DEVICE_TOKENS,
                                    start_layer=0, end_layer=LAYERS, host_token_capacity=host_tokens)
    dev = MLATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE_SIZE, dtype=torch.float32, kv_lora_rank=16,
                           qk_rope_head_dim=8, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    return MLATokenToKVPoolHost(dev._mla_buffer_info(), 2.0, 0, PAGE_SIZE, layout, pin_memory=False,
                                device="cpu", device_capacity_tokens=DEVICE_TOKENS, start_layer=0,
                                end_layer=LAYERS, target_layer_num=LAYERS, host_token_capacity=host_tokens)


def mamba_pool(slots: int = 16):
    """SGLang's Mamba host pool (page_first) over CPU state tensors: 2 layers, a
    recurrent state of 2 x 4 x 4 and one conv window of 12 x 3 per slot."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(temporal=torch.zeros((LAYERS, slots, 2, 4, 4)),
                                conv=(torch.zeros((LAYERS, slots, 12, 3)),))
    with host_memory_budget_scope(1 << 30):
        return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False,
                             device="cpu", layout="page_first")


def storage_config(master: str, kind: str = "mha", tp_rank: int = 0, tp_size: int = 1,
                   layout: str = "page_first", metrics: bool = False, **extra_keys) -> HiCacheStorageConfig:
    """SGLang's storage config as its cache controller fills it, with the user's JSON."""
    extra = {**json.loads(EXTRA_CONFIG), **extra_keys}
    extra["master"] = master
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=kind == "mla", enable_storage_metrics=metrics,
                                is_page_first_layout=layout.startswith("page_first"), model_name=MODEL,
                                extra_config=extra)


def backend(master: str, pool, kind: str = "mha", tp_rank: int = 0, tp_size: int = 1, metrics: bool = False,
            **extra_keys):
    """The backend as SGLang's cache controller makes it: factory, then host-pool registration."""
    cfg = storage_config(master, kind, tp_rank, tp_size, pool.layout, metrics, **extra_keys)
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    return b


def page_data(pool, key: str) -> torch.Tensor:
    """The flat data page that belongs to ``key`` (same in every process)."""
    g = torch.Generator().manual_seed(int(key[:12], 16))
    page = pool.get_dummy_flat_data_page()
    return torch.randn(page.shape, generator=g, dtype=torch.float32).to(page.dtype)


def fill(pool, keys: list[str]) -> torch.Tensor:
    """Host slots for ``keys`` holding their pages (written with SGLang's own setter)."""
    idx = pool.alloc(len(keys) * pool.page_size)
    for j, key in enumerate(keys):
        pool.set_from_flat_data_page(int(idx[j * pool.page_size]), page_data(pool, key))
    return idx


def empty_slots(pool, n: int) -> torch.Tensor:
    idx = pool.alloc(n * pool.page_size)
    for j in range(n):
        pool.set_from_flat_data_page(int(idx[j * pool.page_size]), pool.get_dummy_flat_data_page())
    return idx


def correct(pool, keys: list[str], idx: torch.Tensor) -> list[bool]:
    """Per page: its host slot holds the page of its key (read with SGLang's getter)."""
    return [torch.equal(pool.get_data_page(int(idx[j * pool.page_size]), flat=True), page_data(pool, k))
            for j, k in enumerate(keys)]


def serve() -> None:
    """Engine B: ``{"op": "open", "master", "kind", "layout", ...}`` then
    ``{"op": "exists" | "load" | "store", "keys": [...]}``; one JSON reply per line."""
    state = {}
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "open":
            if state:
                state["backend"].close()
            pool = host_pool(req["kind"], req["layout"])
            state = {"pool": pool, "backend": backend(req["master"], pool, req["kind"],
                                                      req.get("tp_rank", 0), req.get("tp_size", 1))}
            reply = {"ok": True}
        elif op == "exists":
            reply = {"hit": state["backend"].batch_exists(req["keys"])}
        elif op == "load":
            pool, keys = state["pool"], req["keys"]
            idx = empty_slots(pool, len(keys))
            loaded = state["backend"].batch_get_v1(keys, idx)
            reply = {"loaded": loaded, "correct": correct(pool, keys, idx)}
            pool.free(idx)
        elif op == "store":
            pool, keys = state["pool"], req["keys"]
            idx = fill(pool, keys)
            reply = {"stored": state["backend"].batch_set_v1(keys, idx)}
            pool.free(idx)
        else:
            reply = {"error": f"unknown op {op!r}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    serve()
