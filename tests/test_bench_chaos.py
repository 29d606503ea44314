"""``kvpool bench chaos``: a short seeded run (every kind of kill at least once) returns
no wrong bytes, loses no committed object with a surviving replica and leaks nothing;
the value check it relies on catches another key's bytes and torn bytes."""

from __future__ import annotations

import pytest

from kvpool.bench.chaos import KINDS, chaos, check_value, encode_value
from kvpool.launch_ha import etcd_binary


def test_value_check_catches_wrong_and_torn_bytes():
    v = encode_value("a/1", b"x" * 100)
    assert check_value("a/1", v)
    assert not check_value("a/2", v)  # another key's value
    assert not check_value("a/1", v[:-1])  # torn
    assert not check_value("a/1", v[:-1] + b"y")  # altered
    assert not check_value("a/1", b"")


@pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (apt-get install etcd-server)")
def test_short_chaos_run_loses_nothing(tmp_path):
    report = chaos(minutes=0.5, seed=7, num_clients=2, gap_s=4.0)
    assert {k.what for k in report.kills} == set(KINDS), report.kills
    assert report.checked > 0
    assert report.wrong_bytes == 0
    assert report.lost == 0, report.lost_keys
    assert report.leaked_bytes == 0
    assert all(k.outage_s is not None for k in report.kills)
