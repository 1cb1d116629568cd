"""Segment files of the per-machine data loader: a file left by a loader killed during start-up
(its creator no longer runs) is found and removed; a live loader's file is left alone."""

from __future__ import annotations

import os
import subprocess
import sys

from megascale.data.node_loader import SEGMENT_PREFIX, stale_segments, sweep_stale


def test_files_of_dead_creators_are_swept_live_ones_kept(tmp_path):
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    dead = tmp_path / f"{SEGMENT_PREFIX}{int(child.stdout)}-0a1b2c"
    live = tmp_path / f"{SEGMENT_PREFIX}{os.getpid()}-3d4e5f"
    other = tmp_path / f"{SEGMENT_PREFIX}not-a-pid"
    for path in (dead, live, other):
        path.write_bytes(b"\0" * 64)
    assert stale_segments(tmp_path) == [dead]
    assert sweep_stale(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and other.exists()
    assert stale_segments(tmp_path) == []
