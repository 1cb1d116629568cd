"""The control plane across hosts: etcd and the controller on ``ctl``, one agent on each of
``node1`` and ``node2``, their ranks rendezvousing and training over gloo across the bridge, the
checkpoints in the shared run directory. The job must end with the parameters of the same job
run on one host (the ``reference`` fixture), and every listener of every host must be bound to
that host's own address."""

from __future__ import annotations

import threading
import time

import pytest
from multihost_job import OVERRIDES, STEPS, MultiHostJob

from megascale.config import load
from megascale.controller.events import read_events
from megascale.launcher.outcome import parameter_digest

pytestmark = pytest.mark.slow


class ListenerWatch(threading.Thread):
    """Every listening TCP socket of every host, sampled until ``stop``."""

    def __init__(self, cluster) -> None:
        super().__init__(daemon=True)
        self.cluster, self.seen, self.done = cluster, {}, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            for host in self.cluster.names:
                self.seen.setdefault(host, set()).update(self.cluster.listeners(host))


def test_job_across_hosts_matches_the_single_host_run(net, tmp_path, reference):
    job = MultiHostJob(net, tmp_path / "multi", ["node1", "node2"], nodes=2, overrides=OVERRIDES)
    watch = ListenerWatch(net)
    try:
        job.start()
        watch.start()
        rc = job.wait(240)
    finally:
        watch.done.set()
        job.stop()
    assert rc == 0, job.tail("controller")
    digest, step = parameter_digest(job.run_dir, load("tiny", OVERRIDES))
    assert (digest, step) == (reference, STEPS)
    wrong = {
        host: sorted(a for a in seen if a[0] != net.addr(host)) for host, seen in watch.seen.items()
    }
    assert not any(wrong.values()), f"listeners not on their host's address: {wrong}"
    print("listeners seen:", {h: sorted(s) for h, s in watch.seen.items()})
    # etcd's client URL (its peer URL is a private unix socket), and on each node at least its
    # agent's /metrics
    assert (net.addr("ctl"), 2379) in watch.seen["ctl"]
    assert watch.seen["node1"] and watch.seen["node2"]


def test_a_host_without_the_jobs_credentials_can_neither_read_nor_write_its_keys(net, tmp_path):
    """etcd on the cluster network trusts nobody by address: from a host of the cluster, a
    client without the job's password is refused a read and a forged eviction (the stop command
    the controller writes to a node), and the key stays unwritten."""
    job = MultiHostJob(net, tmp_path / "multi", ["node1", "node2"], 2, OVERRIDES)
    try:
        job.start_etcd()
        from megascale.etcd.keys import JobKeys

        key = JobKeys(job.job_id).command("node1")
        forged = job.etcdctl("put", key, '{"kind": "stop"}', host="node2", auth=False)
        read = job.etcdctl("get", "--prefix", "/", host="node2", auth=False)
        stored = job.etcdctl("get", key, host="node2")
    finally:
        job.stop()
    for answer in (forged, read):
        assert "user name is empty" in answer or "permission denied" in answer, answer
    assert key not in stored, stored


def test_host_names_that_resolve_to_loopback_do_not_misroute_gloo(net, tmp_path, reference):
    """Debian's own /etc/hosts names the machine 127.0.1.1, and gloo, left alone, binds the
    address the host name resolves to: every rank would then dial its peers at loopback. The
    workers bind gloo to the interface that holds their agent's --addr instead."""
    saved = {h: net.etc(h).joinpath("hosts").read_text() for h in ("node1", "node2")}
    try:
        for host in saved:
            net.etc(host).joinpath("hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {host}\n")
        assert net.exec("node1", ["getent", "hosts", "node1"]).split()[0] == "127.0.1.1"
        job = MultiHostJob(net, tmp_path / "multi", ["node1", "node2"], 2, OVERRIDES)
        try:
            job.start()
            rc = job.wait(240)
        finally:
            job.stop()
    finally:
        for host, text in saved.items():
            net.etc(host).joinpath("hosts").write_text(text)
    assert rc == 0, job.tail("controller")
    assert parameter_digest(job.run_dir, load("tiny", OVERRIDES)) == (reference, STEPS)


def test_partitioned_worker_host_is_replaced_by_the_spare(net, tmp_path, reference):
    """The host of rank 1 is partitioned mid-run: its agent's lease lapses, the controller evicts
    it, the spare node3 takes its ranks, the job resumes from the last checkpoint and ends with
    the fault-free parameters. Prints the detection and fault-to-resumed times."""
    job = MultiHostJob(net, tmp_path / "multi", ["node1", "node2", "node3"], 2, OVERRIDES)
    try:
        job.start()
        deadline = time.monotonic() + 180
        while not any(r["step"] >= 6 for r in job.steps()):
            assert job.procs["controller"].poll() is None, job.tail("controller")
            assert time.monotonic() < deadline, "the job did not reach step 6"
            time.sleep(0.02)
        first = next(e for e in read_events(job.run_dir) if e.kind == "generation_start")
        victim = first.detail["nodes"][1]  # rank 1's host (rank 0's holds the run directory)
        net.partition(victim)
        fault_time = time.time()
        rc = job.wait(240)
    finally:
        job.stop(grace_s=5)
    assert rc == 0, job.tail("controller")
    assert parameter_digest(job.run_dir, load("tiny", OVERRIDES)) == (reference, STEPS)
    after = [e for e in read_events(job.run_dir) if e.time >= fault_time]
    lost = next(e for e in after if e.node == victim)
    assert lost.kind == "fault" and lost.detail["fault"] == "node_lost", lost
    restart = next(e for e in after if e.kind == "generation_start")
    assert restart.detail["replaced"] == {victim: "node3"}, restart
    resumed = next(r for r in job.steps() if r["time"] > restart.time)
    print(
        f"partition {victim} (rank 1) at step >= 6: {lost.kind} after "
        f"{lost.time - fault_time:.2f} s, generation {restart.generation} on "
        f"{restart.detail['nodes']} after {restart.time - fault_time:.2f} s, first step "
        f"(step {resumed['step']}) after {resumed['time'] - fault_time:.2f} s; "
        f"events: {[e.kind for e in after]}"
    )
