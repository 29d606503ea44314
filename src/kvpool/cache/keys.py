"""Page keys: a SHA-256 chain over full pages of token ids, seeded by the namespace.

``h_0 = namespace.digest()`` and ``h_i = SHA-256(h_{i-1} || uint32-LE token ids of page i)``
(the chained block hash of SGLang HiCache / vLLM prefix caching, with SHA-256 so that
keys agree across processes and hosts, never Python's ``hash()``: K16). A page's key thus
stands for the namespace and the whole prefix up to and including that page.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from kvpool.cache.namespace import Namespace
from kvpool.errors import InvalidParams

STORE_KEY_PREFIX = "kvp/"
_MAX_TOKEN = 2**32 - 1


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as uint32 little-endian bytes (4 bytes per token).

    Raises InvalidParams when an id is outside [0, 2**32).
    """
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise InvalidParams("token ids must be a flat sequence of ints")
    if arr.size and (arr.min() < 0 or arr.max() > _MAX_TOKEN):
        raise InvalidParams("token ids must be in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def page_token_bytes(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """The uint32-LE bytes of each full page (a trailing partial page is dropped)."""
    data = token_bytes(token_ids)
    step = 4 * page_size
    return [data[i:i + step] for i in range(0, len(data) - step + 1, step)]


def chain_keys(seed: bytes, pages: Sequence[bytes]) -> list[bytes]:
    """``h_i = SHA-256(h_{i-1} || pages[i])`` starting from ``h_{-1} = seed``; 32 bytes each."""
    keys, prev = [], seed
    for page in pages:
        prev = hashlib.sha256(prev + page).digest()
        keys.append(prev)
    return keys


def page_keys(ns: Namespace, token_ids: Sequence[int]) -> list[bytes]:
    """Keys of the full pages of ``token_ids`` in namespace ``ns`` (32-byte digests).

    Only full pages get a key: fewer than ``ns.page_size`` tokens give ``[]`` (K14).
    """
    return chain_keys(ns.digest(), page_token_bytes(token_ids, ns.page_size))


@dataclasses.dataclass(frozen=True)
class PageChain:
    """The page keys of one token sequence, computed once and passed to several cache
    calls (match, insert, peek) or several caches of one namespace (a router).

    Attributes:
        ns_digest: digest of the namespace the chain was computed in.
        keys: one 32-byte key per full page.
        tokens: the uint32-LE token bytes of each full page (for the collision check).
        num_tokens: tokens of the whole sequence (a partial last page included).
    """

    ns_digest: bytes
    keys: tuple[bytes, ...]
    tokens: tuple[bytes, ...]
    num_tokens: int


def page_chain(ns: Namespace, token_ids: Sequence[int]) -> PageChain:
    """:func:`page_keys` and the page token bytes of ``token_ids``, as a PageChain."""
    toks = page_token_bytes(token_ids, ns.page_size)
    digest = ns.digest()
    return PageChain(digest, tuple(chain_keys(digest, toks)), tuple(toks), len(token_ids))


def store_key(key: bytes, part: str = "") -> str:
    """The store object name of a page key: ``"kvp/<64 hex>"``, or ``"kvp/<hex>/<part>"``
    for one object of a page stored as several (one per rank, or K and V: K17)."""
    name = STORE_KEY_PREFIX + key.hex()
    return f"{name}/{part}" if part else name


def max_reusable_pages(num_tokens: int, page_size: int) -> int:
    """How many cached pages a prompt of ``num_tokens`` may reuse (K15).

    The engine needs the logits of the last prompt token, so at least one token must be
    computed: a prompt of exactly N full pages may reuse N-1 pages, any other N.
    """
    full = num_tokens // page_size
    if full and num_tokens % page_size == 0:
        return full - 1
    return full
