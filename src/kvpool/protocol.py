"""Every kvpool wire message and the frame format, in one place.

Frame (control plane to the master, data plane to a node)::

    +---------+---------+---------------------------+
    | magic   | length  | body: msgpack of a Struct |
    | 4 bytes | u32 LE  | `length` bytes            |
    +---------+---------+---------------------------+

``magic`` is ``b"KVP"`` and one ASCII digit, the protocol version (:data:`PROTOCOL_VERSION`).
A peer of another version is told so instead of being cut off: a server that reads a
``KVP<n>`` header with another ``n`` answers, in the peer's own framing, one
:class:`ErrorResp` (control plane) or :class:`DataResp` (data plane) with code
INVALID_VERSION and a message "protocol version n, master speaks m", then closes the
connection; :func:`parse_header` raises :class:`VersionMismatch` on such a header. So
those two replies keep their field layout in every version. The body is one tagged
msgspec Struct; the tag is the class name. Decoding validates every field's type, so a
malformed message is a :class:`msgspec.ValidationError` / :class:`msgspec.DecodeError`
that the server answers with :class:`ErrorResp` (the framing is still intact); a frame with
a bad magic or a length over :data:`MAX_FRAME` cannot be resynchronised and the
connection is closed. Integers on the wire are msgpack ints (no 32-bit field anywhere in
a message body).

Limits (checked at decode time, so a request out of them is refused before any handler
sees it): every int, str and list field of a request carries msgspec ``Meta`` bounds
from the constants below: sizes, offsets and lengths ``0..``:data:`MAX_SEGMENT_BYTES`,
ids ``0..``:data:`MAX_ID`, keys up to :data:`MAX_KEY_BYTES` characters (the master then
checks 1..MAX_KEY_BYTES UTF-8 bytes), names and addresses up to :data:`MAX_NAME_LEN`,
batches up to :data:`MAX_BATCH` items, data-plane ranges up to :data:`MAX_RANGES`. With
at most :data:`MAX_SEGMENTS` segments mounted at once (the master refuses more), every
total a reply carries stays below 2**63, so no stored value can make a reply
unencodable.

Data-plane payloads (value bytes) follow their header frame raw, never inside msgpack,
so a node reads them straight into its segment with ``recv_into``.

The module stays one file over 400 lines on purpose: it is the wire contract, and one
place to read (and version) every message is worth more than a split by plane.
"""

from __future__ import annotations

import socket
import struct
from typing import Annotated, Union

import msgspec

from kvpool.errors import ErrorCode, KVPoolError

PROTOCOL_VERSION = 7  # 2: GetResp.grant_id, ReadDone, PutStartResp.message; 3: mount epochs, segment index;
# 4: allocation leases (AllocLease, PutCommit, ReturnLease), StatsResp.leased_bytes/open_leases; 5: GetResp.version;
# 6: BatchGetResp names each segment once (GetItem); 7: Wake
MAGIC_PREFIX = b"KVP"
HEADER = struct.Struct("<4sI")
MAX_FRAME = 64 << 20  # bytes; a batch of 4096 keys of 4 KiB each still fits
MAX_KEY_BYTES = 4096  # a key is a str of 1..MAX_KEY_BYTES UTF-8 bytes (client, master and admin agree)
MAX_SEGMENT_BYTES = 1 << 50  # bytes (1 PiB): a segment's size, so any object's size, offset, length
MAX_SEGMENTS = 4096  # segments mounted at once: totals stay <= 2**62 bytes
MAX_ID = (1 << 63) - 1  # put ids, grant ids
MAX_NAME_LEN = 512  # characters of a segment, owner, host or shm name, or an address
MAX_BATCH = 1 << 16  # items in one batch request
MAX_RANGES = 1 << 18  # (offset, length) pairs in one data-plane request
MAX_INDEX_ENTRIES = 1 << 20  # objects a node reports at a re-mount (the frame limit binds first)
MAX_REPLICAS = 1024  # replica_num on the wire (the master's --max-replicas is lower)
MAX_TTL_MS = 1 << 42  # a soft-pin TTL, ms (about 139 years)
MAX_PATTERN_LEN = 4096  # characters of a RemoveByRegex pattern
MAX_LEASE_IDS = 1024  # allocation leases one ReturnLease names (an owner holds a few)

