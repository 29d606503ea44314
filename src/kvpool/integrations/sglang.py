"""kvpool as SGLang HiCache's L3 storage backend (written against SGLang 0.5.23).

SGLang builds it through its ``StorageBackendFactory`` from the server flags::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
        "module_path": "kvpool.integrations.sglang", "class_name": "KVPoolHiCacheStorage",
        "interface_v1": 1, "master": "127.0.0.1:50051"}'

``interface_v1`` makes SGLang's cache controller call :meth:`batch_get_v1` /
:meth:`batch_set_v1`, which move bytes between host-pool slots and the store without
intermediate copies. Further extra-config keys: ``force_tcp`` (bool), ``timeout_s``,
``replica_num``, ``retry_s`` (seconds that loads and saves are skipped after the master
did not answer, 10), ``weights_fingerprint`` (part of the namespace), ``model`` (overrides
SGLang's model name in the namespace).

Store format: one object per page, ``sgl/<namespace digest hex>/<SGLang page hash>``,
holding kvpool's page header and then the page's host-pool regions in the order of the
host pool's flat data page (``get_data_page(flat=True)``: MHA all K then all V). The
namespace (``kvpool.cache.namespace``) holds model, weights, dtype, page size, host
layout, MHA/MLA, TP rank *and* TP size, PP rank and size, context-parallel rank: SGLang's
own Mooncake backend keys MHA pages by TP rank alone, so rank 0 of a TP2 and of a TP4
deployment share keys for different head slices; here they never do. SGLang's page hash
(``get_hash_str``, seeded by its own namespace when a request has ``cache_salt`` or
``extra_key``) stays the page's identity inside it. A page whose header does not match on
load (corrupted, another namespace) is a miss and is removed; a sound page of another
size, or a target buffer of the wrong size, is a miss and the page stays.

MLA KV is the same on every TP rank: the namespace has no TP rank for MLA and only the
storage writer rank (``HiCacheStorageConfig.is_storage_writer``) writes; the others
report their pages as stored.

Hybrid models (the ``*_v2`` interface): every further host pool SGLang registers with
``register_mem_host_pool_v2`` (Mamba states, sliding-window KV; MHA models only) stores
each of its pages as one object ``<KV page object>/<pool name>``: all of that page's
regions together (K17), with a header bound to the key and the pool. ``batch_exists_v2``
applies SGLang's per-pool hit policies (``ALL_PAGES``: every page before the hit;
``TRAILING_PAGES``: the last ``len(transfer.keys)`` pages before it) with
:func:`kvpool.cache.hybrid.restorable_prefixes`, the rule the reference engine's own
hybrid cache uses, and returns every restorable prefix length for SGLang to intersect
across ranks.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransferResult,
)

from kvpool.cache.codec import PageHeader
from kvpool.cache.hybrid import restorable_prefixes
from kvpool.cache.namespace import Namespace
from kvpool.cache.pagestore import object_digest
from kvpool.client import Client
from kvpool.engine.models import model_fingerprint
from kvpool.errors import InvalidParams
from kvpool.integrations.extra_config import page_store_settings, warn_unknown
from kvpool.integrations.objects import PageObjects

log = logging.getLogger(__name__)

# kvpool's keys of the extra config, and those SGLang itself reads from the same JSON
EXTRA_KEYS = frozenset({"master", "force_tcp", "timeout_s", "retry_s", "replica_num", "model",
                        "weights_fingerprint",
                        "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
                        "enable_metadata_cache", "metadata_ttl", "extra_backend_tag"})

KEY_PREFIX = "sgl/"
# Host layouts whose pages SGLang's host pools describe as byte regions
# (get_page_buffer_meta); "page_unified" and split-KV layouts have no such description.
LAYOUTS = ("page_first", "page_first_direct", "page_head", "layer_first")
_V2 = ("kvpool's SGLang backend supports hybrid-model host pools (the HiCache *_v2 "
       "interface) for MHA models with page-region host pools")


class KVPoolHiCacheStorage(HiCacheStorage):
    """HiCache storage on a kvpool cluster; one instance per SGLang rank.

    Args (as SGLang's factory passes them for a "dynamic" backend):
        storage_config: SGLang's HiCacheStorageConfig; ``extra_config`` is the parsed
            extra-config JSON and must name ``master`` ("host:port").
        kwargs: further arguments SGLang passes (unused).

    Raises ValueError (no master, no model name, unsupported parallel setup) and
    kvpool errors when the master cannot be reached.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        extra = dict(storage_config.extra_config or {})
        warn_unknown(extra, EXTRA_KEYS, log, "--hicache-storage-backend-extra-config")
        settings = page_store_settings(extra, "", "kvpool backend, --hicache-storage-backend-extra-config")
        if storage_config.should_split_heads or storage_config.dcp_size > 1:
            raise NotImplementedError("kvpool's SGLang backend does not support heterogeneous "
                                      "TP (tp_lcm_size) or decode context parallelism yet")
        self.model = extra.get("model") or storage_config.model_name
        if not self.model:
            raise ValueError("kvpool backend needs a model name (SGLang's model path, "
                             'or "model" in the extra config) for its namespace')
        self.storage_config = storage_config
        # the weights' own fingerprint when SGLang serves a local folder: a checkpoint
        # redeployed under the same path must not load the old one's KV (a trial)
        self.fingerprint = str(extra.get("weights_fingerprint") or model_fingerprint(self.model))
        self.is_mla = bool(storage_config.is_mla_model)
        self.is_writer = storage_config.is_storage_writer
        self.client = Client(settings.master, force_tcp=settings.force_tcp, timeout_s=settings.timeout_s)
        self.objects = PageObjects(self.client, settings.replica_num, retry_s=settings.retry_s)
        self.mem_pool_host = None
        self.side_pools: dict[str, tuple[Any, int]] = {}  # name -> (host pool, page bytes)
        self.ns: Namespace | None = None
        self._regions: list[tuple[int, int, memoryview]] = []  # (address, bytes, view)
        self._stats = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                       "backup_bandwidth": []}

    # ------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Register the host pool's buffers with the kvpool client once (zero copy) and
        fix the namespace from its geometry. Raises NotImplementedError for a layout
        whose pages are not described as byte regions."""
        super().register_mem_pool_host(mem_pool_host)
        layout = mem_pool_host.layout
        if layout not in LAYOUTS:
            raise NotImplementedError(f"kvpool's SGLang backend supports host layouts {LAYOUTS}, "
                                      f"not {layout!r}")
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            raise NotImplementedError(_V2)
        if layout == "layer_first" and not self.is_mla:
            log.warning("kvpool: SGLang's MHA layer_first host layout splits a page into 2 x %d "
                        "regions, each moved on its own: L3 loads are several times slower than "
                        "with --hicache-mem-layout page_first / page_first_direct / page_head",
                        mem_pool_host.layer_num)
        self._regions = sorted(self._register(buf) for buf in _host_buffers(mem_pool_host))
        self.ns = self._namespace(mem_pool_host)
        self._digest = self.ns.digest()
        self._prefix = f"{KEY_PREFIX}{self._digest.hex()}/"
        self.page_bytes = self._page_layout(mem_pool_host)
        self.side_pools[str(PoolName.KV)] = (mem_pool_host, self.page_bytes)

    def _register(self, buf: torch.Tensor) -> tuple[int, int, memoryview]:
        reg = self.client.register_buffer(buf)
        return buf.data_ptr(), reg.nbytes, reg.view

    def _namespace(self, pool) -> Namespace:
        """Everything that changes a page's bytes (MLA pages are the same on every TP rank)."""
        cfg = self.storage_config
        tp_rank, tp_size = (0, 1) if self.is_mla else (cfg.tp_rank, cfg.tp_size)
        return Namespace(
            model=self.model, weights_fingerprint=self.fingerprint,
            dtype=str(pool.dtype).removeprefix("torch."), page_size=pool.page_size,
            kv_layout=f"sglang-{'mla' if self.is_mla else 'mha'}-{pool.layout}",
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=cfg.pp_rank, pp_size=cfg.pp_size,
            extra=(f"attn_cp={cfg.attn_cp_rank}/{cfg.attn_cp_size}",))

    def _page_layout(self, pool) -> int:
        """Bytes of one page; checks that SGLang's buffer description covers it."""
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(pool.page_size))
        flat = pool.get_data_page(0, flat=True)
        total = sum(sizes)
        if total != flat.numel() * flat.element_size():
            raise NotImplementedError(f"host pool {type(pool).__name__} ({pool.layout}) describes "
                                      f"{total} bytes per page, its data page has "
                                      f"{flat.numel() * flat.element_size()}")
        for ptr, size in zip(ptrs, sizes):
            self._view(ptr, size)  # raises when a region lies outside the registered buffers
        return total

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Register a further host pool of a hybrid model (its buffers zero copy, its
        page size in bytes); the KV pool again is accepted as is. Raises
        NotImplementedError for an MLA model or a pool whose pages are not described
        as byte regions (``get_page_buffer_meta``)."""
        name = str(host_pool_name)
        if name == str(PoolName.KV):
            return
        self._ns()
        if self.is_mla:
            raise NotImplementedError(f"{_V2}; this model is MLA (pool {name})")
        if not hasattr(host_pool, "get_page_buffer_meta"):
            raise NotImplementedError(f"{_V2}; pool {name} ({type(host_pool).__name__}) "
                                      "describes no page regions")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._regions = sorted(self._regions + [self._register(b) for b in _host_buffers(host_pool)])
        self.side_pools[name] = (host_pool, self._page_layout(host_pool))

    def batch_exists_v2(self, keys: List[str], pool_transfers=None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """The longest prefix of ``keys`` whose KV pages are stored and that every pool
        of ``pool_transfers`` can restore by its hit policy; one existence RPC for all.
        ``restorable_prefix_pages`` lists every length that works (a TRAILING_PAGES
        pool leaves holes). Raises NotImplementedError for BLOCK_GROUPS."""
        transfers = [t for t in pool_transfers or [] if str(t.name) != str(PoolName.KV)]
        for t in transfers:
            if t.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                raise NotImplementedError(f"kvpool: hit policy {t.hit_policy.value} (pool {t.name!s})")
            self._side(t.name)
        names = [self.store_key(k) for k in keys]
        names += [self._object_name(k, t.name) for t in transfers for k in keys]
        flags = self.objects.exists(names)
        n = len(keys)
        kv_pages = flags[:n].index(False) if False in flags[:n] else n
        hit_count = {PoolName.KV: kv_pages} if kv_pages else {}
        pools = []
        for i, t in enumerate(transfers):
            present = flags[n * (i + 1):n * (i + 2)]
            trailing = (None if t.hit_policy == PoolHitPolicy.ALL_PAGES
                        else max(1, len(t.keys) if t.keys else 1))
            own = restorable_prefixes(kv_pages, [(trailing, present)])
            if own:
                hit_count[t.name] = own[-1]
            pools.append((trailing, present))
        restorable = restorable_prefixes(kv_pages, pools)
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    def batch_get_v2(self, transfers, extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> dict[str, List[bool]]:
        """Read each transfer's pages straight into its pool's host slots; per pool name,
        per page True when the bytes landed and passed the header check."""
        out = {}
        for t in transfers:
            if str(t.name) == str(PoolName.KV):
                out[t.name] = self.batch_get_v1(t.keys, t.host_indices)
                continue
            out[t.name] = self.objects.read(
                [self._object_name(k, t.name) for k in t.keys],
                [self._side_header(k, t.name) for k in t.keys],
                self._side_parts(t.name, t.keys, t.host_indices))
        return out

    def batch_set_v2(self, transfers, extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> dict[str, List[bool]]:
        """Write each transfer's pages the store lacks from their host slots; per pool
        name, per page True when the page is stored afterwards."""
        out = {}
        for t in transfers:
            if str(t.name) == str(PoolName.KV):
                out[t.name] = self.batch_set_v1(t.keys, t.host_indices)
                continue
            names = [self._object_name(k, t.name) for k in t.keys]
            ok = self.objects.exists(names)
            todo = [j for j, present in enumerate(ok) if not present]
            if todo:
                parts = self._side_parts(t.name, t.keys, t.host_indices)
                stored = self.objects.write([names[j] for j in todo],
                                            [self._side_header(t.keys[j], t.name) for j in todo],
                                            [parts[j] for j in todo])
                for j, good in zip(todo, stored):
                    ok[j] = good
            out[t.name] = ok
        return out

    def _side(self, name) -> tuple[Any, int]:
        try:
            return self.side_pools[str(name)]
        except KeyError:
            raise InvalidParams(f"kvpool: pool {name!s} was not registered "
                                "(register_mem_host_pool_v2)") from None

    def _object_name(self, key: str, pool) -> str:
        """The object of ``pool``'s part of page ``key``: ``<KV object>/<pool>``."""
        return f"{self.store_key(key)}/{pool!s}"

    def _side_header(self, key: str, pool) -> PageHeader:
        """The header of ``pool``'s part of page ``key``: bound to the key and the pool."""
        host, page_bytes = self._side(pool)
        return PageHeader(self._digest, object_digest(self._header(key).page_key, str(pool)),
                          0, host.page_size, page_bytes)

    def _side_parts(self, pool, keys: List[str], host_indices: torch.Tensor) -> list[list[memoryview]]:
        """Per page, the regions of ``pool``'s host slots (SGLang's
        ``get_page_buffer_meta`` order: one object holds them all)."""
        host, _ = self._side(pool)
        if len(host_indices) != len(keys) * host.page_size:
            raise InvalidParams(f"{len(keys)} keys need {len(keys) * host.page_size} host "
                                f"indices of pool {pool!s}, got {len(host_indices)}")
        ptrs, sizes = host.get_page_buffer_meta(host_indices)
        n = len(ptrs) // len(keys) if keys else 0
        return [[self._view(p, s) for p, s in zip(ptrs[j * n:(j + 1) * n], sizes[j * n:(j + 1) * n])]
                for j in range(len(keys))]

    # ------------------------------------------------------------ keys and pages

    def store_key(self, key: str) -> str:
        """Store object name of SGLang page ``key`` in this backend's namespace."""
        self._ns()
        return self._prefix + key

    def _ns(self) -> Namespace:
        if self.ns is None:
            raise InvalidParams("register_mem_pool_host must be called before page I/O")
        return self.ns

    def _header(self, key: str) -> PageHeader:
        """What page ``key`` must carry. SGLang's page hash is the page key (its SHA-256
        when it is not 64 hex digits); the page index is 0: SGLang's storage calls do not
        give a page's position, and its chained hash already fixes it."""
        ns = self._ns()
        try:
            page_key = bytes.fromhex(key) if len(key) == 64 else None
        except ValueError:
            page_key = None
        if page_key is None:
            page_key = hashlib.sha256(key.encode()).digest()
        return PageHeader(self._digest, page_key, 0, ns.page_size, self.page_bytes)

    def _view(self, ptr: int, size: int) -> memoryview:
        """The registered host memory at address ``ptr`` (``size`` bytes)."""
        i = bisect.bisect_right(self._regions, (ptr, float("inf"))) - 1
        if i >= 0:
            base, nbytes, view = self._regions[i]
            if base <= ptr and ptr + size <= base + nbytes:
                return view[ptr - base: ptr - base + size]
        raise InvalidParams(f"host region 0x{ptr:x}+{size} is outside the registered host pool")

    def _page_parts(self, keys: List[str], host_indices: torch.Tensor) -> list[list[memoryview]]:
        """Per page, its host-pool regions in flat-data-page order (SGLang's own pointer
        arithmetic: ``get_page_buffer_meta``)."""
        pool = self.mem_pool_host
        if len(host_indices) != len(keys) * pool.page_size:
            raise InvalidParams(f"{len(keys)} keys need {len(keys) * pool.page_size} host "
                                f"indices, got {len(host_indices)}")
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        n = len(ptrs) // len(keys)
        out = []
        for j in range(len(keys)):
            views = [self._view(p, s) for p, s in zip(ptrs[j * n:(j + 1) * n], sizes[j * n:(j + 1) * n])]
            if not self.is_mla and n > 2:
                # MHA layer_first lists K and V per layer; the flat page is all K, then all V
                views = views[0::2] + views[1::2]
            out.append(views)
        return out

    # ------------------------------------------------------------ zero-copy interface

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Length of the leading run of ``keys`` present in the store (one RPC)."""
        flags = self.objects.exists([self.store_key(k) for k in keys])
        return flags.index(False) if False in flags else len(flags)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Read pages straight into their host-pool slots (``page_size`` indices per key).
        Per page True only when its bytes are in the slot and passed the header check."""
        if not keys:
            return []
        start = time.perf_counter()
        ok = self.objects.read([self.store_key(k) for k in keys], [self._header(k) for k in keys],
                               self._page_parts(keys, host_indices))
        self._record("prefetch", sum(ok), time.perf_counter() - start)
        return ok

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Write the pages the store lacks straight from their host-pool slots. Per page
        True when it is in the store afterwards (MLA non-writer ranks write nothing and
        answer True: the writer rank stores the same bytes)."""
        if not keys:
            return []
        if not self.is_writer:
            return [True] * len(keys)
        names = [self.store_key(k) for k in keys]
        ok = self.objects.exists(names)
        todo = [j for j, present in enumerate(ok) if not present]
        if todo:
            start = time.perf_counter()
            parts = self._page_parts(keys, host_indices)
            stored = self.objects.write([names[j] for j in todo], [self._header(keys[j]) for j in todo],
                                        [parts[j] for j in todo])
            for j, s in zip(todo, stored):
                ok[j] = s
            self._record("backup", sum(stored), time.perf_counter() - start)
        return ok

    # ------------------------------------------------------------ generic interface

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        """Fill ``target_location`` (a contiguous CPU tensor of one flat data page, e.g.
        ``get_dummy_flat_data_page()``) with page ``key``; returns it, or None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        """:meth:`get` for many pages in one batch."""
        if target_locations is None or len(target_locations) != len(keys):
            raise InvalidParams("kvpool batch_get needs one target tensor per key")
        parts = [[_byte_view(t)] for t in target_locations]
        ok = self.objects.read([self.store_key(k) for k in keys], [self._header(k) for k in keys], parts)
        return [t if good else None for t, good in zip(target_locations, ok)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Store ``value`` (one flat data page, ``get_data_page(index, flat=True)``)."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        """Store the flat data pages ``values`` the store lacks; True when all are stored."""
        if values is None or len(values) != len(keys):
            raise InvalidParams("kvpool batch_set needs one page tensor per key")
        if not keys or not self.is_writer:
            return bool(keys)
        names = [self.store_key(k) for k in keys]
        present = self.objects.exists(names)
        todo = [j for j, p in enumerate(present) if not p]
        stored = self.objects.write([names[j] for j in todo], [self._header(keys[j]) for j in todo],
                                    [[_byte_view(values[j].contiguous())] for j in todo])
        return all(stored)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------ housekeeping

    def clear(self) -> None:
        """Remove this namespace's pages (not the rest of the store, unlike Mooncake's
        ``remove_all``)."""
        if self.ns is not None:
            self.client.remove_by_regex("^" + self._prefix, force=True)

    def get_stats(self):
        """SGLang's StorageMetrics since the last call (pages per batch and GB/s of
        prefetches and backups) when storage metrics are on, else None."""
        if not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        for name, values in self._stats.items():
            getattr(metrics, name).extend(values)
            values.clear()
        return metrics

    def _record(self, kind: str, pages: int, seconds: float) -> None:
        if self.storage_config.enable_storage_metrics and pages:
            self._stats[f"{kind}_pgs"].append(pages)
            self._stats[f"{kind}_bandwidth"].append(pages * self.page_bytes / max(seconds, 1e-9) / 2**30)

    @property
    def rejects(self):
        """Pages refused on load, by reason (kvpool.cache.codec reasons)."""
        return self.objects.rejects

    def close(self) -> None:
        """Unregister the host pool and close the client (safe to call twice)."""
        self.client.close()


def _host_buffers(pool) -> list[torch.Tensor]:
    """The contiguous host tensors holding the pool's pages (as SGLang's Mooncake backend
    registers them: ``get_hybrid_pool_buffer()`` when the pool has it, else ``kv_buffer``)."""
    get = getattr(pool, "get_hybrid_pool_buffer", None)
    bufs = [b for b in (get() if get else [pool.kv_buffer]) if b is not None]
    for b in bufs:
        if not b.is_contiguous() or b.device.type != "cpu":
            raise NotImplementedError("kvpool's SGLang backend needs contiguous CPU host buffers")
    return bufs


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, sharing its memory (writable)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise InvalidParams("kvpool's SGLang backend needs contiguous CPU page tensors")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())
