"""``megascale timeline`` reads only regular files, and never more than their size or one bounded
line at a time: a rank file that is a symlink to an endless device is refused in one line."""

from __future__ import annotations

import os

import pytest

from megascale import cli
from megascale.tools import timeline


def _rank_file(run_dir):
    directory = run_dir / "timeline"
    directory.mkdir(parents=True)
    return directory / "rank_00000.jsonl"


@pytest.mark.parametrize("target", ["/dev/zero", "fifo"])
def test_a_rank_file_that_is_not_a_regular_file_is_refused(tmp_path, capsys, target):
    rank_file = _rank_file(tmp_path)
    if target == "fifo":
        os.mkfifo(rank_file)  # nobody writes it: an open that blocked would hang here
    elif os.path.exists(target):
        rank_file.symlink_to(target)
    else:
        pytest.skip(f"no {target} here")
    assert cli.main(["timeline", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"megascale: timeline: {rank_file}: not a regular file"), err


def test_a_line_over_the_bound_is_skipped_not_held(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(timeline, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"a": 1}\n' + b"0" * 5000 + b'\n{"b": 2}\n' + b"\0" * 3000)
    assert timeline.read_jsonl(path) == [{"a": 1}, {"b": 2}]
    assert "metrics.jsonl:2: skipping a line over 1000 bytes" in caplog.text