Size = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEGMENT_BYTES)]
Id = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]
Key = Annotated[str, msgspec.Meta(max_length=MAX_KEY_BYTES)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_LEN)]

def magic(version: int = PROTOCOL_VERSION) -> bytes:
    """The 4 magic bytes of frames of protocol ``version`` (0..9)."""
    return MAGIC_PREFIX + str(version).encode()


MAGIC = magic()


class FrameError(Exception):
    """The byte stream is not a kvpool frame (bad magic, oversized, or cut short)."""


class VersionMismatch(FrameError):
    """The peer frames with protocol version ``version``, not :data:`PROTOCOL_VERSION`;
    ``length``: the body length its header announced (read it before answering, so that
    closing the connection does not reset it under the answer)."""

    def __init__(self, version: int, length: int = 0):
        self.version, self.length = version, length
        super().__init__(f"the peer speaks kvpool protocol version {version}, this side {PROTOCOL_VERSION}")


class _Msg(msgspec.Struct, tag=True, array_like=True, forbid_unknown_fields=True):
    """Base of every message: tagged by class name, encoded as a msgpack array."""


# ---------------------------------------------------------------- shared descriptors


class SegmentInfo(msgspec.Struct, array_like=True, frozen=True):
    """A mounted memory segment.

    name: unique segment id; host_id: machine identity (same value ⇒ shared memory is
    reachable); shm_name: POSIX shm name under /dev/shm; size: bytes; data_addr:
    "host:port" of the node's TCP data server; epoch: the mount epoch the master stamped
    on this mount of the segment (a random nonzero 63-bit number, new for every mount by
    every master incarnation): every grant that names the segment carries it, and the
    bytes move only while the node's current epoch is the same (0: no grant, unchecked;
    see "Safety across master restarts" in docs/store.md).
    """

    name: Name
    host_id: Name
    shm_name: Name
    size: Size
    data_addr: Name
    epoch: Id = 0


class ReplicaDesc(msgspec.Struct, array_like=True, frozen=True):
    """Where one replica's bytes live: ``length`` bytes at ``offset`` of ``segment``."""

    segment: SegmentInfo
    offset: Size
    length: Size


SOFT_PIN_PRESERVE, SOFT_PIN_ENABLE, SOFT_PIN_DISABLE = 0, 1, 2  # Mooncake's SoftPinAction


class PutItem(msgspec.Struct, array_like=True):
    """One object to allocate: ``size`` bytes, ``replica_num`` copies on distinct segments.

    upsert: replace an existing object (readers see the old or the new value whole);
    soft_pin: what PutEnd does to the soft pin (Mooncake's SoftPinAction): PRESERVE (0)
    keeps an existing unexpired one (a new object has none), ENABLE (1) sets it for
    ``soft_pin_ttl_ms`` from PutEnd (-1 = the master's --soft-pin-ttl; 0 clears it, as in
    Mooncake), DISABLE (2) clears it; a TTL without ENABLE is INVALID_PARAMS;
    hard_pin: never evicted; preferred_segment: segment name to try first ("" = strategy).
    """

    key: Key
    size: Size
    replica_num: Annotated[int, msgspec.Meta(ge=0, le=MAX_REPLICAS)] = 1
    upsert: bool = False
    soft_pin: Annotated[int, msgspec.Meta(ge=SOFT_PIN_PRESERVE, le=SOFT_PIN_DISABLE)] = SOFT_PIN_PRESERVE
    hard_pin: bool = False
    preferred_segment: Name = ""
    soft_pin_ttl_ms: Annotated[int, msgspec.Meta(ge=-1, le=MAX_TTL_MS)] = -1


class IndexEntry(msgspec.Struct, array_like=True):
    """One COMPLETE object in a node's segment index: ``size`` value bytes of ``key`` at
    ``offset``; ``version``: the master's commit version (wall-clock ns at PutEnd, kept
    strictly increasing), so that of two reported versions of a key the later wins."""

    key: Key
    offset: Size
    size: Size
    version: Id


