"""torchrun's elastic restart resumes a megascale job: rank 1 is SIGKILLed after step 21 (the
``kill-worker`` injection, through ``MEGASCALE_INJECT``), torchrun (``--max-restarts 1``, c10d
rendezvous, its agent's store shared by both worker groups) starts the group again, and the new
ranks resume from the step-20 checkpoint and finish with the fault-free run's parameters. The two
ranks share one per-machine data loader segment (``data.loader = "node"``, the default): the kill
and the restart leave no segment behind in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megascale.config import load
from megascale.data.node_loader import stale_segments
from megascale.launcher.local import free_port
from megascale.launcher.outcome import parameter_digest
from megascale.probes.inject import fired

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
