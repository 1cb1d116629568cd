"""The end-of-launch digest and the corrupt-checkpoint injector open only files inside the
checkpoint's step directory, whatever its manifest and metadata name."""

from __future__ import annotations

import hashlib
import json
import pickle

import pytest
import torch

from megascale.config import load
from megascale.launcher.outcome import parameter_digest
from megascale.probes import inject
from megascale.train.checkpoint import format as fmt

DATA = "rank_00000/__0_0.distcp"


def _sha(data: bytes) -> dict:
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _checkpoint(run_dir, *, data_path: str = DATA):
    """A complete one-rank checkpoint at step 4 in the DCP layout, with one model tensor; the
    merged metadata names its data file as ``data_path``."""
    step = run_dir / "checkpoints" / "step_00000004"
    fmt.write_pieces({"module.w": torch.ones(2)}, str(step / "rank_00000"))
    part = fmt.load_metadata((step / "rank_00000" / fmt.METADATA).read_bytes())
    merged = fmt.merge_metadata({"rank_00000": part})
    for info in merged.storage_data.values():
        info.relative_path = data_path
    (step / fmt.METADATA).write_bytes(pickle.dumps(merged))
    files = {
        name: _sha((step / name).read_bytes()) for name in (DATA, f"rank_00000/{fmt.METADATA}")
    }
    files[fmt.METADATA] = _sha((step / fmt.METADATA).read_bytes())
    (step / "manifest.json").write_text(json.dumps({"format_version": 3, "files": files}))
    return step


@pytest.fixture
def outside(tmp_path):
    """A file outside the run directory that a reader must never open."""
    path = tmp_path / "elsewhere.bin"
    path.write_bytes(b"\0" * 4096)
    return path


def test_digest_of_a_sane_checkpoint(tmp_path):
    _checkpoint(tmp_path / "run")
    digest, step = parameter_digest(tmp_path / "run", load("tiny"))
    assert step == 4 and len(digest) == 64


@pytest.mark.parametrize("name", ["../../../elsewhere.bin", "/dev/zero", "rank_00000/../x"])
def test_digest_refuses_metadata_naming_files_outside(tmp_path, name):
    _checkpoint(tmp_path / "run", data_path=name)
    assert parameter_digest(tmp_path / "run", load("tiny")) == (None, 4)


def test_digest_refuses_a_data_file_that_is_a_symlink_out(tmp_path, outside):
    step = _checkpoint(tmp_path / "run")
    (step / DATA).unlink()
    (step / DATA).symlink_to(outside)
    assert parameter_digest(tmp_path / "run", load("tiny")) == (None, 4)


def test_corrupt_checkpoint_never_writes_outside_the_checkpoint(tmp_path, outside):
    step = _checkpoint(tmp_path / "run")
    (step / DATA).unlink()
    (step / DATA).symlink_to(outside)
    before = outside.read_bytes()
    spec = inject.parse("corrupt-checkpoint:latest")
    assert inject.corrupt_latest_checkpoint(tmp_path / "run", None, (), spec) is None
    assert outside.read_bytes() == before
    assert inject.fired(tmp_path / "run") == []  # not claimed: it did not fire


def test_corrupt_checkpoint_flips_bytes_of_a_file_inside(tmp_path):
    step = _checkpoint(tmp_path / "run")
    before = (step / DATA).read_bytes()
    spec = inject.parse("corrupt-checkpoint:latest")
    assert inject.corrupt_latest_checkpoint(tmp_path / "run", None, (), spec) == str(step / DATA)
    after = (step / DATA).read_bytes()
    assert len(after) == len(before) and after != before
