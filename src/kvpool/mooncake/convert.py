"""Arguments of the facade's calls turned into kvpool's, and kvpool's codes into Mooncake's.

Each conversion follows what Mooncake's pybind11 module does with the same argument
(mooncake-integration/store/store_py.cpp): a wrong type raises TypeError; a value of the
right type that kvpool cannot use becomes None, which the caller answers with -600.
"""

from __future__ import annotations

import logging

from kvpool.client import check_key
from kvpool.errors import ErrorCode, InvalidParams
from kvpool.transfer import as_byte_view
from kvpool.transfer.buffers import is_torch_tensor

log = logging.getLogger("kvpool.mooncake")

OK = 0
INVALID = int(ErrorCode.INVALID_PARAMS)


def as_key(key) -> str | None:
    """``key`` as a kvpool key (str). Bytes are decoded as UTF-8, since pybind passes
    them through as std::string; None for an empty, over-long or undecodable key;
    TypeError for any other type, as pybind raises."""
    if isinstance(key, (bytes, bytearray)):
        try:
            key = bytes(key).decode("utf-8")
        except UnicodeDecodeError:
            return None
    elif not isinstance(key, str):
        raise TypeError(f"key must be str, not {type(key).__name__}")
    try:
        check_key(key)
    except InvalidParams:
        return None
    return key


def as_keys(keys) -> list[str | None]:
    """Each of ``keys`` through :func:`as_key`. TypeError for one str, bytes or
    bytearray given as the list, as pybind raises where a list of strings belongs (it
    would otherwise be read as one-character keys: a ``batch_remove("ab")`` removing
    keys "a" and "b")."""
    if isinstance(keys, (str, bytes, bytearray)):
        raise TypeError(f"keys must be a list of str, not one {type(keys).__name__}")
    return [as_key(k) for k in keys]


def value_view(value) -> memoryview | None:
    """Byte view of a value the native client's put accepts (bytes-like, numpy array,
    CPU torch tensor of any dtype); None (-600) for one that is not C-contiguous or has
    no host memory; TypeError for an object that is no buffer at all, as pybind raises."""
    if not is_torch_tensor(value):
        try:
            memoryview(value)
        except TypeError:
            raise TypeError(f"value must be bytes-like or a tensor, not {type(value).__name__}") from None
    try:
        return as_byte_view(value)
    except InvalidParams as exc:
        log.error("value refused: %s", exc)
        return None


def as_int(name: str, value) -> int:
    """``value`` if it is an int (a pointer or a size); TypeError otherwise, bools too."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be int, not {type(value).__name__}")
    return value


def put_code(code: int) -> int:
    """Mooncake's put reports an existing key as success (the old value stays)."""
    return OK if code == ErrorCode.OBJECT_ALREADY_EXISTS else int(code)


def read_code(code: int) -> int:
    """Mooncake answers a destination smaller than the value with INVALID_PARAMS."""
    return INVALID if code == ErrorCode.BUFFER_OVERFLOW else int(code)