class CommitItem(msgspec.Struct, array_like=True):
    """One object a :class:`PutCommit` makes visible: ``size`` value bytes of ``key``
    already written at ``offset`` of the lease's segment (64-aligned, inside the lease,
    overlapping no range committed from it before). The options are PutItem's."""

    key: Key
    offset: Size
    size: Size
    upsert: bool = False
    soft_pin: Annotated[int, msgspec.Meta(ge=SOFT_PIN_PRESERVE, le=SOFT_PIN_DISABLE)] = SOFT_PIN_PRESERVE
    hard_pin: bool = False
    soft_pin_ttl_ms: Annotated[int, msgspec.Meta(ge=-1, le=MAX_TTL_MS)] = -1


class PutToken(msgspec.Struct, array_like=True):
    """Identifies one in-flight put: the key and the put id PutStart handed out."""

    key: Key
    put_id: Id


# ---------------------------------------------------------------- requests


class Ping(_Msg):
    pass


class MountSegment(_Msg):
    """A node (``owner_id``) offers a segment. Reply: :class:`MountResp`.

    index: the node keeps an index of the segment's COMPLETE objects: the master then
    sends :class:`IndexUpdate` notices on this connection after the reply, for as long
    as the segment stays mounted; objects: that index, reported at a re-mount (the new
    master incarnation rebuilds these objects); prev_incarnation: the incarnation that
    mounted the segment before (0: none); the same master ignores ``objects`` (it
    dropped the segment on purpose, e.g. a heartbeat timeout).
    """

    owner_id: Name
    segment: SegmentInfo
    index: bool = False
    objects: Annotated[list[IndexEntry], msgspec.Meta(max_length=MAX_INDEX_ENTRIES)] = []
    prev_incarnation: Id = 0


class UnmountSegment(_Msg):
    owner_id: Name
    name: Name


class Heartbeat(_Msg):
    """Keeps ``owner_id``'s segments mounted. Reply code CLIENT_NOT_FOUND ⇒ remount."""

    owner_id: Name


class PutStart(_Msg):
    """Allocate buffers for one object. ``host_id`` serves the local_first strategy."""

    item: PutItem
    host_id: Name = ""


class BatchPutStart(_Msg):
    items: Annotated[list[PutItem], msgspec.Meta(max_length=MAX_BATCH)]
    host_id: Name = ""


class PutEnd(_Msg):
    token: PutToken


class BatchPutEnd(_Msg):
    tokens: Annotated[list[PutToken], msgspec.Meta(max_length=MAX_BATCH)]


class PutRevoke(_Msg):
    token: PutToken


class BatchPutRevoke(_Msg):
    tokens: Annotated[list[PutToken], msgspec.Meta(max_length=MAX_BATCH)]


class AllocLease(_Msg):
    """Ask for an allocation lease: a region of about ``size`` bytes (the master may
    grant less) on one segment, that ``owner_id`` (a client's random id) allocates
    values from itself and commits with :class:`PutCommit`. ``segment``: the segment
    to try first ("" = the strategy's choice); ``host_id`` serves local_first.
    Reply: :class:`AllocLeaseResp`."""

    owner_id: Name
    size: Size
    host_id: Name = ""
    segment: Name = ""


class PutCommit(_Msg):
    """Make ``items``, written into lease ``lease_id`` of ``owner_id``, visible: one
    COMPLETE replica each. Reply: :class:`CodesResp`, one code per item (LEASE_EXPIRED
    for every item when the lease is unknown or expired: put them the PutStart way).
    Idempotent: sent again (its reply was lost), an item this master applied the first
    time answers OK, among its last 8,192 commits."""

    owner_id: Name
    lease_id: Id
    items: Annotated[list[CommitItem], msgspec.Meta(max_length=MAX_BATCH)]


class ReturnLease(_Msg):
    """End leases of ``owner_id``: no write into them is in flight, so their uncommitted
    space is freed at once. Unknown ids are ignored. Reply: :class:`CountResp` (leases
    ended)."""

    owner_id: Name
    lease_ids: Annotated[list[Id], msgspec.Meta(max_length=MAX_LEASE_IDS)]


class GetReplicaList(_Msg):
    """COMPLETE replicas of ``key`` and a read lease. Reply: :class:`GetResp`."""

    key: Key


