"""Shared fixtures: real kvpool clusters (master + node processes on 127.0.0.1).

- ``cluster``: a fresh cluster per test; configure with
  ``@pytest.mark.cluster(segment_size="64MiB", lease_ttl_ms=500, num_nodes=2,
  extra_master_args=[...])`` (keyword arguments of :class:`kvpool.launch.Cluster`).
- ``module_cluster``: one cluster per test module (64 MiB segment, 10 s lease).
- ``client``: a :class:`kvpool.client.Client` on ``module_cluster``; every object is
  force-removed after the test so tests sharing the cluster stay independent.
"""

from __future__ import annotations

import signal
import threading

import pytest

from kvpool.client import Client
from kvpool.launch import Cluster

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
