"""A run directory is opened, never followed: a symlink planted at a name the job writes (or as one
of its directories) is refused, and the link's target is neither written, truncated nor chmod-ed.
Each named file is written by the code that writes it in a job."""

from __future__ import annotations

import json
import os
import stat

import pytest

from megascale import runfiles
from megascale.launcher.cluster import ETCD_PASSWORD_FILE, write_secret
from megascale.launcher.runlock import RunDirError, prepare_run_dir
from megascale.tools import report, timeline
from megascale.train.run import MetricsLog

SECRET = "precious\n"


@pytest.fixture
def victim(tmp_path):
    """A file outside the run directory that a planted link points at (mode 0644)."""
    path = tmp_path / "victim"
    path.write_text(SECRET)
    path.chmod(0o644)
    return path


@pytest.fixture
def run_dir(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    return path


def _untouched(victim) -> None:
    assert victim.read_text() == SECRET
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644


def _plant(link, target) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


def test_write_text_replaces_a_file_whole_and_refuses_links(run_dir, victim):
    path = run_dir / "final.json"
    runfiles.write_text(path, "old")
    runfiles.write_text(path, "new", mode=0o600)
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in run_dir.iterdir()) == ["final.json"]  # no temporary left
    path.unlink()
    _plant(path, victim)
    with pytest.raises(runfiles.UnsafePathError, match="final.json: it is a symlink"):
        runfiles.write_text(path, "forged")
    _untouched(victim)
    assert sorted(p.name for p in run_dir.iterdir()) == ["final.json"]


def test_a_linked_directory_and_appends_are_refused(run_dir, tmp_path, victim):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _plant(run_dir / "logs", elsewhere)
    with pytest.raises(runfiles.UnsafePathError, match="the directory is a symlink"):
        runfiles.write_text(run_dir / "logs" / "x.log", "forged")
    with pytest.raises(runfiles.UnsafePathError, match="the directory is a symlink"):
        runfiles.make_dir(run_dir / "logs")
    assert list(elsewhere.iterdir()) == []
    _plant(run_dir / "metrics.jsonl", victim)
    with pytest.raises(runfiles.UnsafePathError, match="it is a symlink"):
        runfiles.open_append(run_dir / "metrics.jsonl")
    with pytest.raises(runfiles.UnsafePathError, match="it is a symlink"):
        runfiles.open_new(run_dir / "metrics.jsonl")
    _untouched(victim)


def test_etcd_password_is_not_written_or_chmodded_through_a_link(run_dir, victim):
    _plant(run_dir / ETCD_PASSWORD_FILE, victim)
    with pytest.raises(runfiles.UnsafePathError):
        write_secret(run_dir / ETCD_PASSWORD_FILE, "job-password")
    _untouched(victim)
    (run_dir / ETCD_PASSWORD_FILE).unlink()
    write_secret(run_dir / ETCD_PASSWORD_FILE, "job-password")
    assert (run_dir / ETCD_PASSWORD_FILE).read_text() == "job-password\n"
    assert stat.S_IMODE((run_dir / ETCD_PASSWORD_FILE).stat().st_mode) == 0o600


def test_metrics_log_refuses_a_link(run_dir, victim):
    _plant(run_dir / "metrics.jsonl", victim)
    with pytest.raises(runfiles.UnsafePathError):
        MetricsLog(run_dir / "metrics.jsonl", resumed_step=0)
    _untouched(victim)


def test_report_refuses_a_link(run_dir, victim):
    _plant(run_dir / "report.html", victim)
    with pytest.raises(runfiles.UnsafePathError):
        report.write(run_dir)
    _untouched(victim)


def _rank_timeline(directory) -> None:
    """One rank's timeline file, as a training rank writes it (a meta, a clock and one step)."""
    meta = {"type": "meta", "format": 1, "rank": 0, "world_size": 1, "node": "node-0",
            "layout": {"tp": 1, "pp": 1, "dp": 1}, "coords": {"dp": 0, "pp": 0, "tp": 0}}  # fmt: skip
    lines = [
        meta,
        {"type": "clock", "ref_wall_ns": 10**12, "mono_ns": 0},
        {"type": "step", "step": 1, "spans": [["megascale::train::step", "step", 0, 10**6]]},
    ]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "rank_00000.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.mark.parametrize("where", ["trace.json", "timeline dir", "steps.csv"])
def test_timeline_trace_refuses_a_link(run_dir, tmp_path, victim, where):
    if where == "timeline dir":
        elsewhere = tmp_path / "elsewhere"
        _rank_timeline(elsewhere)
        _plant(run_dir / "timeline", elsewhere)
    else:
        _rank_timeline(run_dir / "timeline")
        _plant(run_dir / "timeline" / where, victim)
    with pytest.raises(runfiles.UnsafePathError):
        timeline.write_trace(run_dir)
    _untouched(victim)
    if where == "timeline dir":
        assert [p.name for p in (tmp_path / "elsewhere").iterdir()] == ["rank_00000.jsonl"]
    else:
        timeline.load_run(run_dir)  # the rank's file is one the merge reads: the refusal is real
        (run_dir / "timeline" / where).unlink()
        trace, steps_csv, _ = timeline.write_trace(run_dir)
        assert json.loads(trace.read_text()) and steps_csv.read_text().startswith("rank,")


@pytest.mark.parametrize("name", ["final.json", ".lock", "logs/launch.log", "logs"])
def test_a_run_directory_with_a_planted_link_is_refused_before_the_job(run_dir, victim, name):
    _plant(run_dir / name, victim if name != "logs" else victim.parent)
    with pytest.raises(RunDirError, match=f"{name}' is a symlink|{name} is a symlink"):
        prepare_run_dir(run_dir)
    _untouched(victim)


def test_checkpoint_and_data_directories_may_be_links(run_dir, tmp_path):
    for name in ("checkpoints", "data"):
        (tmp_path / f"disk-{name}").mkdir()
        os.symlink(tmp_path / f"disk-{name}", run_dir / name)
    prepare_run_dir(run_dir).release()
