"""Checkpoint storage under failing disks: a failed write leaves no partial file, its cause is one
line naming the errno, and a location that cannot be written is found before training."""

from __future__ import annotations

import contextlib
import errno
import multiprocessing as mp
import os
import resource
import signal

import pytest
import torch

from megascale.train.checkpoint.storage import Storage, os_cause


def test_os_cause_finds_the_errno_deep_in_the_chain(tmp_path):
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.tmp"))
        except OSError as inner:
            raise RuntimeError("inline_container.cc:672 unexpected pos") from inner
    except RuntimeError as outer:
        line = os_cause(outer)
    assert line == f"No space left on device (ENOSPC): {tmp_path / 'x.tmp'}"
    assert os_cause(RuntimeError("no OS error here")) == ""


def _write_past_the_file_size_limit(root: str) -> str:
    """A real failing disk write: the process may not write files over 64 KiB (EFBIG)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    try:
        Storage(root).write_state(
            "step_00000001/rank_00000/rng.pt", {"t": torch.ones(1 << 16)}, "t"
        )
    except Exception as e:  # torch wraps the write error
        return os_cause(e)
    return ""


def test_a_failed_write_leaves_no_partial_file_and_names_the_cause(tmp_path):
    with mp.get_context("fork").Pool(1) as pool:
        cause = pool.apply(_write_past_the_file_size_limit, (str(tmp_path),))
    assert cause.startswith("File too large (EFBIG)"), cause
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []  # no .tmp left behind


def test_an_unwritable_location_is_found_before_training(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(OSError) as failed:
        Storage(tmp_path / "file" / "checkpoints").check_writable()
    assert "(ENOTDIR)" in os_cause(failed.value) or "(EEXIST)" in os_cause(failed.value)
    Storage(tmp_path / "ok").check_writable()  # a writable one passes and leaves nothing
    assert list((tmp_path / "ok").iterdir()) == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_full_disk_under_dcp_names_enospc_and_the_file(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystem

    from megascale.train.checkpoint import format as fmt

    create = FileSystem.create_stream

    @contextlib.contextmanager
    def full_data_files(self, path, mode):
        if str(path).endswith(".distcp"):  # the tensor data: every write fails with ENOSPC
            with open("/dev/full", "wb") as stream:
                yield stream
        else:
            with create(self, path, mode) as stream:
                yield stream

    monkeypatch.setattr(FileSystem, "create_stream", full_data_files)
    with pytest.raises(OSError) as failed:
        fmt.write_pieces({"t": torch.ones(1 << 16)}, str(tmp_path / "rank_00000"))
    line = os_cause(failed.value)
    assert line.startswith("No space left on device (ENOSPC): "), line
    assert line.endswith(".distcp"), line
