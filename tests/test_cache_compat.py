"""SGLang and vLLM page hashes, checked against encodings written out by hand here."""

import hashlib
import struct

import pytest

from kvpool.cache.compat import cbor_encode, sglang_page_hashes, vllm_block_hashes, vllm_none_hash


def test_sglang_page_hash_chain():
    tokens = [1, 2, 3, 4, 70000, 6, 7, 8, 9]
    first = hashlib.sha256(struct.pack("<4I", 1, 2, 3, 4)).digest()  # no prior for page 0
    second = hashlib.sha256(first + struct.pack("<4I", 70000, 6, 7, 8)).digest()
    assert sglang_page_hashes(tokens, 4) == [first.hex(), second.hex()]


def test_vllm_none_hash_is_sha256_of_the_cbor_seed_string():
    assert vllm_none_hash("0") == hashlib.sha256(b"\x61\x30").digest()  # CBOR text "0"


def test_vllm_block_hash_chain_with_hand_written_cbor():
    none = hashlib.sha256(b"\x61\x30").digest()
    # (parent: bytes(32), (1, 2, 500, 24): array of uint, None)
    block0 = b"\x83\x58\x20" + none + b"\x84\x01\x02\x19\x01\xf4\x18\x18" + b"\xf6"
    h0 = hashlib.sha256(block0).digest()
    # second block with extra keys ("lora-a",)
    block1 = b"\x83\x58\x20" + h0 + b"\x84\x05\x06\x07\x08" + b"\x81\x66lora-a"
    h1 = hashlib.sha256(block1).digest()
    got = vllm_block_hashes([1, 2, 500, 24, 5, 6, 7, 8, 9], 4, "0", [None, ("lora-a",)])
    assert got == [h0, h1]


def test_cbor_encoding_matches_cbor2_when_installed():
    cbor2 = pytest.importorskip("cbor2")
    for value in [None, 0, 23, 24, 255, 256, 65536, 2**32, -1, -500, b"", b"x" * 300, "héllo",
                  (b"\x00" * 32, tuple(range(300)), ("a", 1)), [True, False]]:
        assert cbor_encode(value) == cbor2.dumps(value, canonical=True)
