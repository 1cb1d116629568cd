"""Live straggler scoring (``megascale.robustness.stragglers``): pure, synthetic heartbeats."""

from __future__ import annotations

import pytest

from megascale.robustness.stragglers import StragglerTracker, scores


def test_scores_are_over_the_median_of_the_others():
    s = scores({"a": 1.0, "b": 1.0, "c": 1.0, "d": 2.0, "e": 0.0})  # e: no sample
    assert s == {"a": 1.0, "b": 1.0, "c": 1.0, "d": 2.0}
    assert scores({"a": 1.0}) == {}


def _feed(tracker, rounds, times):
    flagged = []
    for _ in range(rounds):
        for node, t in times.items():
            flagged += tracker.observe(node, t)
    return flagged


def test_a_persistently_slow_node_is_flagged_once():
    tracker = StragglerTracker(threshold=1.10, window=2, consecutive=3)
    assert _feed(tracker, 3, {"node-0": 1.0, "node-1": 1.2, "node-2": 1.0}) == []
    assert tracker.scores["node-1"] == pytest.approx(1.2)
    assert _feed(tracker, 1, {"node-0": 1.0, "node-1": 1.2, "node-2": 1.0}) == ["node-1"]
    assert _feed(tracker, 5, {"node-0": 1.0, "node-1": 1.2, "node-2": 1.0}) == []  # once


def test_noise_and_a_brief_slowdown_are_not_flagged():
    tracker = StragglerTracker(threshold=1.10, window=3, consecutive=2)
    assert _feed(tracker, 10, {"node-0": 1.0, "node-1": 1.05}) == []
    # One slow heartbeat among three: the window's median stays even.
    tracker.observe("node-1", 5.0)
    assert _feed(tracker, 1, {"node-0": 1.0}) == []
    assert _feed(tracker, 10, {"node-0": 1.0, "node-1": 1.0}) == []


def test_recovery_rearms_and_reset_and_forget():
    tracker = StragglerTracker(threshold=1.5, window=1, consecutive=1)
    assert _feed(tracker, 1, {"a": 1.0, "b": 2.0}) == ["b"]
    assert _feed(tracker, 1, {"a": 1.0, "b": 1.0}) == []
    assert _feed(tracker, 1, {"a": 1.0, "b": 2.0}) == ["b"]
    tracker.forget("b")
    assert "b" not in tracker.scores
    tracker.reset()
    assert tracker.scores == {} and tracker.observe("a", None) == []
    with pytest.raises(ValueError):
        StragglerTracker(threshold=1.0)


def test_worker_signals_report_compute_time_as_period_minus_blocked(monkeypatch):
    from megascale.robustness import progress

    clock = iter([10.0, 13.0, 14.0, 20.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))

    class Recorder:
        blocked_s = 0.0
        by_group: dict = {}

        def blocked_by_group(self):
            return dict(self.by_group)

        def set_step(self, step):
            pass

        def set_section(self, name):
            pass

    class Progress:
        def __init__(self):
            self.compute = []

        def enter(self, section):
            pass

        def compute_time(self, seconds, comm_s=None):
            self.compute.append(seconds)
            self.comm = comm_s

    recorder, prog = Recorder(), Progress()
    signals = progress.WorkerSignals(recorder, prog)
    signals.current = "step"
    signals.step_started(1)  # t=10
    recorder.blocked_s, recorder.by_group = 2.0, {"dp": 1.5, "tp": 0.5}
    signals.step_started(2)  # t=13: period 3 s, 2 s of it blocked
    assert prog.compute == [1.0] and prog.comm == {"dp": 1.5, "tp": 0.5}
    signals.enter("checkpoint")  # a period with a checkpoint in it is not measured
    signals.enter("step")
    signals.step_started(3)  # t=14
    signals.step_started(4)  # t=20, nothing blocked
    assert prog.compute == [1.0, 6.0] and prog.comm == {"dp": 0.0, "tp": 0.0}
