"""Page codec: the self-describing bytes of one KV page as stored in L3.

A stored page is a fixed 128-byte header followed by the payload (the raw bytes of the
page tensor). The header binds the payload to where it may be used: namespace digest,
page key, page index, token count, payload length, and the xxh3_64 of the payload. A
reader passes what it expects; any difference raises a specific :class:`PageFormatError`
subclass, which the cache turns into a miss and a metric (DESIGN.md, judgement 2).

Header (little-endian), padded with zeros to 128 bytes so that the payload is aligned:

    magic        4s   b"KVPG"
    version      u16  PAGE_FORMAT_VERSION
    ns_digest    32s  Namespace.digest()
    page_key     32s  the page's chain key (keys.page_keys)
    page_index   u32  position of the page in its sequence (0-based)
    token_count  u32  tokens in the page (= page_size)
    payload_len  u64  bytes after the header
    checksum     u64  xxh3_64(payload)
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence

import xxhash

from kvpool.errors import ErrorCode, KVPoolError

MAGIC = b"KVPG"
PAGE_FORMAT_VERSION = 1
HEADER_SIZE = 128
_HEADER = struct.Struct("<4sH32s32sIIQQ")


class PageFormatError(KVPoolError):
    """A stored page that must not be used: the cache counts it and treats it as a miss."""

    code = ErrorCode.INVALID_READ
    reason = "format"


class TruncatedPage(PageFormatError):
    reason = "truncated"


class BadMagic(PageFormatError):
    reason = "magic"


class VersionMismatch(PageFormatError):
    reason = "version"


class NamespaceMismatch(PageFormatError):
    reason = "namespace"


class PageKeyMismatch(PageFormatError):
    reason = "page_key"


class PageIndexMismatch(PageFormatError):
    reason = "page_index"


class LengthMismatch(PageFormatError):
    reason = "length"


class ChecksumMismatch(PageFormatError):
    reason = "checksum"


@dataclasses.dataclass(frozen=True)
class PageHeader:
    """What a reader expects of (or a writer records about) one stored page."""

    ns_digest: bytes
    page_key: bytes
    page_index: int
    token_count: int
    payload_len: int


def encode_page(header: PageHeader, payload) -> bytes:
    """Header + payload as one bytes object of ``HEADER_SIZE + len(payload)`` bytes.

    ``payload``: any C-contiguous buffer (bytes, memoryview, numpy uint8 array).
    Raises LengthMismatch when the payload is not ``header.payload_len`` bytes.
    """
    view = memoryview(payload).cast("B")
    return encode_header(header, [view]) + view


def encode_header(header: PageHeader, parts: Sequence) -> bytes:
    """The ``HEADER_SIZE``-byte header of a page whose payload is ``parts`` joined.

    For gather writes: the parts (C-contiguous buffers, e.g. K and V regions of a host
    pool) are written after the header as they are, never joined in memory.
    Raises LengthMismatch when the parts do not add up to ``header.payload_len`` bytes.
    """
    total = sum(memoryview(p).nbytes for p in parts)
    if total != header.payload_len:
        raise LengthMismatch(f"payload is {total} bytes, header says {header.payload_len}")
    out = bytearray(HEADER_SIZE)
    _HEADER.pack_into(out, 0, MAGIC, PAGE_FORMAT_VERSION, header.ns_digest, header.page_key,
                      header.page_index, header.token_count, header.payload_len,
                      payload_checksum(parts))
    return bytes(out)


def payload_checksum(parts: Sequence) -> int:
    """xxh3_64 of the concatenation of ``parts`` (C-contiguous buffers), without joining."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(memoryview(part).cast("B"))
    return h.intdigest()


def seal_page(page, header: PageHeader) -> None:
    """Write the header of a page whose payload already sits at ``page[HEADER_SIZE:]``.

    For writers that gather a payload straight into a staging row (no second copy to
    prepend the header). ``page``: a writable C-contiguous buffer of
    ``HEADER_SIZE + header.payload_len`` bytes. Raises LengthMismatch otherwise.
    """
    view = memoryview(page).cast("B")
    view[:HEADER_SIZE] = encode_header(header, [view[HEADER_SIZE:]])


def decode_page(blob, expect: PageHeader) -> memoryview:
    """Check ``blob`` against ``expect`` and return a view of its payload.

    Raises (all PageFormatError): TruncatedPage, BadMagic, VersionMismatch,
    NamespaceMismatch, PageKeyMismatch, PageIndexMismatch, LengthMismatch,
    ChecksumMismatch — checked in this order, the checksum last (it reads every byte).
    """
    view = memoryview(blob).cast("B")
    payload = view[HEADER_SIZE:]
    check_parts(view[:HEADER_SIZE], [payload], expect)
    return payload


def check_parts(header, parts: Sequence, expect: PageHeader) -> None:
    """Check a stored header (its first ``HEADER_SIZE`` bytes) and the payload that was
    read after it into ``parts`` (scatter reads: e.g. straight into host-pool slots).

    Raises the PageFormatError subclasses of :func:`decode_page`, in the same order.
    """
    checksum = check_header(header, expect)
    total = sum(memoryview(p).nbytes for p in parts)
    if total != expect.payload_len:
        raise TruncatedPage(f"payload is {total} bytes, header says {expect.payload_len}")
    if payload_checksum(parts) != checksum:
        raise ChecksumMismatch("payload checksum does not match its header")


def check_header(header, expect: PageHeader) -> int:
    """Check a stored header (its first ``HEADER_SIZE`` bytes) against ``expect``; returns
    the payload checksum it records, for the caller to compare once the payload is read.

    Raises TruncatedPage, BadMagic, VersionMismatch, NamespaceMismatch, PageKeyMismatch,
    PageIndexMismatch, LengthMismatch (all PageFormatError), in this order.
    """
    view = memoryview(header).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise TruncatedPage(f"page of {view.nbytes} bytes is shorter than its header")
    magic, version, ns, key, index, tokens, length, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise BadMagic(f"not a kvpool page (magic {magic!r})")
    if version != PAGE_FORMAT_VERSION:
        raise VersionMismatch(f"page format {version}, this reader knows {PAGE_FORMAT_VERSION}")
    if ns != expect.ns_digest:
        raise NamespaceMismatch("page belongs to another namespace")
    if key != expect.page_key:
        raise PageKeyMismatch("page was stored under another page key")
    if index != expect.page_index:
        raise PageIndexMismatch(f"page index {index}, expected {expect.page_index}")
    if tokens != expect.token_count or length != expect.payload_len:
        raise LengthMismatch(f"page has {tokens} tokens / {length} bytes, expected "
                             f"{expect.token_count} / {expect.payload_len}")
    return checksum


def check_stored_size(header, size: int, expect: PageHeader) -> None:
    """Judge a stored object of ``size`` bytes that is not the size of the page ``expect``
    describes, from its header (its first ``HEADER_SIZE`` bytes): return when the header
    names this page with a payload length that is the object's own (a sound page of
    another size: the reader's mismatch, not the page's), else raise the PageFormatError
    of an object that is unsound in itself (corrupt, truncated, foreign).
    """
    try:
        check_header(header, expect)
    except LengthMismatch:
        if _HEADER.unpack_from(memoryview(header).cast("B"))[6] == size - HEADER_SIZE:
            return
        raise
    raise LengthMismatch(f"object is {size} bytes, its header says {HEADER_SIZE + expect.payload_len}")
