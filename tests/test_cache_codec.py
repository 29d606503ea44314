"""Page codec: a stored page is used only where its header says it belongs."""

import dataclasses
import struct

import pytest
import xxhash

from kvpool.cache.codec import (
    HEADER_SIZE, BadMagic, ChecksumMismatch, LengthMismatch, NamespaceMismatch,
    PageHeader, PageIndexMismatch, PageKeyMismatch, TruncatedPage, VersionMismatch,
    decode_page, encode_page,
)

PAYLOAD = bytes(range(256)) * 4
HEADER = PageHeader(ns_digest=b"n" * 32, page_key=b"k" * 32, page_index=3, token_count=16,
                    payload_len=len(PAYLOAD))


def test_round_trip_is_byte_exact():
    blob = encode_page(HEADER, PAYLOAD)
    assert len(blob) == HEADER_SIZE + len(PAYLOAD)
    assert bytes(decode_page(blob, HEADER)) == PAYLOAD


def test_header_fields_are_where_the_docstring_says():
    blob = encode_page(HEADER, PAYLOAD)
    magic, version, ns, key, index, tokens, length, checksum = struct.unpack_from(
        "<4sH32s32sIIQQ", blob)
    assert (magic, version, ns, key, index, tokens, length) == (
        b"KVPG", 1, HEADER.ns_digest, HEADER.page_key, 3, 16, len(PAYLOAD))
    assert checksum == xxhash.xxh3_64_intdigest(PAYLOAD)


@pytest.mark.parametrize("change, error", [
    ({"ns_digest": b"o" * 32}, NamespaceMismatch),
    ({"page_key": b"o" * 32}, PageKeyMismatch),
    ({"page_index": 4}, PageIndexMismatch),
    ({"token_count": 15}, LengthMismatch),
    ({"payload_len": len(PAYLOAD) + 4}, LengthMismatch),
])
def test_a_page_read_for_another_place_is_refused(change, error):
    blob = encode_page(HEADER, PAYLOAD)
    with pytest.raises(error):
        decode_page(blob, dataclasses.replace(HEADER, **change))


@pytest.mark.parametrize("offset", [HEADER_SIZE, HEADER_SIZE + 500, HEADER_SIZE + len(PAYLOAD) - 1])
def test_a_flipped_payload_byte_fails_the_checksum(offset):
    blob = bytearray(encode_page(HEADER, PAYLOAD))
    blob[offset] ^= 0x01
    with pytest.raises(ChecksumMismatch):
        decode_page(blob, HEADER)


def test_truncated_bad_magic_and_unknown_version_are_refused():
    blob = encode_page(HEADER, PAYLOAD)
    with pytest.raises(TruncatedPage):
        decode_page(blob[:-1], HEADER)
    with pytest.raises(TruncatedPage):
        decode_page(blob[:HEADER_SIZE - 1], HEADER)
    with pytest.raises(BadMagic):
        decode_page(b"XXXX" + blob[4:], HEADER)
    with pytest.raises(VersionMismatch):
        decode_page(blob[:4] + struct.pack("<H", 99) + blob[6:], HEADER)


def test_encode_refuses_a_payload_of_the_wrong_length():
    with pytest.raises(LengthMismatch):
        encode_page(HEADER, PAYLOAD[:-1])
