"""Page hashes of other engines, for interoperating with their caches and events.

- SGLang HiCache (``sglang/srt/mem_cache``, ``get_hash_str``): page ``i``'s key is the hex
  SHA-256 of (raw digest of page ``i-1``, absent for the first page) followed by the
  page's token ids as 4-byte little-endian unsigned integers.
- vLLM v1 prefix caching with ``sha256_cbor`` (``vllm/v1/core/kv_cache_utils.py``,
  ``hash_block_tokens``): block ``i``'s hash is SHA-256 of the canonical CBOR encoding
  of the 3-tuple ``(parent hash, tuple of token ids, extra keys or None)``; the first
  block's parent is ``NONE_HASH = sha256_cbor(PYTHONHASHSEED string)`` (a fixed seed;
  vLLM draws 32 random bytes when the variable is unset, which no other process can
  reproduce).

kvpool's own keys (``keys.page_keys``) differ from both on purpose: they start from the
namespace digest, so they are never shared across models, ranks or tenants.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from kvpool.cache.keys import page_token_bytes
from kvpool.errors import InvalidParams


def sglang_page_hashes(token_ids: Sequence[int], page_size: int) -> list[str]:
    """SGLang HiCache page keys (64-char hex strings) of the full pages of ``token_ids``."""
    keys, prior = [], b""
    for page in page_token_bytes(token_ids, page_size):
        digest = hashlib.sha256(prior + page).digest()
        keys.append(digest.hex())
        prior = digest
    return keys


def vllm_none_hash(hash_seed: str) -> bytes:
    """vLLM's ``NONE_HASH`` for ``PYTHONHASHSEED=hash_seed`` under sha256_cbor."""
    return hashlib.sha256(cbor_encode(hash_seed)).digest()


def vllm_block_hashes(token_ids: Sequence[int], block_size: int, hash_seed: str,
                      extra_keys: Sequence[tuple | None] | None = None) -> list[bytes]:
    """vLLM v1 block hashes (32 bytes each, sha256_cbor) of the full blocks of ``token_ids``.

    ``extra_keys[i]`` is block ``i``'s extra-key tuple (LoRA name, multimodal identifiers,
    cache salt on the first block) or None; omitted means None for every block.
    """
    parent = vllm_none_hash(hash_seed)
    hashes = []
    for i in range(len(token_ids) // block_size):
        block = tuple(int(t) for t in token_ids[i * block_size:(i + 1) * block_size])
        extra = extra_keys[i] if extra_keys is not None else None
        parent = hashlib.sha256(cbor_encode((parent, block, extra))).digest()
        hashes.append(parent)
    return hashes


def cbor_encode(value) -> bytes:
    """CBOR (RFC 8949) with preferred serialization, for None, bool, int, bytes, str,
    tuple and list: the subset vLLM's block hashes use. Raises InvalidParams otherwise."""
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def _encode(value, out: bytearray) -> None:
    if value is None:
        out.append(0xF6)
    elif value is True or value is False:
        out.append(0xF5 if value else 0xF4)
    elif isinstance(value, int):
        if value >= 0:
            _head(0, value, out)
        else:
            _head(1, -1 - value, out)
    elif isinstance(value, (bytes, bytearray)):
        _head(2, len(value), out)
        out += value
    elif isinstance(value, str):
        data = value.encode()
        _head(3, len(data), out)
        out += data
    elif isinstance(value, (tuple, list)):
        _head(4, len(value), out)
        for item in value:
            _encode(item, out)
    else:
        raise InvalidParams(f"cannot CBOR-encode {type(value).__name__}")


def _head(major: int, arg: int, out: bytearray) -> None:
    """Major type and argument in the shortest form (RFC 8949 section 3)."""
    if arg < 24:
        out.append(major << 5 | arg)
    elif arg < 1 << 8:
        out += bytes((major << 5 | 24, arg))
    elif arg < 1 << 16:
        out += bytes((major << 5 | 25,)) + struct.pack(">H", arg)
    elif arg < 1 << 32:
        out += bytes((major << 5 | 26,)) + struct.pack(">I", arg)
    elif arg < 1 << 64:
        out += bytes((major << 5 | 27,)) + struct.pack(">Q", arg)
    else:
        raise InvalidParams("CBOR integers are limited to 64 bits here")