class BatchGetReplicaList(_Msg):
    keys: Annotated[list[Key], msgspec.Meta(max_length=MAX_BATCH)]


class ReadDone(_Msg):
    """The reader finished copying (or gave up on) the reads of these grants
    (``GetResp.grant_id``). A notification: the master sends NO reply, so the client
    does not wait for one. Old versions of an object (upserted over, removed) are kept
    only while a read grant on them is neither done nor expired; the object's lease is
    not shortened. Unknown, expired or repeated ids are ignored."""

    grant_ids: Annotated[list[Id], msgspec.Meta(max_length=MAX_BATCH)]


class Wake(_Msg):
    """This connection's next request follows within ``within_us`` microseconds: the
    master polls for it instead of sleeping, so it finds the master awake
    (:mod:`kvpool.master.busy_poll`, which caps the poll; the next answer ends it). A
    put sends it as its write ends, for the commit that follows (the payload handed to
    the kernel, or before a copy in its own process). A notification: the master sends
    NO reply."""

    within_us: Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)] = 0


NOTICES = (ReadDone, Wake)  # requests the master never answers


class ExistKey(_Msg):
    key: Key


class BatchExistKey(_Msg):
    keys: Annotated[list[Key], msgspec.Meta(max_length=MAX_BATCH)]


class Remove(_Msg):
    key: Key
    force: bool = False


class BatchRemove(_Msg):
    keys: Annotated[list[Key], msgspec.Meta(max_length=MAX_BATCH)]
    force: bool = False


class RemoveAll(_Msg):
    force: bool = False


class RemoveByRegex(_Msg):
    pattern: Annotated[str, msgspec.Meta(max_length=MAX_PATTERN_LEN)]
    force: bool = False


PIN_MODES = ("hard", "soft", "none")  # SetPin.mode values


class SetPin(_Msg):
    """mode: "none", "soft" (until soft_pin_ttl from now) or "hard" (never evicted)."""

    key: Key
    mode: Annotated[str, msgspec.Meta(max_length=16)]


class GetStats(_Msg):
    pass


# data plane (to a node's TCP server); payload bytes follow DataWrite / DataWriteMany raw
Ranges = Annotated[list[Size], msgspec.Meta(max_length=MAX_RANGES)]


class DataWrite(_Msg):
    offset: Size
    length: Size
    epoch: Id = 0  # SegmentInfo.epoch of the grant (0: unchecked)


class DataWriteMany(_Msg):
    """Write ``lengths[i]`` bytes at ``offsets[i]``; the payload is their concatenation.
    Reply: DataResp(code, total bytes written)."""

    offsets: Ranges
    lengths: Ranges
    epoch: Id = 0  # SegmentInfo.epoch of the grant (0: unchecked)


class DataRead(_Msg):
    """Read ``lengths[i]`` bytes at ``offsets[i]``; the reply payload is their concatenation."""

    offsets: Ranges
    lengths: Ranges
    epoch: Id = 0  # SegmentInfo.epoch of the grant (0: unchecked)


# ---------------------------------------------------------------- replies


class Resp(_Msg):
    """Generic reply: an :class:`~kvpool.errors.ErrorCode` integer and a note."""

    code: int = 0
    message: str = ""


class ErrorResp(_Msg):
    """The request could not be decoded or handled; the connection stays usable."""

    code: int
    message: str = ""


class MountResp(_Msg):
    """epoch: the mount epoch stamped on the segment (SegmentInfo.epoch); incarnation:
    the master's (random, per start); dropped: reported index entries not restored (a
    newer version of the key, an overlap, out of bounds): the node forgets them."""

    code: int
    heartbeat_interval_ms: int = 0
    epoch: int = 0
    incarnation: int = 0
    dropped: list[str] = []


class IndexUpdate(_Msg):
    """Master to node, on a mount connection with ``index``: objects of segment ``name``
    that stopped being visible (``drops``: removed, evicted, replaced) and, after them,
    those committed (``adds``). Sent before the reply that makes the change known, so
    the node's index holds every commit a client was told of. No reply."""

    name: str
    drops: list[str] = []
    adds: list[IndexEntry] = []


