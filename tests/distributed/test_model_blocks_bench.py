"""Smoke run of ``benchmarks/model_blocks.py`` on CPU: four variants, one table, sane numbers.

The benchmark's figures are for GPUs (``benchmarks/RESULTS.md``); here it runs the tiny preset for
a few steps to show that every variant builds, trains and is reported. No timing is asserted.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ["baseline", "parallel block", "sliding window", "parallel+window"]


def test_model_blocks_benchmark_prints_four_variants():
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/model_blocks.py",
            "--config",
            "tiny",
            "--device",
            "cpu",
            "--set",
            "model.seq_length=64",
            "--window",
            "16",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--rounds",
            "1",
        ],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    for header in ("# model blocks: CPU", "date:", "command:", "config:   tiny", "model:"):
        assert header in out, out
    table = [line for line in out.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in table[0].strip("|").split("|")]
    assert columns == [
        "variant",
        "parallel_block",
        "window",
        "step ms (median)",
        "tokens/s",
        "spread",
        "MFU",
        "vs baseline",
    ]
    rows = [
        dict(zip(columns, (c.strip() for c in line.strip("|").split("|")), strict=True))
        for line in table[2:]
    ]
    assert [r["variant"] for r in rows] == VARIANTS
    assert [r["parallel_block"] for r in rows] == ["False", "True", "False", "True"]
    assert [r["window"] for r in rows] == ["full", "full", "16", "16"]
    for r in rows:
        assert float(r["tokens/s"].replace(",", "")) > 0
        assert float(r["step ms (median)"]) > 0
        assert r["MFU"] == "n/a"  # no peak on CPU
        assert float(r["vs baseline"]) > 0
    assert rows[0]["vs baseline"] == "1.000"
