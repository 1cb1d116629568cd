"""The multi-host tier: hosts as network namespaces (``netns_hosts.Cluster``) on one bridge.

One cluster for the session (``hosts``): ``ctl`` (etcd and the controller) and ``node1`` ..
``node3``. ``net`` is the same cluster for one test, healed after it whatever the test did. At
the end of the session everything is removed and checked gone (no namespace, link, nftables
table, process or mount of the cluster): a leftover fails the session's last test. Where
namespaces cannot be made (not root, no ``ip netns``) every test here skips with one line.
"""

from __future__ import annotations

import pytest
from netns_hosts import Cluster, unavailable

HOSTS = ["ctl", "node1", "node2", "node3"]


@pytest.fixture(scope="session")
def hosts():
    why = unavailable()
    if why:
        pytest.skip(why)
    cluster = Cluster(HOSTS)
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()
        left = cluster.leftovers()
        assert not left, f"the multi-host cluster left {left} behind"


@pytest.fixture
def net(hosts):
    """The session's hosts, every fault healed and every process killed after the test."""
    try:
        yield hosts
    finally:
        hosts.heal()
        for host in hosts.names:
            hosts.kill_all(host)