class PutStartResp(_Msg):
    """code OK ⇒ write the value to every replica, then PutEnd with ``put_id``.

    ``replicas`` may be fewer than asked (best effort); ``len(replicas)`` is the count.
    """

    code: int
    put_id: int = 0
    replicas: list[ReplicaDesc] = []
    message: str = ""  # why a put failed (NO_AVAILABLE_HANDLE: sizes, space held by reads)


class AllocLeaseResp(_Msg):
    """code OK ⇒ ``region`` is the lease (its ``length`` may be less than asked), valid
    for ``ttl_ms`` from when the request was sent (the client measures from its own
    send time); NO_AVAILABLE_HANDLE ⇒ no room without eviction: put the PutStart way."""

    code: int
    lease_id: int = 0
    region: ReplicaDesc | None = None
    ttl_ms: int = 0
    message: str = ""


class BatchPutStartResp(_Msg):
    results: list[PutStartResp]


class GetResp(_Msg):
    """code OK ⇒ ``size`` bytes in each of ``replicas``; the read lease lasts ``lease_ttl_ms``
    from when the request was sent (the client measures from its own send time).
    ``grant_id`` names this read for :class:`ReadDone` (0: nothing to report);
    ``version``: the value's commit version (:class:`IndexEntry`), which with the
    replicas' segment epochs names bytes that never change while the version lives
    (the client's location hints, :mod:`kvpool.client.hints`)."""

    code: int
    size: int = 0
    lease_ttl_ms: int = 0
    replicas: list[ReplicaDesc] = []
    grant_id: int = 0
    version: int = 0


class GetItem(msgspec.Struct, array_like=True):
    """One key's answer in a :class:`BatchGetResp`: code OK ⇒ ``size`` bytes at each
    (segment, offset) of ``places``, ``segment`` an index into the reply's
    ``segments`` (a replica always holds the whole value); ``grant_id`` and ``version``
    as in :class:`GetResp`."""

    code: int
    size: Size = 0
    places: list[tuple[Annotated[int, msgspec.Meta(ge=0)], Size]] = []
    grant_id: int = 0
    version: int = 0


class BatchGetResp(_Msg):
    """The answers to a :class:`BatchGetReplicaList`, one :class:`GetItem` per key in
    order, every lease ``lease_ttl_ms`` long (as :class:`GetResp`'s). The segments the
    items name are sent once per reply, not once per key: a batch's keys share a few
    segments, so 128 keys of 4 KiB take about 4 KB on the wire instead of 20 KB, and
    the master's encoding and the client's decoding shrink with it (docs/bench.md,
    "A batch get's reply names each segment once")."""

    segments: list[SegmentInfo]
    lease_ttl_ms: int
    results: list[GetItem]

    def replicas(self, item: GetItem) -> list[ReplicaDesc]:
        """The :class:`ReplicaDesc` list of one of this reply's items. Raises
        KVPoolError (INTERNAL_ERROR) for a segment index outside :attr:`segments` (a
        malformed reply)."""
        segments, size = self.segments, item.size
        try:
            return [ReplicaDesc(segments[index], offset, size) for index, offset in item.places]
        except IndexError:
            raise KVPoolError(f"malformed batch get reply: it names segment {max(i for i, _ in item.places)} "
                              f"of {len(segments)}") from None


class CodesResp(_Msg):
    codes: list[int]


class CountResp(_Msg):
    code: int
    count: int = 0


class SegmentStats(msgspec.Struct, array_like=True):
    name: str
    owner_id: str
    size: int
    used: int
    data_addr: str
    withheld: bool = False  # no new buffers go there: its node's index stream closed
    lagging: bool = False  # placed last: its node reads its index stream late


class StatsResp(_Msg):
    """Master metrics. Bytes are allocated (aligned) bytes; counters never decrease."""

    object_count: int
    used_bytes: int
    total_bytes: int
    segments: list[SegmentStats]
    counters: dict[str, int]
    owner_count: int = 0  # nodes/clients with mounted segments and a live heartbeat
    in_flight_puts: int = 0  # objects between PutStart and PutEnd
    zombie_buffers: int = 0  # freed buffers waiting for reads in flight or a release timeout
    zombie_bytes: int = 0  # their allocated bytes
    open_grants: int = 0  # read grants neither reported done nor expired
    open_leases: int = 0  # allocation leases neither returned nor expired
    leased_bytes: int = 0  # their allocated bytes not committed yet (not evictable)


