"""A run directory is pinned by identity: once it is moved aside, the job that started in it
writes nothing at its old path (not into a directory another job made there, and never makes
one itself), and says why in one line."""

from __future__ import annotations

import pytest

from megascale import runfiles
from megascale.launcher.runlock import prepare_run_dir


@pytest.fixture
def pinned(tmp_path):
    run = tmp_path / "run"
    lock = prepare_run_dir(run)  # pins it, as megascale launch and megascale train do
    yield run
    lock.release()
    runfiles._PINNED.pop(str(run), None)


def test_a_moved_run_directory_is_never_written_at_its_old_path(pinned, tmp_path):
    runfiles.write_text(pinned / "events.jsonl", "old job\n")
    assert runfiles.run_dir_moved(pinned) is None
    pinned.rename(tmp_path / "run.old")  # moved aside mid-run
    assert "is gone (moved or removed" in runfiles.run_dir_moved(pinned)
    with pytest.raises(runfiles.RunDirMovedError, match="the job writes nothing there"):
        runfiles.make_dir(pinned / "logs")
    assert not pinned.exists()  # not re-created at the old path
    new_job = prepare_run_dir(pinned)  # another job starts there: the old one holds no lock on it
    try:
        runfiles._PINNED[str(pinned)] = (0, 0)  # the old job's view (its process pinned the old)
        why = runfiles.run_dir_moved(pinned)
        assert why.startswith(f"the run directory {pinned} is another directory than the job")
        for write in (
            lambda: runfiles.write_text(pinned / "final.json", '{"state": "failed"}'),
            lambda: runfiles.open_append(pinned / "events.jsonl"),
            lambda: runfiles.write_text(pinned / "logs" / "agent.log", "x"),
        ):
            with pytest.raises(runfiles.RunDirMovedError):
                write()
        assert sorted(p.name for p in pinned.iterdir()) == [".lock"]  # the new job's files only
        assert (tmp_path / "run.old" / "events.jsonl").read_text() == "old job\n"
    finally:
        new_job.release()
