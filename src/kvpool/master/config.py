"""The master's tunables, with Mooncake's flag names and defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MasterConfig:
    """Settings of one master.

    default_kv_lease_ttl_ms: read lease granted by get/exist/get_size (ms).
    eviction_high_watermark_ratio: used/total above which eviction runs (0..1).
    eviction_ratio: share of evictable objects one eviction pass frees (0..1).
    client_ttl_s: a node/client without a heartbeat for this long loses its segments.
    put_start_discard_timeout_s: a PutStart older than this may be taken over.
    put_start_release_timeout_s: a dead put's buffers return to the pool after this.
    soft_pin_ttl_ms: how long a soft pin protects an object unless the put names its own
        TTL (fixed at PutEnd; reads do not extend it).
    max_soft_pin_ttl_ms: the largest per-put soft-pin TTL accepted (Mooncake: 24 h).
    allocation_strategy: random | free_ratio_first | local_first.
    max_replicas: upper bound on replica_num accepted per put.
    alloc_lease_ttl_s: how long an allocation lease may be allocated from and committed
        into (seconds); its uncommitted space is then held for put_start_release_timeout_s
        more (the writer may still be writing) unless it was returned.
    alloc_lease_size: the most bytes one allocation lease covers (also at most 1/16 of
        its segment); 0 turns allocation leases off (every AllocLease is refused).
    max_leases_per_owner: open allocation leases one client may hold.
    """

    default_kv_lease_ttl_ms: int = 10_000
    eviction_high_watermark_ratio: float = 0.90
    eviction_ratio: float = 0.05
    client_ttl_s: float = 10.0
    put_start_discard_timeout_s: float = 30.0
    put_start_release_timeout_s: float = 600.0
    soft_pin_ttl_ms: int = 30 * 60 * 1000
    max_soft_pin_ttl_ms: int = 24 * 60 * 60 * 1000
    allocation_strategy: str = "random"
    max_replicas: int = 16
    alloc_lease_ttl_s: float = 10.0
    alloc_lease_size: int = 64 << 20
    max_leases_per_owner: int = 4
