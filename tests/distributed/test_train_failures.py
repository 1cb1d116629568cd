"""``megascale train`` when the run cannot go on (a checkpoint of another model, a full or
read-only checkpoint disk, a hostile checkpoint file): one line naming the file and the cause,
exit code 2, never a traceback."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

QUICK = ["--set", "optim.warmup_steps=1", "--set", "checkpoint.interval=2"]


def train(run_dir: Path, *sets: str) -> subprocess.CompletedProcess:
    """``megascale train tiny`` with ``QUICK`` and ``--set`` each of ``sets``."""
    args = [sys.executable, "-m", "megascale.cli", "train", "tiny", "--run-dir", str(run_dir)]
    for value in sets:
        args += ["--set", value]
    env = {k: v for k, v in os.environ.items() if k != "MEGASCALE_INJECT"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return subprocess.run(args + QUICK, capture_output=True, text=True, env=env, timeout=300)


def refusal(proc: subprocess.CompletedProcess) -> str:
    """The one-line refusal of a run that exited 2 without a traceback."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("megascale: "), output[-3000:]
    return last


def test_resume_with_another_model_shape_is_refused(tmp_path):
    assert train(tmp_path, "train.steps=2").returncode == 0
    line = refusal(train(tmp_path, "train.steps=4", "model.hidden_size=32"))
    assert str(tmp_path / "checkpoints" / "step_00000002") in line
    assert "model.hidden_size = 64" in line and "model.hidden_size = 32" in line


@contextlib.contextmanager
def tiny_disk(path: Path, options: str):
    """A tmpfs mounted at ``path`` with ``options`` (``size=...``, ``ro``); skips the test where
    this process may not mount one, and always unmounts."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()[:200]}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_checkpoint_disk_names_enospc_and_the_file(tmp_path):
    # 1 MiB: room for the write probe, not for the ~4 MB checkpoint
    with tiny_disk(tmp_path / "disk", "size=1m") as disk:
        line = refusal(train(tmp_path / "run", "train.steps=2", f"checkpoint.url={disk}/ckpt"))
    assert "No space left on device (ENOSPC)" in line, line
    assert f"{disk}/ckpt/step_00000002/" in line, line


def test_a_read_only_checkpoint_directory_is_one_line(tmp_path):
    run = tmp_path / "run"
    with tiny_disk(run / "checkpoints", "size=1m,ro"):
        line = refusal(train(run, "train.steps=2"))
    assert "Read-only file system (EROFS)" in line, line
    assert str(run / "checkpoints") in line, line