class DataResp(_Msg):
    """Data-plane reply; for a read, ``length`` payload bytes follow."""

    code: int
    length: int = 0


Request = Union[
    Ping, MountSegment, UnmountSegment, Heartbeat, PutStart, BatchPutStart, PutEnd,
    BatchPutEnd, PutRevoke, BatchPutRevoke, GetReplicaList, BatchGetReplicaList, ReadDone, Wake, ExistKey,
    BatchExistKey, Remove, BatchRemove, RemoveAll, RemoveByRegex, SetPin, GetStats, AllocLease, PutCommit,
    ReturnLease,
]
Reply = Union[
    Resp, ErrorResp, MountResp, PutStartResp, BatchPutStartResp, GetResp, BatchGetResp,
    CodesResp, CountResp, StatsResp, IndexUpdate, AllocLeaseResp,
]
DataRequest = Union[DataWrite, DataWriteMany, DataRead]

_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
data_request_decoder = msgspec.msgpack.Decoder(DataRequest)
data_reply_decoder = msgspec.msgpack.Decoder(DataResp)


def encode_frame(msg: msgspec.Struct, version: int = PROTOCOL_VERSION) -> bytes:
    """Header + msgpack body of ``msg``, framed as protocol ``version`` (another version
    only to refuse a peer: :func:`version_refusal`). Raises FrameError if the body
    exceeds MAX_FRAME."""
    body = _encoder.encode(msg)
    if len(body) > MAX_FRAME:
        raise FrameError(f"message of {len(body)} bytes exceeds MAX_FRAME={MAX_FRAME}")
    return HEADER.pack(magic(version), len(body)) + body


def version_refusal(peer_version: int, role: str, reply: type = ErrorResp) -> bytes:
    """The frame a ``role`` ("master", "node") sends a peer of ``peer_version`` before
    closing: ``reply`` (ErrorResp, or DataResp on the data plane) with INVALID_VERSION,
    framed in the peer's version so that its own decoder reads it."""
    code = int(ErrorCode.INVALID_VERSION)
    if reply is DataResp:
        return encode_frame(DataResp(code), peer_version)
    text = (f"protocol version {peer_version}, {role} speaks {PROTOCOL_VERSION}: "
            f"run the same kvpool release on clients, nodes and master")
    return encode_frame(ErrorResp(code, text), peer_version)


def parse_header(header: bytes) -> int:
    """Body length from an 8-byte header. Raises VersionMismatch (a kvpool frame of
    another protocol version), FrameError (bad magic or size)."""
    head, length = HEADER.unpack(header)
    if head != MAGIC:
        if head[:3] == MAGIC_PREFIX and head[3:].isdigit():
            raise VersionMismatch(int(head[3:]), length if length <= MAX_FRAME else 0)
        raise FrameError(f"bad frame magic {head!r}")
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes exceeds MAX_FRAME={MAX_FRAME}")
    return length


def set_kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Put ``sock`` in blocking mode with SO_RCVTIMEO/SO_SNDTIMEO of ``seconds``: a call
    that waits longer fails with EAGAIN (BlockingIOError). Why not ``settimeout``: a
    socket with a Python timeout polls before every send and recv, one more system call
    each (5-10 us of a 60-70 us round trip to the master on the 2-core VM here)."""
    sock.settimeout(None)
    micros = max(1, round(seconds * 1e6))  # 0 would mean "never time out"
    tv = struct.pack("ll", micros // 1_000_000, micros % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (loop over recv_into). Raises FrameError on EOF."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise FrameError("connection closed mid-frame")
        got += k


def recv_frame(sock: socket.socket) -> bytearray:
    """Read one frame body from a blocking socket. Raises FrameError, OSError."""
    header = bytearray(HEADER.size)
    recv_exact_into(sock, memoryview(header))
    body = bytearray(parse_header(bytes(header)))
    recv_exact_into(sock, memoryview(body))
    return body
