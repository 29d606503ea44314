"""An engine's extra config for kvpool: flags read strictly, unknown keys named."""

from __future__ import annotations

import logging

import pytest

from kvpool.errors import UserError
from kvpool.integrations.extra_config import flag, warn_unknown
from kvpool.integrations.fetch_policy import FetchPolicy


def test_a_flag_given_as_text_means_what_it_says_and_nonsense_is_refused():
    assert flag({"force_tcp": "false"}, "force_tcp", True) is False  # bool("false") is True
    assert flag({"force_tcp": "True"}, "force_tcp", False) is True
    assert flag({"force_tcp": 0}, "force_tcp", True) is False
    assert flag({"force_tcp": None}, "force_tcp", True) is True
    assert flag({}, "force_tcp", False) is False
    with pytest.raises(UserError, match="force_tcp must be true or false, got 'maybe'"):
        flag({"force_tcp": "maybe"}, "force_tcp", False)


def test_a_misspelt_key_is_named_with_the_key_it_was_probably_meant_to_be(caplog):
    log = logging.getLogger("test.extra")
    with caplog.at_level(logging.WARNING, logger="test.extra"):
        assert warn_unknown({"mastr": "h:1", "master": "h:2", "timeout_s": 3}, frozenset({"master", "timeout_s"}),
                            log, "kv_connector_extra_config") == ["mastr"]
    assert "'mastr' is not one kvpool reads: ignored (did you mean 'master'?)" in caplog.text


def test_the_fetch_policy_can_be_switched_off_by_text():
    assert FetchPolicy.from_config({"skip_slow_fetch": "false"}, {}, "float32") is None
