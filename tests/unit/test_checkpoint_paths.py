"""checkpoint.paths.resolve_file: a manifest's file name never leads outside its step directory."""

from __future__ import annotations

import os

import pytest

from megascale.train.checkpoint.paths import CheckpointPathError, check_name, resolve_file


@pytest.fixture
def step_dir(tmp_path):
    d = tmp_path / "checkpoints" / "step_00000004"
    d.mkdir(parents=True)
    (d / "model_pp00_tp00.pt").write_bytes(b"weights")
    (tmp_path / "secret").write_text("not a checkpoint")
    return d


def test_a_plain_file_of_the_step_resolves_to_itself(step_dir):
    assert resolve_file(step_dir, "model_pp00_tp00.pt") == str(step_dir / "model_pp00_tp00.pt")


@pytest.mark.parametrize(
    "name",
    [
        "../../etc/passwd",
        "..",
        ".",
        "",
        "/etc/passwd",
        "/dev/zero",
        "sub/model.pt",
        "..\\..\\secret",
        "model.pt\0.json",
        None,
        7,
        ["model.pt"],
    ],
)
def test_hostile_names_are_refused_without_touching_the_filesystem(step_dir, name):
    with pytest.raises(CheckpointPathError, match="plain file name"):
        resolve_file(step_dir, name)
    with pytest.raises(CheckpointPathError):
        resolve_file("s3://bucket/run/step_00000004", name, local=False)


def test_remote_directories_get_the_name_checks_only():
    assert resolve_file("memory://ck/step_1", "rank_00000.pt", local=False) == (
        "memory://ck/step_1/rank_00000.pt"
    )
    assert check_name("..model.pt") == "..model.pt"  # dots inside a name are just a name


def test_a_symlink_out_of_the_step_directory_is_refused(step_dir):
    (step_dir / "rank_00000.pt").symlink_to(step_dir.parent.parent / "secret")
    with pytest.raises(CheckpointPathError, match="outside the step directory"):
        resolve_file(step_dir, "rank_00000.pt")


def test_a_symlink_to_a_device_or_a_directory_is_refused(step_dir):
    (step_dir / "zero.pt").symlink_to("/dev/zero")
    (step_dir / "dir.pt").mkdir()
    with pytest.raises(CheckpointPathError, match="outside the step directory"):
        resolve_file(step_dir, "zero.pt")
    with pytest.raises(CheckpointPathError, match="not a regular file"):
        resolve_file(step_dir, "dir.pt")


def test_a_fifo_inside_the_step_directory_is_refused(step_dir):
    os.mkfifo(step_dir / "rank_00001.pt")
    with pytest.raises(CheckpointPathError, match="not a regular file"):
        resolve_file(step_dir, "rank_00001.pt")


def test_a_symlink_inside_the_step_directory_and_missing_files(step_dir):
    (step_dir / "alias.pt").symlink_to("model_pp00_tp00.pt")
    assert resolve_file(step_dir, "alias.pt") == str(step_dir / "model_pp00_tp00.pt")
    (step_dir / "loop.pt").symlink_to("loop.pt")
    for name in ("missing.pt", "loop.pt"):
        with pytest.raises(CheckpointPathError, match="cannot be read"):
            resolve_file(step_dir, name)
