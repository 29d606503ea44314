"""The one ErrorCode-to-name helper and the one key-size limit every layer uses."""

from __future__ import annotations

import pytest

from kvpool import protocol
from kvpool.client import check_key
from kvpool.errors import ErrorCode, InvalidParams, KVPoolError, ObjectNotFound, code_name, code_of, raise_for


def test_code_name_and_code_of_keep_unknown_integers_visible():
    assert (code_name(-704), code_name(0), code_name(-12345)) == ("OBJECT_NOT_FOUND", "OK", "-12345")
    assert code_of(-704) is ErrorCode.OBJECT_NOT_FOUND
    assert code_of(-12345) is ErrorCode.INTERNAL_ERROR
    assert code_of(-12345, ErrorCode.RPC_FAIL) is ErrorCode.RPC_FAIL


def test_raise_for_known_unknown_and_ok():
    raise_for(0)
    with pytest.raises(ObjectNotFound, match="OBJECT_NOT_FOUND"):
        raise_for(-704)
    with pytest.raises(KVPoolError, match="-12345") as info:
        raise_for(-12345)
    assert info.value.code is ErrorCode.INTERNAL_ERROR


def test_one_key_limit_for_client_master_and_admin():
    check_key("k" * protocol.MAX_KEY_BYTES)
    with pytest.raises(InvalidParams, match=str(protocol.MAX_KEY_BYTES)):
        check_key("k" * (protocol.MAX_KEY_BYTES + 1))
