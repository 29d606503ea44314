"""``MooncakeDistributedStore``: Mooncake Store's Python API over :class:`kvpool.client.Client`.

Code written against ``from mooncake.store import MooncakeDistributedStore`` runs on
kvpool with ``from kvpool.mooncake.store import MooncakeDistributedStore``. Method names,
parameter names (a wrong keyword raises TypeError) and return conventions follow
Mooncake's pybind module (mooncake-integration/store/store_py.cpp) and its RealClient:

- status methods return 0 or a negative :class:`~kvpool.errors.ErrorCode` integer
  (-600 bad parameters or not set up, -200 no space, -704 not found, -706 leased, ...);
- a put of an existing key returns 0 and keeps the stored value (Mooncake's Put
  treats OBJECT_ALREADY_EXISTS as success; field case K01) - ``upsert`` replaces;
- a miss is ``b''`` from ``get``/``get_batch``, None from ``get_buffer``, ``[]`` from
  ``get_replica_desc``, 0 from ``is_exist`` and a negative code from the rest;
- empty values and empty keys are refused with -600 (K09).

kvpool's native :class:`~kvpool.client.Client` says what happened with typed exceptions;
this facade only translates. The class stays one file of ~40 short methods because it
mirrors Mooncake's one pybind class method for method; argument conversion lives in
``convert``, setup values and the store's identity in ``setup_args``, the ranged read in
``ranges``, value types in ``types``. Where only a code comes back, the reason is still logged:
a request the master refuses (-600, e.g. from a client of another release) by logger
``kvpool.rpc`` at WARNING, once per distinct message. Intended differences are listed in docs/mooncake-compat.md.
"""

from __future__ import annotations

import logging
import weakref
from typing import Sequence

from kvpool.client import Client, ReadHandle
from kvpool.errors import BufferOverflow, ErrorCode, InvalidParams, KVPoolError, ObjectExists, UserError
from kvpool.mooncake import ranges, setup_args
from kvpool.mooncake.buffers import RegisteredBuffers
from kvpool.mooncake.convert import INVALID, OK, as_int, as_key, as_keys, put_code, read_code, value_view
from kvpool.mooncake.types import (
    BufferHandle, Descriptor, MemoryDescriptor, ReplicaDescriptor, ReplicateConfig, SoftPinAction,
)

log = logging.getLogger("kvpool.mooncake")

# SoftPinAction -> the native client's soft_pin argument (None keeps an existing pin)
_SOFT_PIN = {SoftPinAction.PRESERVE: None, SoftPinAction.ENABLE: True, SoftPinAction.DISABLE: False}
HC_HEALTHY, HC_NOT_INITIALIZED, HC_MASTER_UNREACHABLE = 0, 1, 2  # Mooncake's health_check codes


def _descriptor(desc) -> ReplicaDescriptor:
    buf = Descriptor(desc.length, desc.offset, desc.segment.data_addr, desc.segment.name)
    return ReplicaDescriptor(MemoryDescriptor(buf))


