"""``benchmarks/recompute_memory.py`` at a tiny size: recomputation must cut the activation memory
autograd holds for backward (full < selective < none) and change no number (the same loss).

The benchmark's figures are in ``benchmarks/RESULTS.md``; here it runs ``llama-tiny`` at a short
sequence, with ``--rss`` so the fresh-process path runs too (its figures are not compared: a
process's peak RSS at this size is mostly the allocator's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_full_saves_less_than_selective_saves_less_than_none():
    proc = subprocess.run(
        [sys.executable, "benchmarks/recompute_memory.py", "--set", "model.seq_length=128"]
        + ["--rss"],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    for header in ("# recomputation memory: CPU", "date:", "command:", "model:    4 layers"):
        assert header in out, out
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("none", "selective", "full"):
            rows[cells[0]] = cells
    assert list(rows) == ["none", "selective", "full"], out
    saved = {name: float(cells[1]) for name, cells in rows.items()}
    assert saved["full"] < saved["selective"] < saved["none"], out
    assert saved["full"] < 0.25 * saved["none"], out  # full keeps only each layer's input
    assert len({cells[-1] for cells in rows.values()}) == 1, out  # the same loss
    assert all(float(cells[4]) >= 0 for cells in rows.values()), out  # peak RSS growth, MiB
