"""The Prometheus exporters and the live straggler detection, wired into ``megascale launch``:
a 2 node x 1 rank CPU run with rank 1 three times slow (``slow-rank``) serves ``megascale_``
metrics (the validation loss too) from the controller and the agents while it runs, scores each rank
against its pipeline stage's (rank 1 slow, rank 0 even, per rank), and records a ``straggler``
event naming node-1 and rank 1 (and no fault). And a PP2 run whose second stage (one node) is
evenly 3x as heavy flags nobody, in the blocking gloo and the NCCL-like mode."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from megascale.controller.events import read_events

pytestmark = pytest.mark.slow

ARGS = [
    "--nodes", "2", "--nproc-per-node", "1", "--heartbeat-interval", "0.5",
    "--selfcheck", "builtin", "--timeout", "120",
    "--set", "train.steps=24", "--set", "checkpoint.interval=12", "--set", "train.log_interval=4",
    "--set", "train.eval_interval=4",
    "--inject", "slow-rank:rank=1,factor=3",
]  # fmt: skip


def _scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read().decode()
    except (OSError, ValueError):  # ValueError: not a URL (yet)
        return ""


def _value(text: str, series: str) -> float:
    """The value of the one sample of ``series`` (name and opening brace) in an exposition; -1
    when absent."""
    values = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series)
    ]
    assert len(values) <= 1, values
    return values[0] if values else -1.0


def _scores(text: str) -> dict[str, float]:
    """Rank -> its ``megascale_straggler_score`` in an exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith("megascale_straggler_score{"):
            rank = line.split('rank="', 1)[1].split('"', 1)[0]
            out[rank] = float(line.rsplit(" ", 1)[1])
    return out


def _launch(run_dir: Path, args: list[str], want: dict) -> tuple[int, str, dict[str, str]]:
    """``megascale launch`` with ``args`` to its end, scraping each exporter of ``want`` (name ->
    predicate on its exposition) until it shows what the predicate wants; (exit code, output,
    name -> the first exposition that satisfied it)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("MEGASCALE_INJECT", None)
    cmd = [sys.executable, "-m", "megascale.cli", "launch", *args, "--run-dir", str(run_dir)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    seen: dict[str, str] = {}
    try:
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline and len(seen) < len(want):
            for name, needle in want.items():
                url_file = run_dir / "metrics" / f"{name}.url"
                if name not in seen and url_file.exists():
                    text = _scrape(url_file.read_text().strip())
                    if needle(text):
                        seen[name] = text
            time.sleep(0.1)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            # SIGTERM first: the launcher's agents, controllers and etcd die with it (parent-death
            # signal), so nothing is left running; SIGKILL if it has not gone in 20 s.
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return proc.returncode, output, seen


def test_launch_serves_metrics_and_reports_the_straggler(tmp_path):
    want = {  # what each exporter must show: the controller once some training time counted
        # (and its ratio: one scrape may pair the new productive time with the ratio before it)
        "controller-0": lambda text: (
            _value(text, "megascale_productive_seconds{") > 0
            and _value(text, "megascale_effective_training_time_ratio{") > 0
            and _scores(text).get("1", 0) > 1.5
        ),
        "node-1": lambda text: (  # the validation loss of the ranks' evaluations too
            "megascale_heartbeats_sent_total{" in text
            and _value(text, "megascale_validation_loss{") > 0
        ),
    }
    returncode, output, seen = _launch(tmp_path, ARGS, want)
    assert returncode == 0, output[-6000:]
    assert set(seen) == set(want), output[-6000:]
    assert 'megascale_generation{megascale_job="' in seen["controller-0"]
    scores = _scores(seen["controller-0"])
    assert set(scores) == {"0", "1"} and scores["0"] < 1.0 < 1.5 < scores["1"], scores
    ratio = _value(seen["controller-0"], "megascale_effective_training_time_ratio{")
    assert 0.0 < ratio < 1.0, seen["controller-0"]
    assert "controller-0 metrics at http://127.0.0.1:" in output
    events = read_events(tmp_path)
    stragglers = [e for e in events if e.kind == "straggler"]
    assert [(e.node, e.rank) for e in stragglers] == [("node-1", 1)], events
    assert stragglers[0].detail["score"] > 1.5 and stragglers[0].detail["action"] == "report"
    assert not [e for e in events if e.kind == "fault"]


@pytest.mark.parametrize("async_collectives", [False, True], ids=["gloo", "nccl-like"])
def test_an_evenly_heavier_pipeline_stage_is_not_a_straggler(tmp_path, async_collectives):
    # PP2 x DP2 on 2 nodes of 2: node-0 holds stage 0 (ranks 0, 1), node-1 stage 1 (ranks 2, 3),
    # whose compute is made 5x as long on both ranks, as a stage with the LM head and loss is
    # naturally heavier. Every rank is scored against its stage's other rank, so neither stage
    # is a straggler. The same in the NCCL-like mode, where the host never blocks in a
    # collective.
    args = [
        "--nodes", "2", "--nproc-per-node", "2", "--heartbeat-interval", "0.5",
        "--timeout", "120", "--set", "parallel.pp=2", "--set", "train.steps=24",
        "--set", f"parallel.async_collectives={str(async_collectives).lower()}",
        "--set", "checkpoint.interval=0", "--inject", "slow-node:node=1,factor=5",
        # Two even ranks time-sliced on a 2-core box loaded by the rest of the suite have
        # computed up to 2.5x apart in a window; scored across stages, stage 1 would be 5x: a
        # threshold of 3 tolerates the first and would flag the second.
        "--set", "diagnostics.straggler_threshold=3",
    ]  # fmt: skip

    def scored(text: str) -> bool:
        # Every rank has a score (the model ran on all four), from a window past the first steps:
        # a window of the first four steps carries one-time costs unevenly between a stage's ranks.
        return (
            set(_scores(text)) == {"0", "1", "2", "3"}
            and "generation" in text
            and _value(text, "megascale_job_step{") >= 12
        )

    returncode, output, seen = _launch(tmp_path, args, {"controller-0": scored})
    assert returncode == 0, output[-6000:]
    scores = _scores(seen["controller-0"])
    # Scored against its stage's other rank, a stage's two scores are each other's inverse (x/y,
    # y/x), however the load splits the cores between them. Scored across stages (against the
    # median of the other three) stage 0's would multiply to 1/25 and stage 1's to 25.
    for a, b in (("0", "1"), ("2", "3")):
        assert 0.95 < scores[a] * scores[b] < 1.05, scores
    events = read_events(tmp_path)
    assert not [e for e in events if e.kind in ("straggler", "fault")], events
