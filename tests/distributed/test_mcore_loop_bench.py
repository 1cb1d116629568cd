"""Smoke run of ``benchmarks/mcore_loop.py`` on CPU: megascale's trainer (without, with selective
and with full recomputation) and a plain megatron-core loop build, train and are reported.

Its figures are for GPUs (``benchmarks/RESULTS.md``). No timing is asserted; the losses are: the
three megascale rows train the same model on the same data, so recomputation must not change
their loss, and the plain loop (random tokens) learns from the same starting point.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_mcore_loop_benchmark_prints_every_variant():
    argv = [sys.executable, "benchmarks/mcore_loop.py", "--config", "tiny", "--device", "cpu"]
    argv += ["--set", "model.seq_length=64", "--steps", "2", "--warmup", "1", "--rounds", "1"]
    proc = subprocess.run(
        argv, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "# megascale vs a plain megatron-core loop: CPU" in out, out
    table = [line for line in out.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in table[0].strip("|").split("|")]
    assert columns[:3] == ["variant", "step ms (median)", "tokens/s"]
    rows = [dict(zip(columns, (c.strip() for c in r.strip("|").split("|")), strict=True))
            for r in table[2:]]  # fmt: skip
    assert [r["variant"] for r in rows] == [
        "megascale",
        "megascale + selective recompute",
        "megascale + full recompute",
        "megatron-core loop",
    ]
    assert rows[0]["vs megascale"] == "1.000"
    for r in rows:
        assert float(r["tokens/s"].replace(",", "")) > 0
        assert r["MFU"] == r["peak memory (GiB)"] == "n/a"  # no peak, no allocator on CPU
    losses = dict(
        re.findall(r"(megascale[^,]*|megatron-core loop) (\d+\.\d+)", out.split("losses:")[1])
    )
    assert losses["megascale"] == losses["megascale + selective recompute"]
    assert losses["megascale"] == losses["megascale + full recompute"]
    assert 0 < float(losses["megatron-core loop"]) < 10
