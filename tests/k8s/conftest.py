"""Fixtures of the Kubernetes tests: the example resources, a recording fake of the Kubernetes
API, and a real etcd (the operator's status mirror reads it through the real ``Store``)."""

from __future__ import annotations

import pytest
from k8s_support import FakeKube

from megascale.etcd.server import EmbeddedEtcd
from megascale.etcd.store import Store, StoreConfig


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()


@pytest.fixture(scope="module")
def etcd():
    """A real single-member etcd on free loopback ports (fast test flags)."""
    with EmbeddedEtcd(unsafe_no_fsync=True) as server:
        yield server


@pytest.fixture
def store(etcd):
    client = Store(StoreConfig.parse(etcd.endpoint, retry_s=5.0))
    yield client
    client.close()
