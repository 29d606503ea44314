"""A reduced fuzzing run (kvpool.bench.fuzz; `kvpool bench fuzz --inputs 100000` is the
full one): generated hostile inputs against the master's and a node's ports and both
admin HTTP servers, while a well-behaved client checks its answers."""

from __future__ import annotations

from kvpool.bench.fuzz import TARGETS, fuzz

CI_INPUTS = 200  # per target


def test_servers_survive_generated_inputs_and_a_client_is_served_correctly():
    report = fuzz(CI_INPUTS)
    assert report.inputs == {t: CI_INPUTS for t in TARGETS}
    assert report.crashes == []
    assert report.errors == [], report.errors[:5]
    assert report.checks > 0
    assert report.peak_rss["master"] < 1 << 30 and report.peak_rss["node"] < 1 << 30
