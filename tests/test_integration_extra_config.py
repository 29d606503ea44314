"""An engine's extra config for kvpool: flags read strictly, unknown keys named."""

from __future__ import annotations

import logging

import pytest

from kvpool.errors import UserError
from kvpool.integrations.extra_config import flag, master, number, warn_unknown, whole
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


@pytest.mark.parametrize("value, why", [
    (0, "must be > 0, got 0"), (-1, "must be > 0, got -1"), ("nan", "must be a finite number, got 'nan'"),
    (float("inf"), "got inf"), ("ten", "must be a number, got 'ten'"), (True, "got True"),
])
def test_a_timeout_that_cannot_work_is_refused_naming_its_key(value, why):
    """Found by a trial: timeout_s -1 or 0 started vLLM, then every call was reported as
    a kvpool outage; retry_s "nan" never reconnected; "ten" was a bare ValueError."""
    with pytest.raises(UserError, match=f"timeout_s {why}" if "must" in why else why):
        number({"timeout_s": value}, "timeout_s", 10.0)


def test_numbers_in_range_and_their_defaults_pass():
    assert number({"timeout_s": "2.5"}, "timeout_s", 10.0) == 2.5
    assert number({"timeout_s": None}, "timeout_s", 10.0) == 10.0
    assert number({"link_delay_ms": 0}, "link_delay_ms", 1.0, zero_ok=True) == 0.0
    assert whole({"save_queue": "4"}, "save_queue", 8) == 4
    assert whole({}, "metrics_port", 0, lowest=0, highest=65535) == 0


@pytest.mark.parametrize("value", [0, -1, 2.5, "two", True, 70000])
def test_a_count_or_port_out_of_range_is_refused(value):
    with pytest.raises(UserError, match="replica_num must be an integer 1..16"):
        whole({"replica_num": value}, "replica_num", 1, highest=16)


def test_a_master_without_a_port_is_refused_and_a_good_one_made_canonical():
    with pytest.raises(UserError, match="master: address '127.0.0.1' needs a port"):
        master({"master": "127.0.0.1"}, "master")
    with pytest.raises(UserError, match='needs "master": "host:port"'):
        master({}, "master")
    assert master({}, "master", "127.0.0.1:50051") == "127.0.0.1:50051"
    assert master({"master": " h1:1,h2:2 "}, "master") == "h1:1,h2:2"
