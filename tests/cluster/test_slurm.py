"""A real Slurm across the hosts (``slurm_hosts.Slurm``: slurmctld on ``ctl``, slurmd on
``node1`` and ``node2``, munge) runs the multi-host tests' job with the recipe of
docs/slurm.md: ``srun`` starts one ``torchrun`` per node (c10d rendezvous at the first node's
address), each running ``megascale train`` as one rank; the run directory is shared. The job
must end with the parameters of the same job run on one host (the ``reference`` fixture)."""

from __future__ import annotations

import sys

import pytest
from multihost_job import OVERRIDES, REPO, STEPS
from slurm_hosts import Slurm, unavailable

from megascale.config import load
from megascale.launcher.outcome import parameter_digest

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
