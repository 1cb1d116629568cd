"""torchrun's elastic restart resumes a megascale job: rank 1 is SIGKILLed after step 21 (the
``kill-worker`` injection, through ``MEGASCALE_INJECT``), torchrun (``--max-restarts 1``, c10d
rendezvous, its agent's store shared by both worker groups) starts the group again, and the new
ranks resume from the step-20 checkpoint and finish with the fault-free run's parameters. The two
ranks share one per-machine data loader segment (``data.loader = "node"``, the default): the kill
and the restart leave no segment behind in /dev/shm.

A run that cannot go on under torchrun (a full or read-only checkpoint disk, a full /dev/shm) is
one line from each rank, which torchrun's failure summary names as the root cause: no frame of
megascale's is printed (torchrun's own summary of a failed worker is torchrun's)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megascale.config import load
from megascale.data.node_loader import stale_segments
from megascale.launcher.local import free_port
from megascale.launcher.outcome import parameter_digest
from megascale.probes.inject import fired
from tests.distributed.test_train_failures import tiny_disk

pytestmark = pytest.mark.slow

STEPS = ["--set", "train.steps=40", "--set", "checkpoint.interval=5"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MEGASCALE_INJECT"}
    return {**env, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **extra}


def _run(cmd: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


def test_torchrun_restart_resumes_from_the_last_checkpoint(tmp_path):
    reference, restarted = tmp_path / "reference", tmp_path / "restarted"
    leaked_before = set(stale_segments())
    train = [sys.executable, "-m", "megascale.cli", "train", *STEPS]
    _run([*train, "--nproc-per-node", "2", "--run-dir", str(reference)], _env())
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "-m", "megascale.cli", "train", *STEPS, "--run-dir", str(restarted),
    ]  # fmt: skip
    output = _run(torchrun, _env(MEGASCALE_INJECT="kill-worker:rank=1,step=22"))
    [kill] = fired(restarted)
    assert kill["kind"] == "kill-worker" and kill["step"] == 22
    assert "resumed from" in output and "step_00000020" in output, output[-6000:]
    job = load("tiny", STEPS[1::2])
    expected, step = parameter_digest(reference, job)
    assert step == 40 and expected is not None
    assert parameter_digest(restarted, job) == (expected, 40)
    assert 'loader = "node"' in (restarted / "config.toml").read_text()
    assert set(stale_segments()) <= leaked_before  # every process is gone: nothing may remain


def _torchrun_train(run_dir: Path, *sets: str, wrap: list[str] = ()) -> subprocess.CompletedProcess:
    """Two ranks of ``megascale train tiny`` under torchrun, ``--set`` each of ``sets``, the whole
    command run under ``wrap`` (a command prefix) when given."""
    cmd = [
        *wrap, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "-m", "megascale.cli", "train", "tiny", "--run-dir", str(run_dir),
        "--set", "train.steps=2", "--set", "optim.warmup_steps=1", "--set", "checkpoint.interval=2",
    ]  # fmt: skip
    for value in sets:
        cmd += ["--set", value]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)


def _root_cause(proc: subprocess.CompletedProcess) -> str:
    """The one line a failed torchrun run's ranks printed, checked to be the root cause of
    torchrun's summary, with no traceback frame from megascale's code."""
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    package = str(Path(__file__).resolve().parents[2] / "megascale")
    frames = re.findall(r'File "([^"]+)"', output)
    assert not [f for f in frames if f.startswith(package)], output[-6000:]
    assert "[rank0]: Traceback" not in output, output[-6000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("megascale: ")]
    assert lines, output[-4000:]
    root = output.split("Root Cause (first observed failure):", 1)[-1]
    [shown] = re.findall(r"traceback : (.*)", root)
    assert shown in lines, output[-4000:]
    return shown


def test_a_full_checkpoint_disk_under_torchrun_is_one_line(tmp_path):
    with tiny_disk(tmp_path / "disk", "size=1m") as disk:  # room for the probe, not a checkpoint
        line = _root_cause(_torchrun_train(tmp_path / "run", f"checkpoint.url={disk}/ckpt"))
    assert "No space left on device (ENOSPC)" in line, line
    assert f"{disk}/ckpt/step_00000002/" in line, line


def test_a_read_only_checkpoint_directory_under_torchrun_is_one_line(tmp_path):
    run = tmp_path / "run"
    with tiny_disk(run / "checkpoints", "size=1m,ro"):
        line = _root_cause(_torchrun_train(run))
    assert "Read-only file system (EROFS)" in line and str(run / "checkpoints") in line, line


def test_a_full_shared_memory_directory_under_torchrun_is_one_line(tmp_path):
    # torchrun and its ranks in a mount namespace of their own whose /dev/shm is a full 64 KiB
    # tmpfs; what is left in it after the run is listed last
    fill = (
        "mount -t tmpfs -o size=64k tmpfs /dev/shm || exit 99; "
        "{ dd if=/dev/zero of=/dev/shm/filler bs=4k 2>/dev/null; true; }; "
        '"$@"; rc=$?; echo "left in /dev/shm: $(ls -A /dev/shm | tr "\\n" " ")"; exit $rc'
    )
    wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c", fill, "sh"]
    proc = _torchrun_train(tmp_path / "run", wrap=wrap)
    if proc.returncode == 99 or "unshare: " in proc.stderr:
        pytest.skip(f"no private mount namespace here: {proc.stderr.strip()[-200:]}")
    line = _root_cause(proc)
    assert line.startswith("megascale: data.loader = 'node': cannot reserve /dev/shm/"), line
    assert "No space left on device (ENOSPC)" in line and "MiB free" in line, line
    assert proc.stdout.strip().splitlines()[-1] == "left in /dev/shm: filler", proc.stdout[-500:]
