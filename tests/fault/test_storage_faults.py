"""The job's checkpoint storage failing under ``megascale launch`` (a full disk, a read-only
one): the job's error, with its cause, at once; nobody is evicted and the spare is never used.
The runs are ``test_cluster``'s (``Run``: 2 nodes and a spare, real etcd, agents, workers)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.fault.test_cluster import Run, _check_failed_as_the_jobs_error

pytestmark = pytest.mark.slow


def test_a_full_checkpoint_disk_fails_the_job_with_its_cause(tmp_path):
    run = Run(tmp_path, "--spares", "1", "--inject", "disk-full:step=8")
    _check_failed_as_the_jobs_error(run, "No space left on device (ENOSPC)", "storage full")


def test_a_real_full_checkpoint_disk_under_launch_evicts_nobody(tmp_path):
    """A small tmpfs as the checkpoint directory (root only): the writer threads' ENOSPC
    tracebacks are the job's storage, not node-0's evidence; the job fails with the cause."""
    run = _run_on_tmpfs_checkpoints(tmp_path, "size=64k")
    _check_failed_as_the_jobs_error(run, "No space left on device", "storage full")


def _run_on_tmpfs_checkpoints(tmp_path: Path, options: str) -> Run:
    """A run with a spare whose checkpoint directory is a tmpfs mounted with ``options``."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "ckpt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], check=True)
    try:
        return Run(tmp_path / "run", "--spares", "1", "--set", f"checkpoint.url={mnt}")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_read_only_checkpoint_directory_under_launch_is_the_jobs_error(tmp_path):
    """Every rank's worker ends with the same CheckpointError (its exit record, not a line of its
    own as under torchrun): the job's error, nobody evicted."""
    run = _run_on_tmpfs_checkpoints(tmp_path, "size=64k,ro")
    _check_failed_as_the_jobs_error(run, "Read-only file system (EROFS)", "the same error")
