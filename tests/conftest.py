"""Shared fixtures: real kvpool clusters (master + node processes on 127.0.0.1).

- ``cluster``: a fresh cluster per test; configure with
  ``@pytest.mark.cluster(segment_size="64MiB", lease_ttl_ms=500, num_nodes=2,
  extra_master_args=[...])`` (keyword arguments of :class:`kvpool.launch.Cluster`).
- ``module_cluster``: one cluster per test module (64 MiB segment, 10 s lease).
- ``client``: a :class:`kvpool.client.Client` on ``module_cluster``; every object is
  force-removed after the test so tests sharing the cluster stay independent.

A launcher keeps its logs when a child failed, and cannot tell a failure from a child a
test killed on purpose: the logs kept during a test that passed are removed after it
(those of a failed test stay, for reading).
"""

from __future__ import annotations

import shutil
import signal
import threading
from pathlib import Path

import pytest

from kvpool.client import Client
from kvpool.launch import WORKDIR_PREFIX, Cluster
from kvpool.owned_dir import OwnedDir

DEFAULTS = {"segment_size": "64MiB", "lease_ttl_ms": 10_000}


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster(**kwargs): arguments of the `cluster` fixture's Cluster")


@pytest.fixture
def cluster(request):
    marker = request.node.get_closest_marker("cluster")
    kwargs = {**DEFAULTS, **(marker.kwargs if marker else {})}
    with Cluster(**kwargs) as c:
        yield c


@pytest.fixture(scope="module")
def module_cluster():
    with Cluster(**DEFAULTS) as c:
        yield c


@pytest.fixture
def client(module_cluster):
    with Client(module_cluster.master_addr) as c:
        yield c
        c.remove_all(force=True)


@pytest.fixture(autouse=True)
def _sigint_restored():
    """Give every test Python's own SIGINT handler back: ``kvpool.cli.main`` ignores SIGINT
    once it has reported an interrupt (the process is winding down), and an ignored
    SIGINT is inherited by every child a later test starts."""
    yield
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.kvpool_passed = report.passed


@pytest.fixture(autouse=True)
def _logs_of_passing_tests_dropped(request, monkeypatch):
    """Remove the cluster logs this process kept during a test that passed (see the
    module docstring); other processes' folders, and a failed test's, stay."""
    kept: list[Path] = []
    keep = OwnedDir.keep

    def recorded(self):
        keep(self)
        kept.append(self.path)

    monkeypatch.setattr(OwnedDir, "keep", recorded)
    yield
    if getattr(request.node, "kvpool_passed", False):
        for folder in kept:
            if folder.name.startswith(WORKDIR_PREFIX):
                shutil.rmtree(folder, ignore_errors=True)
