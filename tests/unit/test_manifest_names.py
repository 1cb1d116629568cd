"""The end-of-launch digest and the corrupt-checkpoint injector open only files inside the
checkpoint's step directory, whatever its manifest names."""

from __future__ import annotations

import json

import pytest
import torch

from megascale.config import load
from megascale.launcher.outcome import parameter_digest
from megascale.robustness import inject


def _checkpoint(run_dir, files: dict[str, str | None]):
    """A complete checkpoint at step 4 whose manifest lists ``files``; a value is the path a
    symlink of that name points to (None: a real file of that name)."""
    step = run_dir / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    for name, target in files.items():
        if target is None:
            torch.save({"model": [{"w": torch.ones(2)}]}, step / name)
        elif "/" not in name:
            (step / name).symlink_to(target)
    manifest = {"files": {name: {"sha256": "0", "bytes": 1} for name in files}}
    (step / "manifest.json").write_text(json.dumps(manifest))
    return step


@pytest.fixture
def outside(tmp_path):
    """A loadable weights file outside the run directory: reading it would give a digest."""
    path = tmp_path / "elsewhere.pt"
    torch.save({"model": [{"w": torch.zeros(2)}]}, path)
    return path


def test_digest_of_a_sane_checkpoint(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, {"model_pp00_tp00.pt": None})
    digest, step = parameter_digest(run, load("tiny"))
    assert step == 4 and len(digest) == 64


@pytest.mark.parametrize("name", ["../../../elsewhere.pt", "/dev/zero", "model_pp00_tp00.pt"])
def test_digest_refuses_names_and_symlinks_leading_out(tmp_path, outside, name):
    run = tmp_path / "run"
    _checkpoint(run, {name: str(outside)})  # the plain name is a symlink to the outside file
    assert parameter_digest(run, load("tiny")) == (None, 4)


def test_corrupt_checkpoint_never_writes_outside_the_checkpoint(tmp_path, outside):
    run = tmp_path / "run"
    _checkpoint(run, {"rank_00000.pt": str(outside)})
    before = outside.read_bytes()
    spec = inject.parse("corrupt-checkpoint:latest")
    assert inject.corrupt_latest_checkpoint(run, None, (), spec) is None
    assert outside.read_bytes() == before
    assert inject.fired(run) == []  # not claimed: it did not fire


def test_corrupt_checkpoint_flips_bytes_of_a_file_inside(tmp_path):
    run = tmp_path / "run"
    step = _checkpoint(run, {"rank_00000.pt": None})
    before = (step / "rank_00000.pt").read_bytes()
    spec = inject.parse("corrupt-checkpoint:latest")
    assert inject.corrupt_latest_checkpoint(run, None, (), spec) == str(step / "rank_00000.pt")
    after = (step / "rank_00000.pt").read_bytes()
    assert len(after) == len(before) and after != before
