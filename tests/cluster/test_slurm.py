"""A real Slurm across the hosts (``slurm_hosts.Slurm``: slurmctld on ``ctl``, slurmd on
``node1`` and ``node2``, munge) runs the multi-host tests' job with the recipe of
docs/slurm.md: ``srun`` starts one ``torchrun`` per node (c10d rendezvous at the first node's
address), each running ``megascale train`` as one rank; the run directory is shared. The job
must end with the parameters of the same job run on one host (the ``reference`` fixture)."""

from __future__ import annotations

import os
import sys
import time

import pytest
from multihost_job import OVERRIDES, REPO, STEPS, read_steps
from slurm_hosts import Slurm, unavailable

from megascale.config import load
from megascale.controller.events import read_events
from megascale.launcher.outcome import parameter_digest, read_final

pytestmark = pytest.mark.slow


def test_srun_torchrun_across_hosts_matches_the_single_host_run(net, tmp_path, reference):
    why = unavailable()
    if why:
        pytest.skip(why)
    run_dir = tmp_path / "run"
    sets = [a for o in OVERRIDES for a in ("--set", o)]
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--max-restarts", "0", "--rdzv-backend", "c10d", "--rdzv-id", "multihost",
        "--rdzv-endpoint", f"{net.addr('node1')}:29500",
        "-m", "megascale.cli", "train", "tiny", *sets, "--run-dir", str(run_dir),
    ]  # fmt: skip
    with Slurm(net, "ctl", ["node1", "node2"]) as slurm:
        done = slurm.srun(torchrun, nodes=2, env={"PYTHONPATH": str(REPO)}, cwd=REPO)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:] + slurm.log_tail()
    assert parameter_digest(run_dir, load("tiny", OVERRIDES)) == (reference, STEPS)


def test_launch_slurm_replaces_a_crashed_host_with_a_spare_of_the_allocation(
    net, tmp_path, reference
):
    """``megascale launch --slurm`` under ``salloc -N 3 --no-kill`` from ``ctl``: etcd and the
    controller on ``ctl``, an agent per allocated host through its own ``srun`` step, two
    training and one spare. The host of rank 1 crashes mid-run (its link down, every process in
    it killed, slurmd included): megascale names it lost from its lease, evicts it and the
    allocation's spare takes its ranks, long before Slurm marks the host down; the run ends with
    the fault-free parameters. Prints megascale's and Slurm's detection times."""
    why = unavailable()
    if why:
        pytest.skip(why)
    run_dir = tmp_path / "run"
    sets = [a for o in OVERRIDES for a in ("--set", o)]
    launch = [
        sys.executable, "-m", "megascale.cli", "launch", "tiny", *sets, "--slurm", "--nodes", "2",
        "--nproc-per-node", "1", "--heartbeat-interval", "0.5", "--selfcheck", "builtin",
        "--timeout", "240", "--run-dir", str(run_dir),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGASCALE_")}
    env["PYTHONPATH"] = str(REPO)
    log = tmp_path / "salloc.out"
    hosts = ["node1", "node2", "node3"]
    with Slurm(net, "ctl", hosts) as slurm:
        proc = slurm.salloc(launch, nodes=3, env=env, log=log, cwd=REPO)
        try:
            deadline = time.monotonic() + 180
            while not any(r["step"] >= 6 for r in read_steps(run_dir)):
                assert proc.poll() is None, log.read_text()[-4000:]
                assert time.monotonic() < deadline, "no step 6: " + log.read_text()[-4000:]
                time.sleep(0.05)
            first = next(e for e in read_events(run_dir) if e.kind == "generation_start")
            victim = first.detail["nodes"][1]
            spare = next(h for h in hosts if h not in first.detail["nodes"])
            net.crash(victim)
            fault_time = time.time()
            slurm_down = None
            while proc.poll() is None and time.time() - fault_time < 240:
                if slurm_down is None and slurm.node_state(victim).startswith("down"):
                    slurm_down = time.time() - fault_time
                time.sleep(0.5)
            rc = proc.wait(10)
            while slurm_down is None and time.time() - fault_time < 40:  # for the figure only
                if slurm.node_state(victim).startswith("down"):
                    slurm_down = time.time() - fault_time
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(20)
        out = log.read_text(errors="replace")
        assert rc == 0, out[-4000:] + slurm.log_tail()
    assert parameter_digest(run_dir, load("tiny", OVERRIDES)) == (reference, STEPS)
    final = read_final(run_dir)
    assert final.finished and final.recoveries >= 1, final
    after = [e for e in read_events(run_dir) if e.time >= fault_time]
    lost = next(e for e in after if e.node == victim)
    assert lost.kind == "fault" and lost.detail["fault"] == "node_lost", lost
    restart = next(e for e in after if e.kind == "generation_start")
    assert restart.detail["replaced"] == {victim: spare}, restart
    assert first.detail["nodes"][0] in restart.detail["nodes"]
    resumed = next(r for r in read_steps(run_dir) if r["time"] > restart.time)
    down = f"{slurm_down:.1f} s" if slurm_down is not None else "not within 40 s"
    print(
        f"slurm host crash of {victim} (rank 1) at step >= 6: megascale {lost.detail['fault']} "
        f"after {lost.time - fault_time:.2f} s, {spare} in, first step (step {resumed['step']}) "
        f"after {resumed['time'] - fault_time:.2f} s; Slurm marked it down after "
        f"{down}"
    )
