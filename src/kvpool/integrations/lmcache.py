"""kvpool as an LMCache remote storage plugin (written against LMCache 0.5.6).

In LMCache's YAML config::

    remote_storage_plugins: ["kvpool"]
    extra_config:
      remote_storage_plugin.kvpool.module_path: kvpool.integrations.lmcache
      remote_storage_plugin.kvpool.class_name: KVPoolConnector
      kvpool.master: 127.0.0.1:50051
      # optional: kvpool.force_tcp: true, kvpool.timeout_s: 10, kvpool.replica_num: 1,
      #           kvpool.retry_s: 10  (loads and saves skipped after the master did not answer),
      #           kvpool.http: 127.0.0.1:PORT  (the master's --http-port, for list())

LMCache's DynamicConnectorAdapter constructs :class:`KVPoolConnector` with
``(loop=, local_cpu_backend=, config=)``. Each LMCache chunk is one store object,
``lmc/<namespace digest hex>/<CacheEngineKey.to_string()>``: kvpool's page header, then
the chunk's bytes (a partial last chunk is shorter). The namespace holds model, KV
dtypes, chunk shapes, memory format, chunk size, worker id and world size; a chunk
whose header does not match on load is a miss and is removed.

Chunk hashes: LMCache's default ``pre_caching_hash_algorithm: builtin`` is Python's
``hash()``, which differs in every process unless ``PYTHONHASHSEED`` is fixed, so two
LMCache instances never find each other's chunks. The connector warns at start in that
case; fix it with ``pre_caching_hash_algorithm: sha256_cbor`` in the YAML, or
``export PYTHONHASHSEED=0`` for every instance.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import os
import urllib.parse
import urllib.request
from typing import List, Optional

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvpool.cache.codec import HEADER_SIZE, PageHeader
from kvpool.cache.namespace import Namespace
from kvpool.client import Client, ReadHandle
from kvpool.engine.models import model_fingerprint
from kvpool.errors import ErrorCode, KVPoolError
from kvpool.integrations.extra_config import page_store_settings, warn_unknown
from kvpool.integrations.objects import PageObjects

log = logging.getLogger(__name__)

EXTRA_KEYS = frozenset({"kvpool.master", "kvpool.force_tcp", "kvpool.timeout_s", "kvpool.retry_s",
                        "kvpool.replica_num", "kvpool.http"})  # of extra_config's "kvpool." keys

KEY_PREFIX = "lmc/"
MAX_LOCKED_LOOKUPS = 1024  # lookups whose read leases wait for their get, oldest released first
BUILTIN_HASH_WARNING = (
    "kvpool: LMCache's pre_caching_hash_algorithm is 'builtin' (Python's hash()) and "
    "PYTHONHASHSEED is not fixed: chunk keys differ in every process, so other instances "
    "will never hit this one's chunks. Set pre_caching_hash_algorithm: sha256_cbor, or "
    "export PYTHONHASHSEED=0 for every instance.")


def hash_seed_is_random(algorithm: str) -> bool:
    """True when chunk hashes of ``algorithm`` differ between processes: LMCache's
    "builtin" (Python's hash()) without a fixed PYTHONHASHSEED."""
    return algorithm == "builtin" and os.environ.get("PYTHONHASHSEED", "random") == "random"


class KVPoolConnector(RemoteConnector):
    """LMCache RemoteConnector on a kvpool cluster.

    Args (as LMCache's DynamicConnectorAdapter passes them):
        loop: LMCache's asyncio loop (store calls run in its default executor).
        local_cpu_backend: allocates the MemoryObj each loaded chunk is read into.
        config: LMCacheEngineConfig; ``extra_config["kvpool.master"]`` is "host:port".

    Raises ValueError without ``kvpool.master``; kvpool errors when the master cannot
    be reached.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend, config, plugin_name: str = "kvpool"):
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        extra = (config.extra_config if config is not None else None) or {}
        warn_unknown({k: v for k, v in extra.items() if str(k).startswith("kvpool.")}, EXTRA_KEYS, log,
                     "extra_config")
        settings = page_store_settings(extra, "kvpool.", "kvpool connector, extra_config")
        algorithm = getattr(config, "pre_caching_hash_algorithm", "builtin")
        if hash_seed_is_random(algorithm):
            log.warning(BUILTIN_HASH_WARNING)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.http = extra.get("kvpool.http")
        self.client = Client(settings.master, force_tcp=settings.force_tcp, timeout_s=settings.timeout_s)
        self.objects = PageObjects(self.client, settings.replica_num, retry_s=settings.retry_s)
        self.ns = self._namespace(local_cpu_backend.metadata)
        self._digest = self.ns.digest()
        self._prefix = f"{KEY_PREFIX}{self._digest.hex()}/"
        self._locked: collections.OrderedDict[str, list[ReadHandle]] = collections.OrderedDict()

    def _namespace(self, metadata) -> Namespace:
        shapes = ";".join("x".join(map(str, s)) for s in self.meta_shapes)
        return Namespace(
            model=metadata.model_name, weights_fingerprint=model_fingerprint(metadata.model_name),
            dtype=",".join(str(d).removeprefix("torch.") for d in self.meta_dtypes),
            page_size=metadata.chunk_size, kv_layout=f"lmcache-{self.meta_fmt.name}",
            tp_rank=metadata.worker_id, tp_size=metadata.world_size, extra=(f"shapes={shapes}",))

    # ------------------------------------------------------------ keys and headers

    def store_key(self, key: CacheEngineKey) -> str:
        """Store object name of ``key`` in this connector's namespace."""
        return self._prefix + key.to_string()

    def _header(self, key: CacheEngineKey, nbytes: int) -> PageHeader:
        """What chunk ``key`` of ``nbytes`` bytes must carry (page index 0: the chunk
        hash already chains the prefix)."""
        digest = hashlib.sha256(key.to_string().encode()).digest()
        return PageHeader(self._digest, digest, 0, nbytes // self.single_token_size, nbytes)

    def _stored_size(self, handle) -> int:
        """Payload bytes of a found chunk, or -1 when its size cannot be one of ours."""
        if not isinstance(handle, ReadHandle):
            return -1
        n = handle.size - HEADER_SIZE
        ok = 0 < n <= self.full_chunk_size_bytes and n % self.single_token_size == 0
        return n if ok else -1

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # ------------------------------------------------------------ existence and locks

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._run(self.exists_sync, key)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.objects.exists([self.store_key(key)])[0]

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        """Leading chunks of ``keys`` present now, locked until ``batched_get_non_blocking``
        of the same ``lookup_id``: each is held by a read lease and grant, so the store
        does not evict it in between (the lease ends after the master's
        --default-kv-lease-ttl at the latest)."""
        return await self._run(self._lookup_and_lock, lookup_id, keys)

    def _lookup_and_lock(self, lookup_id: str, keys: List[CacheEngineKey]) -> int:
        if not keys:
            return 0
        handles = self.objects.query([self.store_key(k) for k in keys], f"lookup of {len(keys)} chunks")
        if handles is None:
            return 0
        hit = next((i for i, h in enumerate(handles) if self._stored_size(h) < 0), len(handles))
        self._release([h for h in handles[hit:] if isinstance(h, ReadHandle)])
        self._release(self._locked.pop(lookup_id, []))
        if hit:
            self._locked[lookup_id] = handles[:hit]
            while len(self._locked) > MAX_LOCKED_LOOKUPS:
                self._release(self._locked.popitem(last=False)[1])
        return hit

    def _release(self, handles: list) -> None:
        if handles:
            try:
                self.client.release(handles)
            except KVPoolError as exc:
                log.warning("kvpool: releasing %d read grants failed: %s", len(handles), exc)

    # ------------------------------------------------------------ get

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """Each chunk read straight into a MemoryObj from the local CPU backend; None for a
        miss (absent, evicted, failed its header check, no memory to read it into)."""
        return await self._run(self._load, keys, None)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        """The leading chunks of ``keys`` that load, read under the locks that
        :meth:`batched_async_contains` took for ``lookup_id`` (queried anew without them)."""
        objs = await self._run(self._load, keys, self._locked.pop(lookup_id, None))
        n = next((i for i, o in enumerate(objs) if o is None), len(objs))
        for obj in objs[n:]:
            if obj is not None:
                obj.ref_count_down()
        return objs[:n]

    def _load(self, keys: List[CacheEngineKey], locked: Optional[list]) -> List[Optional[MemoryObj]]:
        if not keys:
            return []
        names = [self.store_key(k) for k in keys]
        held = {h.key: h for h in locked or []}
        fresh = [n for n in names if n not in held]
        queried = self.objects.query(fresh, f"query of {len(fresh)} chunks") if fresh else []
        if queried is None:
            self._release(list(held.values()))
            return [None] * len(keys)
        found = dict(zip(fresh, queried))
        handles = [held.pop(n, None) or found.get(n, ErrorCode.OBJECT_NOT_FOUND) for n in names]
        self._release(list(held.values()))  # locked by the lookup but not asked for now
        objs, parts, headers = [], [], []
        for key, handle in zip(keys, handles):
            size = self._stored_size(handle)
            obj = self._allocate() if size > 0 else None
            objs.append(obj)
            headers.append(self._header(key, max(size, 0)))
            parts.append([memoryview(obj.byte_array).cast("B")[:size]] if obj is not None else [])
        # found but not read (a size that cannot be ours, or no memory): hand the grants back
        self._release([h for h, o in zip(handles, objs) if o is None and isinstance(h, ReadHandle)])
        ok = self.objects.read(names, headers, parts,
                               [h if o is not None else ErrorCode.OBJECT_NOT_FOUND for h, o in zip(handles, objs)])
        out = []
        for obj, good, header in zip(objs, ok, headers):
            if obj is not None and not good:
                obj.ref_count_down()
            out.append(self.reshape_partial_chunk(obj, header.payload_len) if obj is not None and good else None)
        return out

    def _allocate(self) -> Optional[MemoryObj]:
        return self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)

    # ------------------------------------------------------------ put

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj):
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]):
        """Store each chunk straight from its MemoryObj (header + its bytes); a chunk that
        is already there is kept (its key fixes its bytes)."""
        await self._run(self._store, keys, memory_objs)

    def _store(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> list[bool]:
        parts = [[memoryview(o.byte_array).cast("B")[:o.get_size()]] for o in memory_objs]
        headers = [self._header(k, o.get_size()) for k, o in zip(keys, memory_objs)]
        return self.objects.write([self.store_key(k) for k in keys], headers, parts)

    # ------------------------------------------------------------ housekeeping

    def remove_sync(self, key: CacheEngineKey) -> bool:
        """Remove chunk ``key``; False when it is absent. Forced past read leases (an
        existence check takes one): readers in flight keep the old bytes until they end."""
        try:
            return self.client.batch_remove([self.store_key(key)], force=True)[0] == ErrorCode.OK
        except KVPoolError as exc:
            log.warning("kvpool: remove failed: %s", exc)
            return False

    async def list(self) -> List[str]:
        """The CacheEngineKey strings of this namespace's chunks, from the master's admin
        HTTP app (``kvpool.http``: the address its ``--http-port`` serves)."""
        if not self.http:
            raise NotImplementedError("kvpool connector list() needs extra_config 'kvpool.http: "
                                      "host:port' (the master's --http-port)")
        return await self._run(self._list)

    def _list(self) -> List[str]:
        query = urllib.parse.urlencode({"prefix": self._prefix, "limit": 100_000})
        with urllib.request.urlopen(f"http://{self.http}/keys?{query}", timeout=10) as r:
            found = json.load(r)["keys"]
        return [k[len(self._prefix):] for k in found]

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the master answers, else kvpool's error code (RPC_FAIL and the like)."""
        try:
            await self._run(self.client.ping)
            return 0
        except KVPoolError as exc:
            return int(exc.code)

    async def close(self):
        for handles in self._locked.values():
            self._release(handles)
        self._locked.clear()
        self.client.close()

    @property
    def rejects(self):
        """Chunks refused on load, by reason (kvpool.cache.codec reasons)."""
        return self.objects.rejects
