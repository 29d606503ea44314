"""Errors of the native Client say what is wrong: the bad value and what would be right."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.errors import BufferOverflow, ErrorCode, InvalidParams


def test_pin_with_an_unknown_mode_names_it_and_the_valid_ones(client):
    client.put("pk", b"v")
    with pytest.raises(InvalidParams) as info:
        client.pin("pk", "medium")
    message = str(info.value)
    assert "'medium'" in message and "unknown" in message
    assert all(mode in message for mode in ("hard", "soft", "none"))
    client.pin("pk", "soft")  # the valid modes still work


def test_buffer_overflow_gives_both_sizes_on_every_raising_into_path(client):
    client.put("big", b"x" * 100)
    small = bytearray(40)
    with pytest.raises(BufferOverflow, match="100 bytes.*40 bytes"):
        client.get_into("big", small)
    with pytest.raises(BufferOverflow, match="100 bytes.*40 bytes"):
        client.read_into(client.query("big"), np.zeros(40, dtype=np.uint8))
    reg = client.register_buffer(bytearray(40))
    with pytest.raises(BufferOverflow, match="100 bytes.*40 bytes"):
        client.get_into("big", reg)
    # batch forms answer one code per item (the sizes are the caller's own buffers)
    assert client.batch_get_into(["big"], [small]) == [ErrorCode.BUFFER_OVERFLOW]
