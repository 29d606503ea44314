"""Namespaces a run killed with -9 left behind are removed by the next set made
(kvpool.netns: Claim, sweep_abandoned_sets); a live set is never touched. Real
namespaces, a real kill -9. Needs root; skipped with the reason otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import proc_helpers
import pytest

from kvpool.netns import CLAIM_PREFIX, Hosts, sweep_abandoned_sets, unavailable

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"network namespaces not available: {WHY}")

_MAKER = """
import sys, time
from kvpool.netns import Hosts
{make}
print("ready", flush=True)
time.sleep(600)
"""
_HOSTS = "Hosts(sys.argv[1], 2, net=int(sys.argv[2])).create()"
_PAIR = "from kvpool.bench.systems.netns import VethPair; VethPair(sys.argv[1]).create()"


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _claims() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob(CLAIM_PREFIX + "*")}


def _killed_maker(make: str, tag: str) -> None:
    """Run a process that makes a set, and kill -9 it once it has."""
    proc = subprocess.Popen([sys.executable, "-c", _MAKER.format(make=make), tag, str(150 + os.getpid() % 50)],
                            stdout=subprocess.PIPE, text=True, env=proc_helpers.kvpool_env())
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


@pytest.mark.parametrize("make, names", [(_HOSTS, ("-hub", "-h0", "-h1")), (_PAIR, ("-s", "-c"))],
                         ids=["hosts", "veth-pair"])
def test_a_set_left_by_a_killed_run_is_removed_by_the_next_sweep(make, names):
    tag = f"kvs{os.getpid() % 100000}"
    wanted = {(f"kvb-{tag}" if make == _PAIR else tag) + suffix for suffix in names}
    claims_before = _claims()
    _killed_maker(make, tag)
    assert wanted <= _namespaces()  # nothing cleaned up after a kill -9
    left = _claims() - claims_before
    assert len(left) == 1
    assert sweep_abandoned_sets() >= 1
    assert not wanted & _namespaces()
    assert not left & _claims()


def test_a_live_set_is_not_swept():
    tag = f"kvl{os.getpid() % 100000}"
    with Hosts(tag, 1, net=100 + os.getpid() % 50) as hosts:
        sweep_abandoned_sets()
        assert {hosts.hub, *hosts.names} <= _namespaces()
    assert not {hosts.hub, *hosts.names} & _namespaces()  # and deleted on exit, record included