class MooncakeDistributedStore:
    """Mooncake's store client API on a kvpool cluster. Create, ``setup(...)``, use,
    ``close()``. Thread-safe once set up (the underlying Client is)."""

    def __init__(self):
        self._client: Client | None = None
        self._args: setup_args.SetupArgs | None = None
        self._buffers = RegisteredBuffers()
        self._finalizer: weakref.finalize | None = None
        self._hostname = ""  # "host:port" with a port this store holds bound (K08)
        self._segment_names: dict[str, str] = {}  # data server "host:port" or name -> segment name

    # ------------------------------------------------------------ lifecycle

    def setup(self, local_hostname=None, metadata_server=None,
              global_segment_size=setup_args.DEFAULT_SEGMENT_SIZE,
              local_buffer_size=setup_args.DEFAULT_LOCAL_BUFFER_SIZE, protocol="tcp", rdma_devices="",
              master_server_addr=setup_args.DEFAULT_MASTER, engine=None, enable_ssd_offload=False,
              ssd_offload_path="", tenant_id="default", enable_client_http_server=False,
              client_http_port=9300, *, config: dict | None = None) -> int:
        """Connect to the master at ``master_server_addr``; returns 0 or an error code.

        Positional form as Mooncake's; or one dict (``setup({...})`` / ``setup(config={...})``)
        whose values may be text, sizes in binary units ("16MB" = 16 MiB).
        ``global_segment_size`` > 0: this store hosts a shared-memory segment of that
        many bytes (its own data server thread) that the cluster allocates from; close()
        unmounts it and the objects on it become not found. 0: a pure client.
        ``metadata_server``, ``rdma_devices``, ``tenant_id``, ``client_http_port`` and
        ``ssd_offload_path`` are accepted and unused; ``engine``,
        ``enable_ssd_offload`` and ``enable_client_http_server`` are refused (-600).
        ``local_buffer_size`` bounds the values put and got as Python objects, as
        Mooncake's staging buffer does (see :meth:`_staged`). The store's identity
        (:meth:`get_hostname`) takes a port it holds bound until close (K08).
        Returns -600 for bad parameters or a port in ``local_hostname`` that is taken,
        -900 when the master cannot be reached.
        """
        as_dict = config if config is not None else local_hostname if isinstance(local_hostname, dict) else None
        if as_dict is not None and not isinstance(as_dict, dict):
            raise TypeError(f"config must be a dict, not {type(as_dict).__name__}")
        try:
            if as_dict is not None:
                args = setup_args.from_dict(as_dict)
            else:
                args = setup_args.build(
                    local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol,
                    master_server_addr, {"engine": engine, "enable_ssd_offload": enable_ssd_offload,
                                         "enable_client_http_server": enable_client_http_server})
        except InvalidParams as exc:
            log.error("setup refused: %s", exc)
            return INVALID
        if args.protocol == "rdma":
            log.warning("protocol 'rdma': kvpool moves bytes through shared memory or TCP")
        self.close()
        try:
            client = Client(args.master_server_addr, global_segment_size=args.global_segment_size,
                            segment_host=args.bind_host)
        except KVPoolError as exc:
            log.error("setup failed: %s", exc)
            return int(exc.code)
        except OSError as exc:  # the segment's shared memory could not be created
            log.error("setup failed: %s", exc)
            return int(ErrorCode.INTERNAL_ERROR)
        try:
            self._hostname, reservation = setup_args.identity(args, client)
        except UserError as exc:  # an explicit port that is taken, or a host that is not local
            client.close()
            log.error("setup failed: %s", exc)
            return INVALID
        self._client, self._args = client, args
        self._finalizer = weakref.finalize(self, setup_args.release, client, reservation)  # at exit if not closed
        return OK

    def close(self) -> int:
        """Close the connection; a hosted segment is unmounted (its objects are gone).
        Registered buffers are forgotten. Returns 0; safe to call twice."""
        if self._finalizer is not None:
            self._finalizer()
        self._client = self._finalizer = None
        self._hostname = ""
        self._buffers.clear()
        self._segment_names.clear()
        return OK

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 master unreachable (Mooncake's codes)."""
        client = self._client
        if client is None:
            return HC_NOT_INITIALIZED
        try:
            client.ping()
        except KVPoolError:
            return HC_MASTER_UNREACHABLE
        return HC_HEALTHY

    def get_hostname(self) -> str:
        """This store's identity "host:port" ("" before setup or after close), as
        Mooncake's: the host of ``local_hostname`` and a port this store holds bound
        until close: its segment's data server port, or for a pure client the port
        ``local_hostname`` named, else a free one it picked. Usable as
        ``ReplicateConfig.preferred_segment``."""
        return self._hostname

    # ------------------------------------------------------------ put forms

    def _put_options(self, client: Client, config) -> tuple[int, dict, str]:
        """(replica_num, pin kwargs, preferred segment name) from a ReplicateConfig.
        Raises InvalidParams (the native client also refuses a soft-pin TTL without
        ENABLE, and the master one above its maximum), TypeError."""
        config = ReplicateConfig() if config is None else config
        if not isinstance(config, ReplicateConfig):
            raise TypeError(f"config must be ReplicateConfig, not {type(config).__name__}")
        n = config.replica_num  # the config's fields are type-checked when set
        if n < 1:
            raise InvalidParams(f"replica_num must be >= 1, got {n}")
        if config.prefer_alloc_in_same_node:
            raise InvalidParams("prefer_alloc_in_same_node is not supported by put (as in Mooncake)")
        if config.preferred_segments and len(config.preferred_segments) != n:
            raise InvalidParams("preferred_segments must name one segment per replica")
        pins = {"soft_pin": _SOFT_PIN[config.soft_pin_action], "hard_pin": config.with_hard_pin,
                "soft_pin_ttl_ms": config.soft_pin_ttl_ms}
        preferred = config.preferred_segments[0] if config.preferred_segments else config.preferred_segment
        return n, pins, self._segment_name(client, preferred)

    def _segment_name(self, client: Client, preferred: str) -> str:
        """Segment name for a preferred "host:port" (a data server address) or name.

        Names are cached per address and looked up again (one stats RPC) only for an
        address not seen yet; a stale name merely loses the preference (the master
        ignores a name it does not know)."""
        if not preferred:
            return ""
        addr = preferred.replace("localhost:", "127.0.0.1:", 1)
        if addr not in self._segment_names:
            for seg in client.stats().segments:
                self._segment_names[seg.data_addr] = self._segment_names[seg.name] = seg.name
        return self._segment_names.get(addr, preferred)

    def _staged(self, sizes: Sequence[int], what: str) -> list[bool]:
        """Which of these values, taken in order, fit the local buffer together.

        Mooncake copies each value a put sends or a get returns as bytes through the
        client's local buffer (setup's ``local_buffer_size``) and fails one that no
        longer fits (-600 for a put, a miss for a read); kvpool needs no staging copy
        but keeps that limit so ported code meets the same failures. Logs each refusal."""
        room, fits = self._args.local_buffer_size, []
        for size in sizes:
            fits.append(size <= room)
            room -= size if fits[-1] else 0
            if not fits[-1]:
                log.error("%s: %d bytes do not fit the %d-byte local buffer (local_buffer_size)",
                          what, size, self._args.local_buffer_size)
        return fits

    def _put_view(self, key, src: memoryview | None, config, upsert: bool, staged: bool = True) -> int:
        """``staged``: the value comes from Python objects (Mooncake stages it in the local
        buffer), not from registered memory."""
        client = self._client
        key = as_key(key)
        if client is None or key is None or src is None:
            return INVALID
        if staged and not self._staged([len(src)], f"put {key!r}")[0]:
            return INVALID
        try:
            n, pins, preferred = self._put_options(client, config)
            put = client.upsert if upsert else client.put
            put(key, src, n, preferred_segment=preferred, **pins)
        except ObjectExists:
            return OK
        except InvalidParams as exc:  # a caller's mistake: the code alone does not say which
            log.error("%s", exc)
            return INVALID
        except KVPoolError as exc:
            return put_code(exc.code)
        return OK

    def _batch_put(self, keys, srcs: list[memoryview | None], config, upsert: bool, staged: bool = True) -> list[int]:
        """Put every (key, view); None views and bad keys get -600. One code per key.
        ``staged``: as in :meth:`_put_view`; a batch that does not fit fails whole."""
        client = self._client
        if client is None:
            return [INVALID] * len(keys)
        codes = [INVALID] * len(keys)
        keys = as_keys(keys)
        sent = [i for i, k in enumerate(keys) if k is not None and srcs[i] is not None]
        if not sent or staged and not all(self._staged([len(srcs[i]) for i in sent], "put_batch")):
            return codes
        try:
            n, pins, preferred = self._put_options(client, config)
            results = client.batch_put([keys[i] for i in sent], [srcs[i] for i in sent], n, upsert=upsert,
                                       preferred_segment=preferred, **pins)
        except KVPoolError as exc:
            results = [exc.code] * len(sent)
        for i, code in zip(sent, results):
            codes[i] = put_code(code)
        return codes

    def _registered_views(self, buffer_ptrs, sizes) -> list[memoryview | None]:
        return [self._buffers.view(as_int("buffer_ptr", p), as_int("size", n)) for p, n in zip(buffer_ptrs, sizes)]

    def put(self, key: str, value, config: ReplicateConfig | None = None) -> int:
        """Store bytes-like ``value``. 0 (also when ``key`` exists: the old value stays),
        -600 (empty key/value, bad config), -200 (no space), ..."""
        return self._put_view(key, value_view(value), config, upsert=False)

    def upsert(self, key: str, value, config: ReplicateConfig | None = None) -> int:
        """Insert or replace ``key``; readers see the old or the new value, whole."""
        return self._put_view(key, value_view(value), config, upsert=True)

    def put_parts(self, key: str, *parts, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of bytes-like ``parts`` as one object."""
        return self._put_view(key, self._join(parts), config, upsert=False)

    def upsert_parts(self, key: str, *parts, config: ReplicateConfig | None = None) -> int:
        """Insert or replace ``key`` with the concatenation of ``parts``."""
        return self._put_view(key, self._join(parts), config, upsert=True)

    @staticmethod
    def _join(parts) -> memoryview | None:
        views = [value_view(p) for p in parts]
        if any(v is None for v in views):
            return None
        return views[0] if len(views) == 1 else memoryview(b"".join(views))

    def put_batch(self, keys: Sequence[str], values: Sequence, config: ReplicateConfig | None = None) -> int:
        """Store many objects; 0 if all stored (or existed), else the first error code."""
        if len(keys) != len(values):
            return INVALID
        codes = self._batch_put(keys, [value_view(v) for v in values], config, upsert=False)
        return next((c for c in codes if c != OK), OK)

    def upsert_batch(self, keys: Sequence[str], values: Sequence, config: ReplicateConfig | None = None) -> int:
        """Insert or replace many objects; 0 or the first error code."""
        if len(keys) != len(values):
            return INVALID
        codes = self._batch_put(keys, [value_view(v) for v in values], config, upsert=True)
        return next((c for c in codes if c != OK), OK)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """Store ``size`` bytes at registered address ``buffer_ptr`` (-600 if unregistered)."""
        return self._put_view(key, self._buffers.view(as_int("buffer_ptr", buffer_ptr), as_int("size", size)),
                              config, upsert=False, staged=False)

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """Insert or replace ``key`` from registered memory."""
        return self._put_view(key, self._buffers.view(as_int("buffer_ptr", buffer_ptr), as_int("size", size)),
                              config, upsert=True, staged=False)

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        """Store each ``sizes[i]`` bytes at ``buffer_ptrs[i]``; one code per key."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID] * len(keys)
        return self._batch_put(keys, self._registered_views(buffer_ptrs, sizes), config, upsert=False, staged=False)

    def batch_upsert_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                          config: ReplicateConfig | None = None) -> list[int]:
        """Insert or replace each key from registered memory; one code per key."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID] * len(keys)
        return self._batch_put(keys, self._registered_views(buffer_ptrs, sizes), config, upsert=True, staged=False)

    # ------------------------------------------------------------ reads

    def _query_staged(self, key) -> ReadHandle | None:
        """A read handle for ``key`` whose value fits the local buffer, else None (no
        client, malformed key, miss, or too large: then its grant goes back at once).
        Raises KVPoolError from the query."""
        client = self._client
        key = as_key(key)
        if client is None or key is None:
            return None
        handle = client.query(key)
        if not self._staged([handle.size], f"get {key!r}")[0]:
            client.release([handle])
            return None
        return handle

    def get(self, key: str) -> bytes:
        """The value, or b'' on a miss or any failure (Mooncake's convention; also for a
        value larger than the local buffer, see :meth:`_staged`)."""
        try:
            handle = self._query_staged(key)
            return b"" if handle is None else self._client.read(handle)
        except KVPoolError:
            return b""

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """One value per key; b'' for each miss (and each value that no longer fits the
        local buffer, as in Mooncake)."""
        return [b"" if buf is None else bytes(buf) for buf in self.batch_get_buffer(keys)]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value as a :class:`BufferHandle` (buffer protocol, ptr(), size()); None on a miss."""
        try:
            handle = self._query_staged(key)
            if handle is None:
                return None
            buf = BufferHandle(handle.size)
            self._client.read_into(handle, buf)
        except KVPoolError:
            return None
        return buf

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        """One BufferHandle per key; None for each miss."""
        client, keys = self._client, as_keys(keys)
        out: list[BufferHandle | None] = [None] * len(keys)
        idx = [i for i, k in enumerate(keys) if k is not None]
        if client is None or not idx:
            return out
        try:
            handles = client.batch_query([keys[i] for i in idx])
            found = [(i, h) for i, h in zip(idx, handles) if isinstance(h, ReadHandle)]
            fits = self._staged([h.size for _, h in found], "batch_get")
            client.release([h for (_, h), ok in zip(found, fits) if not ok])
            found = [pair for pair, ok in zip(found, fits) if ok]
            bufs = [BufferHandle(h.size) for _, h in found]
            sizes = client.batch_read_into([h for _, h in found], bufs)
        except KVPoolError:
            return out
        for (i, _), buf, n in zip(found, bufs, sizes):
            out[i] = buf if n >= 0 else None
        return out

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Copy the value into registered memory at ``buffer_ptr`` (capacity ``size``).
        Returns bytes written, or -704 (miss), -600 (unregistered or too small), -707 (lease
        expired before the copy finished; the buffer content is then undefined)."""
        client = self._client
        view = self._buffers.view(as_int("buffer_ptr", buffer_ptr), as_int("size", size))
        key = as_key(key)
        if client is None or key is None or view is None:
            return INVALID
        try:
            return client.get_into(key, view)
        except BufferOverflow as exc:  # Mooncake's code for it is -600; the sizes go to the log
            log.error("get_into: %s", exc)
            return INVALID
        except KVPoolError as exc:
            return int(exc.code)

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """:meth:`get_into` for many keys; bytes written or a negative code per key
        (one replica-list RPC, then one exchange per node)."""
        client = self._client
        if client is None or not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID] * len(keys)
        views, keys = self._registered_views(buffer_ptrs, sizes), as_keys(keys)
        out = [INVALID] * len(keys)
        idx = [i for i in range(len(keys)) if keys[i] is not None and views[i] is not None]
        if not idx:
            return out
        try:  # query, then read: the handles know each value's size for the log
            handles = client.batch_query([keys[i] for i in idx])
            found = [(i, h) for i, h in zip(idx, handles) if isinstance(h, ReadHandle)]
            results = client.batch_read_into([h for _, h in found], [views[i] for i, _ in found])
        except KVPoolError as exc:
            for i in idx:
                out[i] = int(exc.code)
            return out
        for i, h in zip(idx, handles):
            out[i] = int(h) if not isinstance(h, ReadHandle) else INVALID
        for (i, h), n in zip(found, results):
            if n == ErrorCode.BUFFER_OVERFLOW:  # Mooncake's code for it is -600; the sizes go to the log
                log.error("batch_get_into %r: the value is %d bytes, the buffer %d bytes", h.key, h.size, len(views[i]))
            out[i] = read_code(n)
        return out

    def get_into_ranges(self, buffer_ptrs: Sequence[int], all_keys, all_dst_offsets, all_src_offsets,
                        all_sizes) -> list[list[list[int]]]:
        """Copy byte ranges of objects into registered buffers (Mooncake's buffer-major form).

        For each (buffer i, key j, fragment k): ``all_sizes[i][j][k]`` bytes from offset
        ``all_src_offsets[i][j][k]`` of object ``all_keys[i][j]`` land at offset
        ``all_dst_offsets[i][j][k]`` of buffer ``buffer_ptrs[i]``. Returns the same nested
        shape: bytes copied per fragment, or -704 (miss), -707 (lease expired), -600
        (shape mismatch, range outside the object or the registered buffer). See
        :func:`kvpool.mooncake.ranges.get_into_ranges`.
        """
        return ranges.get_into_ranges(self._client, self._buffers, buffer_ptrs, all_keys, all_dst_offsets,
                                      all_src_offsets, all_sizes)

    # ------------------------------------------------------------ existence, size, descriptors

    def _code_for(self, key, call) -> int:
        """``int(call(client, key))``; INVALID for no client or a malformed key, the
        error's code if the call raises a KVPoolError."""
        client = self._client
        key = as_key(key)
        if client is None or key is None:
            return INVALID
        try:
            return int(call(client, key))
        except KVPoolError as exc:
            return int(exc.code)

    def _codes_for(self, keys, call) -> list[int]:
        """One int per key: INVALID for a malformed key (or no client); for the rest the
        ints ``call(client, well_formed_keys)`` returns in one batch, or all the code of
        the KVPoolError it raises."""
        client, keys = self._client, as_keys(keys)
        out = [INVALID] * len(keys)
        idx = [i for i, k in enumerate(keys) if k is not None]
        if client is None or not idx:
            return out
        try:
            values = [int(v) for v in call(client, [keys[i] for i in idx])]
        except KVPoolError as exc:
            values = [int(exc.code)] * len(idx)
        for i, value in zip(idx, values):
            out[i] = value
        return out

    def is_exist(self, key: str) -> int:
        """1 if readable now, 0 if not, negative on error (grants a read lease)."""
        return self._code_for(key, lambda client, k: client.is_exist(k))

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1 / 0 / negative code per key."""
        return self._codes_for(keys, lambda client, ks: client.batch_is_exist(ks))

    def get_size(self, key: str) -> int:
        """Value size in bytes, or a negative code (-704 miss). Grants a read lease."""
        return self._code_for(key, lambda client, k: client.get_size(k))

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """Descriptors of the COMPLETE replicas of ``key``; [] on a miss. Grants a lease
        (the object's); the read grant is handed back at once, as nothing is read here."""
        client = self._client
        key = as_key(key)
        if client is None or key is None:
            return []
        try:
            handle = client.query(key)
        except KVPoolError:
            return []
        client.release([handle])  # else the grant pins an old version until the lease ends
        return [_descriptor(d) for d in handle.replicas]

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[ReplicaDescriptor]]:
        """{key: descriptors} for the keys found (missing keys are left out, as in Mooncake)."""
        client, keys = self._client, as_keys(keys)
        wanted = [k for k in keys if k is not None]
        if client is None or not wanted:
            return {}
        try:
            handles = client.batch_query(wanted)
        except KVPoolError:
            return {}
        found = {k: h for k, h in zip(wanted, handles) if isinstance(h, ReadHandle)}
        client.release(list(found.values()))  # nothing is read here: hand the grants back
        return {k: [_descriptor(d) for d in h.replicas] for k, h in found.items()}

    # ------------------------------------------------------------ removal

    def remove(self, key: str, force: bool = False) -> int:
        """0, -704 (miss) or -706 (read lease held; ``force=True`` removes anyway)."""
        def remove(client, k):
            client.remove(k, force=bool(force))
            return OK
        return self._code_for(key, remove)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """One code per key (0, -704, -706, -600)."""
        return self._codes_for(keys, lambda client, ks: client.batch_remove(ks, force=bool(force)))

    def remove_all(self, force: bool = False) -> int:
        """Remove every object (leased ones skipped unless ``force``); the count or a code."""
        client = self._client
        if client is None:
            return INVALID
        try:
            return client.remove_all(force=bool(force))
        except KVPoolError as exc:
            return int(exc.code)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Remove objects whose key matches (RE2 search, as ``re.search`` without backreferences and lookaround); the count, or -600 for a bad regex."""
        if not isinstance(regex_pattern, str):
            raise TypeError(f"regex_pattern must be str, not {type(regex_pattern).__name__}")
        client = self._client
        if client is None:
            return INVALID
        try:
            return client.remove_by_regex(regex_pattern, force=bool(force))
        except KVPoolError as exc:
            return int(exc.code)

    # ------------------------------------------------------------ registered memory

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Allow zero-copy calls on ``size`` bytes at address ``buffer_ptr``; 0 or -600.
        The memory must stay valid until :meth:`unregister_buffer` or :meth:`close`."""
        ptr, size = as_int("buffer_ptr", buffer_ptr), as_int("size", size)
        if self._client is None:
            return INVALID
        return OK if self._buffers.register(ptr, size) else INVALID

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Forget the region registered at ``buffer_ptr``; 0, or -600 if none was."""
        return OK if self._buffers.unregister(as_int("buffer_ptr", buffer_ptr)) else INVALID
