"""Behaviour table of kvpool's Mooncake-compatible facade against a real master and node.

Each row runs one method of ``MooncakeDistributedStore`` in one situation and names the
value Mooncake documents for it (0 / negative ErrorCode / b'' / None / [] ...).
"""

from __future__ import annotations


import numpy as np
import pytest

from kvpool.client import Client
from kvpool.errors import ErrorCode as E
from kvpool.mooncake import BufferHandle, ReplicaStatus, ReplicateConfig, SoftPinAction
from kvpool.mooncake.store import MooncakeDistributedStore
from proc_helpers import poll_until

MIB = 1 << 20


class Mem:
    """Registered numpy buffers: ``mem.src`` (bytes 0..255 repeating) and ``mem.dst``."""

    def __init__(self, store: MooncakeDistributedStore, size: int = 4096):
        self.src = (np.arange(size) % 256).astype(np.uint8)
        self.dst = np.zeros(size, dtype=np.uint8)
        self.big = np.empty(65 * MIB, dtype=np.uint8)  # larger than the 64 MiB segment; never touched
        for a in (self.src, self.dst, self.big):
            assert store.register_buffer(a.ctypes.data, a.nbytes) == 0

    def ptr(self, name: str, offset: int = 0) -> int:
        return getattr(self, name).ctypes.data + offset


@pytest.fixture(scope="module")
def store(module_cluster):
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", module_cluster.master_addr) == 0
    yield s
    s.close()


@pytest.fixture
def mem(store):
    m = Mem(store)
    yield m
    for a in (m.src, m.dst, m.big):
        store.unregister_buffer(a.ctypes.data)
    store.remove_all(force=True)


def cfg(**fields) -> ReplicateConfig:
    c = ReplicateConfig()
    for name, value in fields.items():
        setattr(c, name, value)
    return c


@pytest.mark.parametrize("call", [
    lambda s, m: s.batch_remove("ab", force=True),
    lambda s, m: s.put_batch("ab", [b"1", b"2"]),
    lambda s, m: s.get_batch("ab"),
    lambda s, m: s.batch_is_exist("ab"),
    lambda s, m: s.batch_get_replica_desc(b"ab"),
    lambda s, m: s.batch_get_into("ab", [m.ptr("dst"), m.ptr("dst", 8)], [8, 8]),
    lambda s, m: s.get_into_ranges([m.ptr("dst")], ["ab"], [[[0], [1]]], [[[0], [0]]], [[[1], [1]]]),
], ids=["batch_remove", "put_batch", "get_batch", "batch_is_exist", "replica_desc_bytes",
        "batch_get_into", "get_into_ranges"])
def test_one_key_string_for_a_list_raises_type_error_and_touches_nothing(store, mem, call):
    """pybind refuses a str where a list of strings belongs; read as its characters it
    would act on keys "a" and "b" (a batch_remove deleting both)."""
    for key in ("a", "b"):
        assert store.put(key, key.encode()) == 0
    with pytest.raises(TypeError, match="list of str"):
        call(store, mem)
    assert store.get_batch(["a", "b"]) == [b"a", b"b"]
    store.remove_all(force=True)


def _into(s, m, key, size=4096, offset=0):
    n = s.get_into(key, m.ptr("dst", offset), size)
    return n, bytes(m.dst[offset : offset + max(n, 0)])


def _ranges(s, m):
    s.put("r1", bytes(range(40)))
    s.put("r2", b"abcdefgh")
    return s.get_into_ranges([m.ptr("dst")], [["r1", "r2", "nope"]], [[[0, 4], [8], [12]]],
                             [[[1, 30], [2], [0]]], [[[4, 3], [5], [1]]]), bytes(m.dst[:13])


