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


def train(run_dir: Path, *sets: str, extra: list[str] = ()) -> subprocess.CompletedProcess:
    """``megascale train tiny`` with ``QUICK``, ``--set`` each of ``sets``, and ``extra``."""
    args = [sys.executable, "-m", "megascale.cli", "train", "tiny", "--run-dir", str(run_dir)]
    args += list(extra)
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


def test_an_older_checkpoint_of_another_model_shape_is_refused_by_its_tensors(tmp_path):
    import json

    two_stages = ["--nproc-per-node", "2", "--set", "parallel.pp=2"]
    assert train(tmp_path, "train.steps=2", extra=two_stages).returncode == 0
    step = tmp_path / "checkpoints" / "step_00000002"
    manifest = json.loads((step / "manifest.json").read_text())
    del manifest["model"]  # as written before the manifest recorded the model's shape
    (step / "manifest.json").write_text(json.dumps(manifest))
    line = refusal(train(tmp_path, "train.steps=4", "model.ffn_hidden_size=128", extra=two_stages))
    assert f"{step} holds " in line and "of shape" in line and "another model shape" in line


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


class _Hostile:
    """Unpickling it would run a shell command (``weights_only`` loading refuses it)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_common_file_with_a_valid_checksum_falls_back(tmp_path):
    import hashlib
    import json
    import pickle

    assert train(tmp_path, "train.steps=4", "checkpoint.keep=2").returncode == 0
    latest, marker = tmp_path / "checkpoints" / "step_00000004", tmp_path / "pwned"
    data = pickle.dumps({"step": _Hostile(marker)})
    (latest / "common.pt").write_bytes(data)
    manifest = json.loads((latest / "manifest.json").read_text())
    manifest["files"]["common.pt"] = {
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
    }
    (latest / "manifest.json").write_text(json.dumps(manifest))

    proc = train(tmp_path, "train.steps=6", "checkpoint.keep=2")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert not marker.exists()  # the file's code never ran
    skipped = [line for line in output.splitlines() if "skipping checkpoint step_00000004" in line]
    assert len(skipped) == 1 and "common.pt is refused" in skipped[0], output[-3000:]
    assert "resumed from" in output and "step_00000002" in output


def test_a_full_shared_memory_directory_is_one_line(tmp_path, monkeypatch, capsys):
    from megascale import cli
    from megascale.data import node_loader

    with tiny_disk(tmp_path / "shm", "size=64k") as shm:
        filler = shm / "filler"
        with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:  # fill it: no room left for the data segment
                f.write(b"\0" * 4096)
        # the ranks are forked from this process: they create their segment in ``shm``
        monkeypatch.setattr(node_loader, "shm_dir", lambda: shm)
        rc = cli.main(
            ["train", "tiny", "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2"]
            + ["--set", "train.steps=2", "--set", "optim.warmup_steps=1"]
        )
        err = capsys.readouterr().err.strip().splitlines()
        leftovers = sorted(p.name for p in shm.iterdir())
    assert rc == 2, err[-20:]
    assert err[-1].startswith(f"megascale: data.loader = 'node': cannot reserve {shm}/"), err[-1]
    assert "No space left on device (ENOSPC)" in err[-1] and "MiB free" in err[-1], err[-1]
    assert not any("Traceback" in line for line in err), err[-20:]
    assert leftovers == ["filler"]  # the segment that could not be reserved is removed
