"""The multi-host tier: hosts as network namespaces (``netns_hosts.Cluster``) on one bridge.

One cluster for the session (``hosts``): ``ctl`` (etcd and the controller) and ``node1`` ..
``node3``. ``net`` is the same cluster for one test, healed after it whatever the test did. At
the end of the session everything is removed and checked gone (no namespace, link, nftables
table, process or mount of the cluster): a leftover fails the session's last test. Where
namespaces cannot be made (not root, no ``ip netns``) every test here skips with one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from multihost_job import OVERRIDES, REPO, STEPS
from netns_hosts import Cluster, reap_stale, unavailable

from megascale.launcher.outcome import read_final

HOSTS = ["ctl", "node1", "node2", "node3"]


@pytest.fixture(autouse=True)
def _hosts_can_be_made():
    """Every test of this tier skips, with the one reason, where hosts cannot be made."""
    why = unavailable()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="session")
def hosts():
    why = unavailable()  # session fixtures are set up before the autouse one above
    if why:
        pytest.skip(why)
    reap_stale()  # a run killed before its teardown (e.g. by a timeout) left these
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


@pytest.fixture(scope="session")
def reference(hosts, tmp_path_factory) -> str:
    """The final parameter digest of the multi-host tests' job (``multihost_job.OVERRIDES``, 2
    nodes x 1 rank, so every rank has the same thread count) run fault-free by ``megascale
    launch`` on this one host, over loopback (~20 s)."""
    run_dir = tmp_path_factory.mktemp("single")
    sets = [a for o in OVERRIDES for a in ("--set", o)]
    cmd = [sys.executable, "-m", "megascale.cli", "launch", "tiny", *sets, "--nodes", "2",
           "--nproc-per-node", "1", "--heartbeat-interval", "0.5", "--selfcheck", "builtin",
           "--timeout", "240", "--run-dir", str(run_dir)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGASCALE_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    final = read_final(Path(run_dir))
    assert final.finished and final.digest_step == STEPS, final
    return final.param_digest
