"""Fixtures for the fault tier: one real etcd per test module, started with fast test flags."""

from __future__ import annotations

import re

import pytest

from megascale.etcd.keys import JobKeys
from megascale.etcd.server import EmbeddedEtcd
from megascale.etcd.store import Store, StoreConfig


@pytest.fixture(scope="module")
def etcd():
    """A single-member etcd on free loopback ports: raft heartbeat 10 ms, election timeout
    100 ms (healthy in ~0.1 s, 1 s leases honoured), no fsync."""
    with EmbeddedEtcd(unsafe_no_fsync=True) as server:
        yield server


@pytest.fixture
def store(etcd):
    """A client of the module's etcd that gives up after 5 s of unavailability."""
    client = Store(StoreConfig.parse(etcd.endpoint, retry_s=5.0))
    yield client
    client.close()


@pytest.fixture
def job(request) -> JobKeys:
    """Keys of a job named after the test, so tests sharing one etcd never see each other."""
    return JobKeys(re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:100])