# (row id, action(store, mem) -> observed, expected)
TABLE = [
    # put and its forms
    ("put_new", lambda s, m: (s.put("k", b"v"), s.get("k")), (0, b"v")),
    ("put_existing_returns_0_keeps_old", lambda s, m: (s.put("k", b"A"), s.put("k", b"BB"), s.get("k")), (0, 0, b"A")),
    ("put_empty_value", lambda s, m: (s.put("k", b""), s.get("k")), (E.INVALID_PARAMS, b"")),
    ("put_empty_key", lambda s, m: s.put("", b"v"), E.INVALID_PARAMS),
    ("put_bytes_key", lambda s, m: (s.put(b"bk", b"v"), s.get("bk"), s.get_batch([b"bk"]), s.is_exist(b"\xff")),
     (0, b"v", [b"v"], E.INVALID_PARAMS)),
    ("put_no_space", lambda s, m: s.put_from("huge", m.ptr("big"), m.big.nbytes), E.NO_AVAILABLE_HANDLE),
    ("put_larger_than_local_buffer", lambda s, m: (s.put("huge", memoryview(m.big)[: 17 * MIB]), s.is_exist("huge")),
     (E.INVALID_PARAMS, 0)),
    ("put_replica_num_0", lambda s, m: s.put("k", b"v", cfg(replica_num=0)), E.INVALID_PARAMS),
    ("put_prefer_same_node", lambda s, m: s.put("k", b"v", cfg(prefer_alloc_in_same_node=True)), E.INVALID_PARAMS),
    ("put_preferred_segments_count", lambda s, m: s.put("k", b"v", cfg(replica_num=2, preferred_segments=["a"])),
     E.INVALID_PARAMS),
    ("put_2_replicas_best_effort", lambda s, m: (s.put("k", b"v", cfg(replica_num=2)), len(s.get_replica_desc("k"))),
     (0, 1)),
    ("put_pins", lambda s, m: (s.put("k", b"v", cfg(with_hard_pin=True, soft_pin_action=SoftPinAction.ENABLE)),
                               s.get("k")), (0, b"v")),
    ("put_numpy_value", lambda s, m: (s.put("k", m.src[:10]), s.get("k")), (0, bytes(range(10)))),
    ("put_parts", lambda s, m: (s.put_parts("k", b"ab", bytearray(b"cd"), memoryview(b"ef")), s.get("k")),
     (0, b"abcdef")),
    ("put_parts_none", lambda s, m: s.put_parts("k"), E.INVALID_PARAMS),
    ("put_parts_existing", lambda s, m: (s.put("k", b"A"), s.put_parts("k", b"x", b"y"), s.get("k")), (0, 0, b"A")),
    ("put_batch", lambda s, m: (s.put_batch(["a", "b"], [b"1", b"22"]), s.get_batch(["a", "b"])), (0, [b"1", b"22"])),
    ("put_batch_duplicate_key", lambda s, m: (s.put_batch(["a", "a"], [b"1", b"2"]), s.get("a")), (0, b"1")),
    ("put_batch_existing_key", lambda s, m: (s.put("a", b"1"), s.put_batch(["a"], [b"2"]), s.get("a")), (0, 0, b"1")),
    ("put_batch_length_mismatch", lambda s, m: s.put_batch(["a", "b"], [b"1"]), E.INVALID_PARAMS),
    ("put_batch_empty_value", lambda s, m: (s.put_batch(["a", "b"], [b"1", b""]), s.get("a")), (E.INVALID_PARAMS, b"1")),
    ("put_batch_nothing", lambda s, m: s.put_batch([], []), 0),
    ("put_from", lambda s, m: (s.put_from("k", m.ptr("src", 3), 5), s.get("k")), (0, bytes([3, 4, 5, 6, 7]))),
    ("put_from_unregistered", lambda s, m: s.put_from("k", m.ptr("src", 4000), 200), E.INVALID_PARAMS),
    ("put_from_zero_size", lambda s, m: s.put_from("k", m.ptr("src"), 0), E.INVALID_PARAMS),
    ("batch_put_from", lambda s, m: (s.batch_put_from(["a", "b", "c"], [m.ptr("src"), m.ptr("src", 1), 8], [2, 2, 2]),
                                     s.get_batch(["a", "b", "c"])),
     ([0, 0, E.INVALID_PARAMS], [b"\x00\x01", b"\x01\x02", b""])),
    ("batch_put_from_length_mismatch", lambda s, m: s.batch_put_from(["a", "b"], [m.ptr("src")], [1, 1]),
     [E.INVALID_PARAMS] * 2),
    # upsert and its forms
    ("upsert_new", lambda s, m: (s.upsert("k", b"v"), s.get("k")), (0, b"v")),
    ("upsert_same_size", lambda s, m: (s.put("k", b"AA"), s.upsert("k", b"BB"), s.get("k")), (0, 0, b"BB")),
    ("upsert_other_size", lambda s, m: (s.put("k", b"A"), s.upsert("k", b"B" * 5000), len(s.get("k"))), (0, 0, 5000)),
    ("upsert_empty_value", lambda s, m: s.upsert("k", b""), E.INVALID_PARAMS),
    ("upsert_parts", lambda s, m: (s.put("k", b"A"), s.upsert_parts("k", b"x", b"y"), s.get("k")), (0, 0, b"xy")),
    ("upsert_batch", lambda s, m: (s.put("a", b"1"), s.upsert_batch(["a", "b"], [b"9", b"8"]), s.get_batch(["a", "b"])),
     (0, 0, [b"9", b"8"])),
    ("upsert_from", lambda s, m: (s.put("k", b"A"), s.upsert_from("k", m.ptr("src", 1), 2), s.get("k")),
     (0, 0, b"\x01\x02")),
    ("batch_upsert_from", lambda s, m: (s.put("a", b"A"), s.batch_upsert_from(["a"], [m.ptr("src", 2)], [1]), s.get("a")),
     (0, [0], b"\x02")),
    # reads
    ("get_miss", lambda s, m: s.get("nope"), b""),
    ("get_batch_with_miss", lambda s, m: (s.put("a", b"1"), s.get_batch(["a", "nope", ""])), (0, [b"1", b"", b""])),
    ("get_batch_duplicates", lambda s, m: (s.put("a", b"1"), s.get_batch(["a", "a"])), (0, [b"1", b"1"])),
    ("get_buffer", lambda s, m: (s.put("k", b"xyz"), bytes(s.get_buffer("k")), s.get_buffer("k").size()), (0, b"xyz", 3)),
    ("get_buffer_miss", lambda s, m: s.get_buffer("nope"), None),
    ("batch_get_buffer", lambda s, m: (s.put("a", b"1"), [None if b is None else bytes(b)
                                                          for b in s.batch_get_buffer(["a", "nope"])]),
     (0, [b"1", None])),
    ("get_into", lambda s, m: (s.put("k", b"hello"), _into(s, m, "k")), (0, (5, b"hello"))),
    ("get_into_miss", lambda s, m: _into(s, m, "nope"), (E.OBJECT_NOT_FOUND, b"")),
    ("get_into_too_small", lambda s, m: (s.put("k", b"hello"), s.get_into("k", m.ptr("dst"), 4)), (0, E.INVALID_PARAMS)),
    ("get_into_past_registered_end", lambda s, m: (s.put("k", b"hello"), s.get_into("k", m.ptr("dst", 4094), 5)),
     (0, E.INVALID_PARAMS)),
    ("get_into_unregistered", lambda s, m: (s.put("k", b"hello"), s.get_into("k", 4096, 5)), (0, E.INVALID_PARAMS)),
    ("batch_get_into", lambda s, m: (s.put("a", b"12"), s.batch_get_into(["a", "nope", "a"],
                                     [m.ptr("dst"), m.ptr("dst", 10), m.ptr("dst", 20)], [10, 10, 1]), bytes(m.dst[:2])),
     (0, [2, E.OBJECT_NOT_FOUND, E.INVALID_PARAMS], b"12")),
    ("batch_get_into_same_key_twice", lambda s, m: (s.put("a", b"12"), s.batch_get_into(["a", "a"],
                                                    [m.ptr("dst"), m.ptr("dst", 8)], [8, 8]), bytes(m.dst[8:10])),
     (0, [2, 2], b"12")),
    ("get_into_ranges", _ranges,
     ([[[4, 3], [5], [E.OBJECT_NOT_FOUND]]], bytes([1, 2, 3, 4, 30, 31, 32, 0]) + b"cdefg")),
    ("get_into_ranges_out_of_object", lambda s, m: (s.put("r", b"abc"), s.get_into_ranges(
        [m.ptr("dst")], [["r"]], [[[0]]], [[[2]]], [[[5]]])), (0, [[[E.INVALID_PARAMS]]])),
    ("get_into_ranges_shape_mismatch", lambda s, m: s.get_into_ranges([m.ptr("dst")], [["r"]], [[[0]]], [], []),
     [[[E.INVALID_PARAMS]]]),
    # existence, size, descriptors
    ("is_exist", lambda s, m: (s.put("k", b"v"), s.is_exist("k"), s.is_exist("nope"), s.is_exist("")),
     (0, 1, 0, E.INVALID_PARAMS)),
    ("batch_is_exist", lambda s, m: (s.put("k", b"v"), s.batch_is_exist(["k", "nope", ""])),
     (0, [1, 0, E.INVALID_PARAMS])),
    ("get_size", lambda s, m: (s.put("k", b"v" * 300), s.get_size("k"), s.get_size("nope")),
     (0, 300, E.OBJECT_NOT_FOUND)),
    ("get_replica_desc", lambda s, m: (s.put("k", b"v" * 7), [(d.status, d.is_memory_replica(),
                                       d.get_memory_descriptor().buffer_descriptor.size) for d in s.get_replica_desc("k")]),
     (0, [(ReplicaStatus.COMPLETE, True, 7)])),
    ("get_replica_desc_miss", lambda s, m: s.get_replica_desc("nope"), []),
    ("batch_get_replica_desc", lambda s, m: (s.put("k", b"v"), sorted(s.batch_get_replica_desc(["k", "nope"]))),
     (0, ["k"])),
    # removal and leases
    ("remove", lambda s, m: (s.put("k", b"v"), s.remove("k"), s.get("k")), (0, 0, b"")),
    ("remove_miss", lambda s, m: s.remove("nope"), E.OBJECT_NOT_FOUND),
    ("remove_leased", lambda s, m: (s.put("k", b"v"), s.get("k"), s.remove("k"), s.remove("k", force=True)),
     (0, b"v", E.OBJECT_HAS_LEASE, 0)),
    ("batch_remove", lambda s, m: (s.put("a", b"1"), s.batch_remove(["a", "nope", ""])),
     (0, [0, E.OBJECT_NOT_FOUND, E.INVALID_PARAMS])),
    ("remove_all_skips_leased", lambda s, m: (s.put_batch(["a", "b"], [b"1", b"2"]), s.get("a"), s.remove_all(),
                                              s.get_batch(["a", "b"]), s.remove_all(force=True)),
     (0, b"1", 1, [b"1", b""], 1)),
    ("remove_by_regex", lambda s, m: (s.put_batch(["x/1", "x/2", "y/1"], [b"1", b"2", b"3"]), s.remove_by_regex("^x/"),
                                      s.get_batch(["x/1", "y/1"])), (0, 2, [b"", b"3"])),
    ("remove_by_regex_bad_pattern", lambda s, m: s.remove_by_regex("("), E.INVALID_PARAMS),
    # registration, identity, health
    ("register_buffer_null", lambda s, m: s.register_buffer(0, 10), E.INVALID_PARAMS),
    ("register_buffer_zero_size", lambda s, m: s.register_buffer(m.ptr("dst"), 0), E.INVALID_PARAMS),
    ("unregister_buffer", lambda s, m: (s.unregister_buffer(m.ptr("src")), s.put_from("k", m.ptr("src"), 4)),
     (0, E.INVALID_PARAMS)),
    ("unregister_buffer_unknown", lambda s, m: s.unregister_buffer(12345), E.INVALID_PARAMS),
    ("get_hostname_pure_client", lambda s, m: s.get_hostname().partition(":")[::2] == ("localhost", s.get_hostname()[10:])
     and s.get_hostname()[10:].isdigit(), True),
    ("health_check", lambda s, m: s.health_check(), 0),
]


