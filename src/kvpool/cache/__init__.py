"""Tiered prefix cache: namespaces, page keys, page codec, radix tree, tiers and policies.

Public API (see src/kvpool/README.md, "Contract: kvpool.cache"). Modules, bottom up:
namespace, keys, codec (page bytes), tree (radix tree, Tier), pool (L1), host_pool (L2,
shared memory), l3 (the L3Backend protocol, StoreBackend) and disk (DiskBackend),
pagestore (pages <-> L3 objects), policies, prefetch, worker, placement (L1/L2 slots and
eviction), l3_tier (the L3 tier: presence, checked reads, backups, prefetch reads), match,
prefix_cache (the cache), ranks, compat (SGLang/vLLM hashes), prometheus.
"""

from kvpool.cache.codec import PageFormatError, PageHeader, decode_page, encode_page
from kvpool.cache.disk import DiskBackend
from kvpool.cache.keys import PageChain, max_reusable_pages, page_chain, page_keys, store_key
from kvpool.cache.l3 import L3Backend, StoreBackend
from kvpool.cache.metrics import CacheMetrics
from kvpool.cache.namespace import Namespace
from kvpool.cache.policies import PrefetchConfig
from kvpool.cache.prefetch import PrefetchHandle
from kvpool.cache.prefix_cache import Match, PrefixCache
from kvpool.cache.tree import Tier

__all__ = [
    "CacheMetrics", "DiskBackend", "L3Backend", "Match", "Namespace", "PageFormatError",
    "PageChain", "PageHeader", "PrefetchConfig", "PrefetchHandle", "PrefixCache", "StoreBackend", "Tier",
    "decode_page", "encode_page", "max_reusable_pages", "page_chain", "page_keys", "store_key",
]
