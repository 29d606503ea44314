"""Error codes and exceptions shared by every layer of kvpool.

The integers are those of Mooncake Store's ``ErrorCode`` enum
(mooncake-store/include/types.h), so code written against
``MooncakeDistributedStore`` sees the same return values on kvpool's facade.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Mooncake-compatible error integers (0 is success, all errors negative)."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SHARD_INDEX_OUT_OF_RANGE = -100
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    CLIENT_NOT_FOUND = -103
    NO_AVAILABLE_HANDLE = -200
    INVALID_VERSION = -300
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    OBJECT_HAS_REPLICATION_TASK = -708
    OBJECT_NO_REPLICATION_TASK = -709
    REPLICA_NOT_FOUND = -710
    REPLICA_ALREADY_EXISTS = -711
    REPLICA_IS_GONE = -712
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    ETCD_OPERATION_ERROR = -1000
    ETCD_KEY_NOT_EXIST = -1001
    ETCD_TRANSACTION_FAIL = -1002
    ETCD_CTX_CANCELLED = -1003
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    UNAVAILABLE_IN_CURRENT_MODE = -1011
    FILE_NOT_FOUND = -1100
    FILE_OPEN_FAIL = -1101
    FILE_READ_FAIL = -1102
    FILE_WRITE_FAIL = -1103
    FILE_INVALID_BUFFER = -1104
    FILE_LOCK_FAIL = -1105
    FILE_INVALID_HANDLE = -1106


class KVPoolError(Exception):
    """Base of every kvpool error; ``code`` is the :class:`ErrorCode` it carries."""

    code: ErrorCode = ErrorCode.INTERNAL_ERROR

    def __init__(self, message: str = "", code: ErrorCode | int | None = None):
        if code is not None:
            self.code = ErrorCode(code)
        super().__init__(message or self.code.name)


class UserError(KVPoolError):
    """A mistake of the person at the CLI (bad path, bad size): printed, no traceback."""

    code = ErrorCode.INVALID_PARAMS


_BY_CODE: dict[ErrorCode, type[KVPoolError]] = {}


def _wire_error(name: str, code: ErrorCode, doc: str) -> type[KVPoolError]:
    """The KVPoolError subclass ``name`` for ``code``, and the one :func:`raise_for` raises
    when a peer replies with ``code``."""
    cls = type(name, (KVPoolError,), {"code": code, "__doc__": doc, "__module__": __name__})
    _BY_CODE[code] = cls
    return cls


InvalidParams = _wire_error("InvalidParams", ErrorCode.INVALID_PARAMS,
                            "Bad arguments: a key, size or option that can never succeed.")
NoSpace = _wire_error("NoSpace", ErrorCode.NO_AVAILABLE_HANDLE,
                      "No segment has room for the value (NO_AVAILABLE_HANDLE).")
ObjectNotFound = _wire_error("ObjectNotFound", ErrorCode.OBJECT_NOT_FOUND,
                             "The key is not stored.")
ObjectExists = _wire_error("ObjectExists", ErrorCode.OBJECT_ALREADY_EXISTS,
                           "The key is already stored (a put without overwrite).")
ObjectHasLease = _wire_error("ObjectHasLease", ErrorCode.OBJECT_HAS_LEASE,
                             "The object is held by a read lease (remove without force).")
LeaseExpired = _wire_error("LeaseExpired", ErrorCode.LEASE_EXPIRED,
                           "A read took longer than its lease: its bytes may be reused.")
TransferFailed = _wire_error("TransferFailed", ErrorCode.TRANSFER_FAIL,
                             "Moving the bytes to or from a node failed.")
RpcFailed = _wire_error("RpcFailed", ErrorCode.RPC_FAIL,
                        "The master or a node could not be reached or answered garbage.")
BufferOverflow = _wire_error("BufferOverflow", ErrorCode.BUFFER_OVERFLOW,
                             "A destination buffer is smaller than the value.")
ObjectNotReady = _wire_error("ObjectNotReady", ErrorCode.REPLICA_IS_NOT_READY,
                             "Another put of the key is still in flight (REPLICA_IS_NOT_READY).")


_BY_VALUE: dict[int, ErrorCode] = {c.value: c for c in ErrorCode}


def code_of(code: int, unknown: ErrorCode = ErrorCode.INTERNAL_ERROR) -> ErrorCode:
    """``code`` as an :class:`ErrorCode`; ``unknown`` for an integer this version does
    not know (a peer of a newer release may send one). A dict lookup, not
    ``ErrorCode(code)`` (an Enum call costs ~0.7 us; a batch of 128 puts makes 256)."""
    return _BY_VALUE.get(code, unknown)


def code_name(code: int) -> str:
    """The ErrorCode name of ``code`` ("OBJECT_NOT_FOUND"), or the integer as text for
    one this version does not know ("-12345"), so a log or metric label never lies."""
    known = code_of(code, ErrorCode.OK)
    return known.name if known == code else str(code)


def raise_for(code: int, message: str = "") -> None:
    """Raise the specific :class:`KVPoolError` subclass for ``code``; return if OK.
    An integer this version does not know is still an error (INTERNAL_ERROR)."""
    if code == ErrorCode.OK:
        return
    known = code_of(code)
    raise _BY_CODE.get(known, KVPoolError)(message or code_name(code), known)