@pytest.mark.parametrize("action,expected", [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_behaviour_table(store, mem, action, expected):
    assert action(store, mem) == expected


def test_table_covers_every_method():
    """Every public method of the facade has at least one row (by name) in TABLE."""
    rows = " ".join(row[0] for row in TABLE) + " setup close"
    methods = [m for m in dir(MooncakeDistributedStore) if not m.startswith("_")]
    assert [m for m in methods if m not in rows] == []


def test_k01_put_on_existing_key_returns_0_and_keeps_value(store, mem):
    assert store.put("k01", b"A") == 0
    assert store.put("k01", b"B") == 0
    assert store.get("k01") == b"A"
    assert store.upsert("k01", b"B") == 0
    assert store.get("k01") == b"B"


def test_k09_empty_value_refused_and_miss_distinguishable(store, mem):
    assert store.put("k09", b"") == E.INVALID_PARAMS
    assert store.is_exist("k09") == 0
    assert store.get("k09") == b"" and store.get_size("k09") == E.OBJECT_NOT_FOUND
    assert store.put("", b"x") == E.INVALID_PARAMS
    assert store.put("k09", b"x") == 0 and store.get_size("k09") == 1


@pytest.mark.parametrize("call", [
    lambda s: s.put(key="k", val=b"v"),
    lambda s: s.get(name="k"),
    lambda s: s.put_from("k", buffer=1, size=1),
    lambda s: s.get_into("k", buffer_ptr=1, length=1),
    lambda s: s.remove("k", forced=True),
    lambda s: s.remove_by_regex(pattern="x"),
    lambda s: s.batch_get_into(keys=["k"], ptrs=[1], sizes=[1]),
    lambda s: s.setup(hostname="localhost"),
    lambda s: s.put_parts("k", b"x", cfg=None),
    lambda s: s.register_buffer(ptr=1, size=1),
], ids=["put", "get", "put_from", "get_into", "remove", "remove_by_regex", "batch_get_into", "setup",
        "put_parts", "register_buffer"])
def test_wrong_keyword_raises_type_error(store, call):
    with pytest.raises(TypeError):
        call(store)


@pytest.mark.parametrize("call", [
    lambda s: s.put(1, b"v"),
    lambda s: s.put("k", 42),
    lambda s: s.get(None),
    lambda s: s.get_into("k", "0x10", 4),
    lambda s: s.put("k", b"v", config={"replica_num": 1}),
    lambda s: s.batch_is_exist([3.5]),
], ids=["key_int", "value_int", "key_none", "ptr_str", "config_dict", "key_float"])
def test_wrong_argument_type_raises_type_error(store, call):
    with pytest.raises(TypeError):
        call(store)


def test_replicate_config_fields():
    c = ReplicateConfig()
    assert (c.replica_num, c.with_hard_pin, c.soft_pin_action, c.preferred_segment) == (1, False, SoftPinAction.PRESERVE, "")
    c.with_soft_pin = True
    assert c.soft_pin_action == SoftPinAction.ENABLE and "replica_num: 1" in str(c)
    with pytest.raises(AttributeError):
        c.replica_count = 2


def test_before_setup_and_after_close(module_cluster):
    s = MooncakeDistributedStore()
    assert (s.health_check(), s.get_hostname(), s.put("k", b"v"), s.get("k"), s.get_buffer("k")) == (1, "", -600, b"", None)
    assert (s.is_exist("k"), s.get_size("k"), s.remove_all(), s.register_buffer(8, 8)) == (-600, -600, -600, -600)
    assert s.get_batch(["a", "b"]) == [b"", b""] and s.batch_put_from(["a"], [8], [1]) == [-600]
    assert s.setup("localhost", "meta", 0, 16 * MIB, "tcp", "", module_cluster.master_addr) == 0
    assert s.health_check() == 0
    assert s.close() == 0 and s.close() == 0
    assert (s.health_check(), s.put("k", b"v"), s.get("k")) == (1, -600, b"")


def test_setup_forms_and_bad_parameters(module_cluster):
    addr = module_cluster.master_addr
    good = {"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE", "master_server_addr": addr,
            "global_segment_size": "0", "local_buffer_size": "16MB"}
    cases = [
        (lambda s: s.setup(good), 0),
        (lambda s: s.setup(config=good), 0),
        (lambda s: s.setup(local_hostname="localhost", metadata_server="m", global_segment_size=0,
                           local_buffer_size=16 * MIB, protocol="tcp", rdma_devices="", master_server_addr=addr), 0),
        (lambda s: s.setup({**good, "local_buffer_size": "lots"}), -600),
        (lambda s: s.setup({**good, "global_segment_size": "512"}), -600),
        (lambda s: s.setup({**good, "local_hostname": ""}), -600),
        (lambda s: s.setup({**good, "enable_ssd_offload": "true"}), -600),
        (lambda s: s.setup({**good, "master_server_addr": "nohostport"}), -600),
        (lambda s: s.setup("localhost", "m", 0, 16 * MIB, "ucx", "", addr), -600),
        (lambda s: s.setup("localhost", "m", 0, 16 * MIB, "tcp", "", addr, engine=object()), -600),
        (lambda s: s.setup("localhost", "m", 0, 16 * MIB, "tcp", "", _closed_port_addr()), E.RPC_FAIL),
    ]
    for i, (call, expected) in enumerate(cases):
        s = MooncakeDistributedStore()
        assert call(s) == expected, f"case {i}"
        s.close()


def _closed_port_addr() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_contributed_segment_serves_others_and_goes_at_close(module_cluster, store, mem):
    """setup(global_segment_size > 0) mounts a segment this store owns; other clients
    write to and read from it; close() unmounts it and its objects become not found."""
    owner = MooncakeDistributedStore()
    assert owner.setup({"local_hostname": "localhost", "metadata_server": "m", "global_segment_size": "4MB",
                        "master_server_addr": module_cluster.master_addr}) == 0
    host = owner.get_hostname()
    assert host.startswith("localhost:") and owner.health_check() == 0
    assert store.put("on_owner", b"z" * 3000, cfg(preferred_segment=host)) == 0
    [desc] = store.get_replica_desc("on_owner")
    assert desc.get_memory_descriptor().buffer_descriptor.transport_endpoint == host.replace("localhost", "127.0.0.1")
    assert owner.get("on_owner") == b"z" * 3000
    assert owner.close() == 0
    assert (store.get("on_owner"), store.is_exist("on_owner")) == (b"", 0)


def test_replica_desc_hands_its_read_grants_back(module_cluster, store, mem):
    """Descriptors move no bytes: their read grants must not stay open until the lease
    ends (an open grant keeps an upserted-over version's buffer allocated)."""
    assert store.put_batch(["d1", "d2"], [b"1", b"2"]) == 0
    with Client(module_cluster.master_addr) as admin:
        before = admin.stats().open_grants
        assert len(store.get_replica_desc("d1")) == 1
        assert sorted(store.batch_get_replica_desc(["d1", "d2", "nope"])) == ["d1", "d2"]
        # ReadDone is sent by the client's background flusher
        poll_until(lambda: admin.stats().open_grants == before, 10)
        assert admin.stats().open_grants == before


def test_buffer_handle_protocol(store, mem):
    assert store.put("bh", bytes(range(16))) == 0
    h = store.get_buffer("bh")
    assert isinstance(h, BufferHandle) and len(h) == h.size() == 16
    arr = np.frombuffer(h, dtype=np.uint8)
    assert arr.tolist() == list(range(16))
    assert h.ptr() == arr.ctypes.data


@pytest.mark.cluster(segment_size="64MiB", lease_ttl_ms=1)
def test_lease_expired_before_bytes_arrive_hands_out_nothing(cluster):
    """With a 1 ms lease no 32 MiB copy can finish in time: every read path reports the
    expiry (-707) or its miss value, never bytes (field case K05 through the facade)."""
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "m", 0, 64 * MIB, "tcp", "", cluster.master_addr) == 0
    value = np.full(32 * MIB, 7, dtype=np.uint8)
    dst = np.zeros(32 * MIB, dtype=np.uint8)
    assert s.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    assert s.put("big", value) == 0
    assert s.get_into("big", dst.ctypes.data, dst.nbytes) == E.LEASE_EXPIRED
    assert s.batch_get_into(["big"], [dst.ctypes.data], [dst.nbytes]) == [E.LEASE_EXPIRED]
    assert s.get_into_ranges([dst.ctypes.data], [["big"]], [[[0]]], [[[0]]], [[[dst.nbytes]]]) == [[[E.LEASE_EXPIRED]]]
    assert (s.get("big"), s.get_batch(["big"]), s.get_buffer("big"), s.batch_get_buffer(["big"])) == (
        b"", [b""], None, [None])
    assert s.get_size("big") == 32 * MIB  # moves no bytes, so nothing can arrive late
    s.close()


def test_one_store_shared_by_threads(store, mem):
    """4 threads x 25 rounds of put -> get -> get_into -> remove on one store, each byte checked."""
    import threading

    errors = []

    def work(t: int):
        dst = np.zeros(64 << 10, dtype=np.uint8)
        assert store.register_buffer(dst.ctypes.data, dst.nbytes) == 0
        for i in range(25):
            key, value = f"t{t}/{i}", np.full(64 << 10, (t * 31 + i) % 256, dtype=np.uint8).tobytes()
            got = (store.put(key, value), store.get(key) == value,
                   store.get_into(key, dst.ctypes.data, dst.nbytes), dst.tobytes() == value,
                   store.remove(key, force=True))
            if got != (0, True, len(value), True, 0):
                errors.append((key, got))
        assert store.unregister_buffer(dst.ctypes.data) == 0

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert errors == [] and not any(th.is_alive() for th in threads)


# ------------------------------------------------------------ differences a porting user would meet


def _pure_store(addr: str, local_hostname: str = "localhost", local_buffer_size: int = 16 * MIB):
    s = MooncakeDistributedStore()
    rc = s.setup(local_hostname, "P2PHANDSHAKE", 0, local_buffer_size, "tcp", "", addr)
    return s, rc


def test_k08_get_hostname_is_host_and_a_port_each_store_holds(module_cluster):
    """Without a port in local_hostname Mooncake returns "host:port" with a port it
    reserved; two stores on one host get distinct identities, and the port is really
    held (binding it again fails) until close."""
    import socket

    a, rc_a = _pure_store(module_cluster.master_addr)
    b, rc_b = _pure_store(module_cluster.master_addr)
    assert (rc_a, rc_b) == (0, 0)
    host_a, _, port_a = a.get_hostname().partition(":")
    assert host_a == "localhost" and port_a.isdigit() and a.get_hostname() != b.get_hostname()
    with socket.socket() as probe, pytest.raises(OSError):
        probe.bind(("127.0.0.1", int(port_a)))
    # an explicit port is the identity; taken already, setup fails clearly
    c, rc_c = _pure_store(module_cluster.master_addr, f"localhost:{port_a}")
    assert rc_c == E.INVALID_PARAMS and c.get_hostname() == ""
    assert a.close() == 0 and a.get_hostname() == ""
    d, rc_d = _pure_store(module_cluster.master_addr, f"localhost:{port_a}")
    assert rc_d == 0 and d.get_hostname() == f"localhost:{port_a}"
    for s in (b, d):
        s.close()


@pytest.mark.parametrize("field,value", [
    ("soft_pin_ttl_ms", "abc"), ("soft_pin_ttl_ms", -1), ("soft_pin_ttl_ms", 1.5),
    ("replica_num", "2"), ("replica_num", None), ("replica_num", -1), ("replica_num", 2.0),
    ("with_soft_pin", "yes"), ("with_hard_pin", "yes"), ("prefer_alloc_in_same_node", []),
    ("preferred_segment", None), ("preferred_segment", 5), ("preferred_segments", "seg"),
    ("preferred_segments", [1]), ("soft_pin_action", 1), ("soft_pin_action", "ENABLE"),
])
def test_replicate_config_rejects_wrong_types_like_pybind(field, value):
    c = ReplicateConfig()
    with pytest.raises(TypeError, match=field):
        setattr(c, field, value)


def test_replicate_config_converts_like_pybind():
    """None resets the optional TTL; numpy ints and bools convert; lists read back as
    copies (pybind converts a std::vector on every read)."""
    c = ReplicateConfig()
    c.soft_pin_ttl_ms = 500
    assert c.soft_pin_ttl_ms == 500 and "soft_pin_ttl_ms: 500" in str(c)
    c.soft_pin_ttl_ms = None
    assert c.soft_pin_ttl_ms is None and "soft_pin_ttl_ms: default" in str(c)
    c.replica_num, c.with_hard_pin, c.prefer_alloc_in_same_node = np.int64(2), 1, None
    assert (c.replica_num, type(c.replica_num), c.with_hard_pin, c.prefer_alloc_in_same_node) == (2, int, True, False)
    c.preferred_segments = ("a", b"b")
    c.preferred_segments.append("lost")
    assert c.preferred_segments == ["a", "b"]


def test_local_buffer_size_0_fails_staged_puts_and_gets_as_in_mooncake(module_cluster, caplog):
    """Mooncake copies put values and get results through the local buffer: with none,
    put/get fail (-600 / miss), while the zero-copy forms on registered memory work."""
    s, rc = _pure_store(module_cluster.master_addr, local_buffer_size=0)
    assert rc == 0
    with caplog.at_level("ERROR", logger="kvpool.mooncake"):
        codes = (s.put("lb", b"v"), s.upsert("lb", b"v"), s.put_parts("lb", b"v"), s.put_batch(["lb"], [b"v"]))
    assert codes == (E.INVALID_PARAMS,) * 4
    assert any("local buffer" in r.getMessage() for r in caplog.records)
    src = np.frombuffer(b"zero-copy", dtype=np.uint8).copy()
    dst = np.zeros(64, dtype=np.uint8)
    for a in (src, dst):
        assert s.register_buffer(a.ctypes.data, a.nbytes) == 0
    assert s.put_from("lb", src.ctypes.data, src.nbytes) == 0
    assert s.get_into("lb", dst.ctypes.data, dst.nbytes) == src.nbytes and bytes(dst[:9]) == b"zero-copy"
    assert (s.get("lb"), s.get_buffer("lb"), s.get_batch(["lb"]), s.batch_get_buffer(["lb"])) == (b"", None, [b""], [None])
    assert s.is_exist("lb") == 1 and s.remove("lb", force=True) == 0
    s.close()


def test_local_buffer_limits_a_batch_read_in_order(module_cluster):
    s, rc = _pure_store(module_cluster.master_addr, local_buffer_size=4096)
    assert rc == 0
    assert [s.put(k, v) for k, v in (("a", b"1" * 3000), ("b", b"2" * 2000), ("c", b"3" * 1000))] == [0, 0, 0]
    assert s.get_batch(["a", "b", "c"]) == [b"1" * 3000, b"", b"3" * 1000]
    assert s.put_batch(["d", "e"], [b"x" * 3000, b"y" * 2000]) == E.INVALID_PARAMS
    assert s.batch_is_exist(["d", "e"]) == [0, 0]
    s.remove_all(force=True)
    s.close()


def test_put_takes_what_the_native_client_takes(store, mem):
    """Torch tensors (bf16 included), numpy arrays and bytes-likes, through every value form."""
    torch = pytest.importorskip("torch")
    t = torch.arange(8, dtype=torch.bfloat16)
    raw = t.view(torch.uint8).numpy().tobytes()
    assert store.put("t1", t) == 0 and store.get("t1") == raw
    assert store.upsert("t1", t * 2) == 0 and store.get("t1") == (t * 2).view(torch.uint8).numpy().tobytes()
    assert store.put_parts("t2", t, b"!") == 0 and store.get("t2") == raw + b"!"
    assert store.put_batch(["t3", "t4"], [t, np.arange(3, dtype=np.int16)]) == 0
    assert store.get_batch(["t3", "t4"]) == [raw, np.arange(3, dtype=np.int16).tobytes()]
    assert store.put("t5", t[::2]) == E.INVALID_PARAMS  # not contiguous: refused, as by the native put
    # zero-copy forms on a tensor's memory, as Mooncake users write them
    dst = torch.zeros(16, dtype=torch.uint8)
    assert store.register_buffer(dst.data_ptr(), dst.numel()) == 0
    assert store.get_into("t1", dst.data_ptr(), dst.numel()) == 16 and bytes(dst.numpy()) == store.get("t1")
    assert store.put_from("t6", dst.data_ptr(), 4) == 0 and store.get("t6") == bytes(dst.numpy()[:4])
    assert store.unregister_buffer(dst.data_ptr()) == 0


def test_too_small_buffers_log_both_sizes_on_every_into_path(store, mem, caplog):
    assert store.put("small", b"x" * 100) == 0
    with caplog.at_level("ERROR", logger="kvpool.mooncake"):
        assert store.get_into("small", mem.ptr("dst"), 40) == E.INVALID_PARAMS
        assert store.batch_get_into(["small", "nope"], [mem.ptr("dst"), mem.ptr("dst", 100)], [30, 8]) == [
            E.INVALID_PARAMS, E.OBJECT_NOT_FOUND]
    logged = [r.getMessage() for r in caplog.records]
    assert any("100 bytes" in m and "40 bytes" in m for m in logged)
    assert any("100 bytes" in m and "30 bytes" in m for m in logged)
