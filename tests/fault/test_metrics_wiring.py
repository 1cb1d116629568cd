"""The Prometheus exporters and the live straggler detection, wired into ``megascale launch``:
a 2 node x 1 rank CPU run with rank 1 three times slow (``slow-rank``) serves ``megascale_``
metrics (the validation loss too) from the controller and the agents while it runs, and the controller records a
``straggler`` event naming node-1 (and no fault)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from megascale.robustness.events import read_events

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


def test_launch_serves_metrics_and_reports_the_straggler(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("MEGASCALE_INJECT", None)
    cmd = [sys.executable, "-m", "megascale.cli", "launch", *ARGS, "--run-dir", str(tmp_path)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    want = {  # what each exporter must show: the controller once some training time counted
        # (and its ratio: one scrape may pair the new productive time with the ratio before it)
        "controller-0": lambda text: (
            _value(text, "megascale_productive_seconds{") > 0
            and _value(text, "megascale_effective_training_time_ratio{") > 0
        ),
        "node-1": lambda text: (  # the validation loss of the ranks' evaluations too
            "megascale_heartbeats_sent_total{" in text
            and _value(text, "megascale_validation_loss{") > 0
        ),
    }
    seen: dict[str, str] = {}
    try:
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline and len(seen) < len(want):
            for name, needle in want.items():
                url_file = tmp_path / "metrics" / f"{name}.url"
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
    assert proc.returncode == 0, output[-6000:]
    assert set(seen) == set(want), output[-6000:]
    assert 'megascale_generation{megascale_job="' in seen["controller-0"]
    ratio = _value(seen["controller-0"], "megascale_effective_training_time_ratio{")
    assert 0.0 < ratio < 1.0, seen["controller-0"]
    assert "controller-0 metrics at http://127.0.0.1:" in output
    events = read_events(tmp_path)
    stragglers = [e for e in events if e["kind"] == "straggler"]
    assert [e["node"] for e in stragglers] == ["node-1"], events
    assert stragglers[0]["detail"]["score"] > 1.5 and stragglers[0]["detail"]["action"] == "report"
    assert not [e for e in events if e["kind"] == "fault"]
