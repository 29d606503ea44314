"""Keys of the store: what a valid key is (checked before anything is sent)."""

from __future__ import annotations

from kvpool.errors import InvalidParams
from kvpool.protocol import MAX_KEY_BYTES


def check_key(key: str) -> None:
    """Raise InvalidParams unless ``key`` is a str of 1..MAX_KEY_BYTES (4096) UTF-8 bytes."""
    if isinstance(key, str) and key.isascii() and 0 < len(key) <= MAX_KEY_BYTES:
        return  # the usual key, without encoding it (an ASCII char is one UTF-8 byte)
    try:
        size = len(key.encode("utf-8")) if isinstance(key, str) else 0
    except UnicodeEncodeError:  # lone surrogates cannot go on the wire
        size = 0
    if not 0 < size <= MAX_KEY_BYTES:
        raise InvalidParams(f"key must be a str of 1..{MAX_KEY_BYTES} UTF-8 bytes, got {key!r:.80}")


def key_list(keys) -> list:
    """``keys`` (any iterable: a list, a tuple, a generator) as a list, the keys not yet
    checked. Raises InvalidParams for one str, bytes or bytearray given as the list
    (``batch_get("ab")`` would otherwise ask for keys "a" and "b") and for what is not
    iterable (None: a TypeError before). Callers use the list returned: a generator
    can be read once."""
    if isinstance(keys, (str, bytes, bytearray)):
        raise InvalidParams(f"keys must be a list of str, not one {type(keys).__name__} ({keys!r:.80})")
    try:
        return list(keys)
    except TypeError:  # None, a number: the same error as any other bad key
        raise InvalidParams(f"keys must be a list of str, not {type(keys).__name__} ({keys!r:.80})") from None


def check_keys(keys) -> list[str]:
    """:func:`key_list` of ``keys`` with each key checked (:func:`check_key`). Raises
    InvalidParams."""
    keys = key_list(keys)
    for key in keys:
        check_key(key)
    return keys
