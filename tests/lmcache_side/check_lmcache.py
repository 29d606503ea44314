"""kvpool's LMCache connector against LMCache 0.5.6's own classes, on a real kvpool cluster.

Run by tests/test_integration_lmcache.py with .venv-lmcache's Python (LMCache pins
numpy<=2.2.6 and stays out of the main environment).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lmc import CHUNK, Instance, matches
from lmcache.v1.storage_backend.connector.instrumented_connector import InstrumentedRemoteConnector

from kvpool.client import Client
from kvpool.errors import ObjectHasLease
from kvpool.integrations.lmcache import KVPoolConnector, hash_seed_is_random
from kvpool.launch import Cluster

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def http_cluster():
    with Cluster(segment_size="64MiB", lease_ttl_ms=10_000, extra_master_args=["--http-port", "0"]) as c:
        yield c


@pytest.fixture
def inst(http_cluster):
    i = Instance(http_cluster.master_addr)
    i.kvpool_http = http_cluster.master.info["http_addr"]
    yield i
    i.close()
    with Client(http_cluster.master_addr) as c:
        c.remove_all(force=True)


def peer(master: str, op: str, hashes: list[int]) -> dict:
    """A second LMCache instance in its own process (importing this checkout's kvpool)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent.parent / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(HERE / "lmc.py"), master, op, *map(str, hashes)],
                         capture_output=True, text=True, timeout=300, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_plugin_is_loaded_by_lmcaches_own_loader(inst):
    assert isinstance(inst.connector, InstrumentedRemoteConnector)
    assert type(inst.kvpool) is KVPoolConnector
    assert inst.kvpool.ns.page_size == CHUNK and inst.kvpool.ns.model == "org/model"
    assert inst.run(inst.connector.ping()) == 0


def test_round_trip_between_two_instances(inst, http_cluster):
    hashes = [11, 12, 13]
    objs = [inst.chunk(h) for h in hashes[:2]] + [inst.chunk(hashes[2], tokens=5)]  # partial last chunk
    inst.run(inst.connector.batched_put([inst.key(h) for h in hashes], objs))
    got = peer(http_cluster.master_addr, "load", hashes + [99])
    assert got == {"hit": 3, "loaded": 3, "tokens": [CHUNK, CHUNK, 5], "correct": [True] * 3}
    # and back: the peer stores, this instance loads with get / batched_get
    assert peer(http_cluster.master_addr, "store", [21, 22])["stored"] == [True, True]
    one = inst.run(inst.connector.get(inst.key(21)))
    assert one is not None and matches(one, 21)
    one.ref_count_down()
    both = inst.run(inst.connector.batched_get([inst.key(22), inst.key(98)]))
    assert matches(both[0], 22) and both[1] is None
    both[0].ref_count_down()


def test_lookup_locks_chunks_until_they_are_loaded(inst, http_cluster):
    keys = [inst.key(h) for h in (31, 32)]
    inst.run(inst.connector.batched_put(keys, [inst.chunk(31), inst.chunk(32)]))
    assert inst.run(inst.connector.batched_async_contains("req-1", keys + [inst.key(33)])) == 2
    with Client(http_cluster.master_addr) as other:
        with pytest.raises(ObjectHasLease):
            other.remove(inst.kvpool.store_key(keys[0]))  # eviction and removal wait for the reader
    objs = inst.run(inst.connector.batched_get_non_blocking("req-1", keys))
    assert [matches(o, h) for o, h in zip(objs, (31, 32))] == [True, True]
    for o in objs:
        o.ref_count_down()


def test_corrupted_chunk_is_a_miss(inst, http_cluster):
    keys = [inst.key(h) for h in (41, 42)]
    inst.run(inst.connector.batched_put(keys, [inst.chunk(41), inst.chunk(42)]))
    name = inst.kvpool.store_key(keys[1])
    with Client(http_cluster.master_addr) as c:
        blob = bytearray(c.get(name))
        blob[200] ^= 1
        c.upsert(name, bytes(blob))
    objs = inst.run(inst.connector.batched_get(keys))
    assert matches(objs[0], 41) and objs[1] is None
    assert inst.kvpool.rejects["checksum"] == 1
    assert not inst.connector.exists_sync(keys[1])  # removed: the next put stores it again
    objs[0].ref_count_down()


def test_exists_remove_and_list(inst):
    key = inst.key(51)
    inst.run(inst.connector.put(key, inst.chunk(51)))
    assert inst.connector.exists_sync(key) and inst.run(inst.connector.exists(key))
    inst.kvpool.http = inst.kvpool_http
    assert inst.run(inst.connector.list()) == [key.to_string()]
    assert inst.connector.remove_sync(key) and not inst.connector.exists_sync(key)
    assert not inst.connector.remove_sync(key)


def test_builtin_hash_warns_at_start(http_cluster, caplog, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert hash_seed_is_random("builtin") and not hash_seed_is_random("sha256_cbor")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert not hash_seed_is_random("builtin")
    monkeypatch.delenv("PYTHONHASHSEED")
    with caplog.at_level(logging.WARNING, logger="kvpool.integrations.lmcache"):
        i = Instance(http_cluster.master_addr, algorithm="builtin")
    i.close()
    assert any("PYTHONHASHSEED" in r.getMessage() for r in caplog.records)


def test_missing_master_is_a_clear_error(inst):
    inst.config.extra_config.pop("kvpool.master")
    with pytest.raises(ValueError, match="kvpool.master"):
        KVPoolConnector(inst.loop, inst.cpu, inst.config)


@pytest.mark.parametrize("key, value, why", [
    ("kvpool.master", "127.0.0.1", "needs a port"), ("kvpool.replica_num", -1, "must be an integer >= 1"),
    ("kvpool.timeout_s", 0, "timeout_s must be > 0"), ("kvpool.retry_s", "nan", "must be a finite number"),
])
def test_a_setting_that_cannot_work_is_refused_at_start_naming_its_key(inst, key, value, why):
    inst.config.extra_config[key] = value
    with pytest.raises(ValueError, match=f"{key}.* {why}|{why}"):
        KVPoolConnector(inst.loop, inst.cpu, inst.config)
