"""The launcher's supervisor with a real embedded etcd: a killed etcd is started again from its
data directory on its ports, with its data; one that cannot be started again within the grace
time stops the job with that reason."""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass, field

import pytest

from megascale.etcd.server import EmbeddedEtcd
from megascale.etcd.store import Store, StoreConfig
from megascale.launcher.supervise import Supervisor

pytestmark = pytest.mark.slow


@dataclass
class _Cluster:
    """What the supervisor reads of a ``LocalCluster``: its etcd, its controllers (none here:
    this test is about etcd), the job's state (as if ended, so no controller is started)."""

    etcd: EmbeddedEtcd
    controllers: dict = field(default_factory=dict)

    def job_state(self) -> str:
        return "finished"


def test_killed_etcd_is_restarted_with_its_data_or_the_job_stopped_with_the_reason():
    with EmbeddedEtcd(unsafe_no_fsync=True) as etcd:
        store = Store(StoreConfig.parse(etcd.endpoint, retry_s=5.0))
        store.put("/megascale/test/kept", {"v": 1})
        supervisor = Supervisor(_Cluster(etcd), etcd_grace_s=0.0)
        _kill(etcd)
        assert supervisor.check() is None  # started again
        assert etcd.running and store.get("/megascale/test/kept").json() == {"v": 1}
        store.close()
        _kill(etcd)
        with socket.socket() as squatter:  # its client port taken: it cannot start again
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", etcd.client_port))
            squatter.listen()
            reason = supervisor.check()
        assert reason is not None and reason.startswith("etcd exited and could not be started")


def _kill(etcd: EmbeddedEtcd) -> None:
    os.kill(etcd.pid, signal.SIGKILL)
    while etcd.running:
        time.sleep(0.01)
