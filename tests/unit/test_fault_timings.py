"""``launcher.outcome.fault_timings``: when training resumed after a fault, read back from what
the controller, the fault injection and rank 0 wrote into the run directory."""

from __future__ import annotations

import json
import time

from megascale.controller.events import EventLog, read_events
from megascale.launcher.outcome import fault_timings
from megascale.messages.node import StepMetrics
from megascale.probes import inject
from megascale.train.run import MetricsLog


def _step(log: MetricsLog, step: int) -> None:
    log.write(StepMetrics(step=step, loss=2.0, grad_norm=1.0, lr=0.1, step_time_s=0.1,
                          tokens_per_s=1.0))  # fmt: skip
    time.sleep(0.01)


def test_a_step_rank_0_ends_just_after_the_kill_is_not_the_recovery(tmp_path):
    """Rank 1 is killed before step 5 while healthy rank 0 still finishes step 4: that step's
    line comes after the kill, and training resumed only with the next generation's first step."""
    events, metrics = EventLog(tmp_path), MetricsLog(tmp_path / "metrics.jsonl", 0)
    for step in range(1, 4):
        _step(metrics, step)
    assert inject.claim(tmp_path, inject.parse("kill-worker:rank=1,step=5"), step=5)
    _step(metrics, 4)  # rank 0's step 4, a moment after the kill
    events.append("fault", generation=1, node="node-1", rank=1)
    time.sleep(0.01)  # the decision, the stop and the rejoin
    events.append("generation_start", generation=2)
    time.sleep(0.01)
    _step(metrics, 5)
    [timing] = fault_timings(tmp_path, read_events(tmp_path))
    step_5 = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 < timing.detection_s < timing.resumed_s, timing
    assert abs(timing.fired_at + timing.resumed_s - step_5["time"]) < 1e-3
