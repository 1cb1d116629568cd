"""The straggler model (``megascale.controller.stragglers``): per-stage scores, the live tracker,
and the progress fields that feed it; pure, hand-written inputs and expectations."""

from __future__ import annotations

import pytest

from megascale.controller.stragglers import StragglerTracker, node_scores, stage_scores

# PP2 x DP2 x TP2 on 2 nodes with the stages across nodes: node-0 holds ranks 0,1 (stage 0) and
# 4,5 (stage 1); node-1 holds 2,3 (stage 0) and 6,7 (stage 1). The last stage (LM head and loss)
# computes 1.5x the first.
STAGE = {r: r // 4 for r in range(8)}
NODE = {0: "node-0", 1: "node-0", 4: "node-0", 5: "node-0"} | {
    2: "node-1",
    3: "node-1",
    6: "node-1",
    7: "node-1",
}


def test_scores_compare_a_rank_with_the_median_of_its_stage_peers_only():
    compute = {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0, 4: 1.5, 5: 1.5, 6: 1.5, 7: 1.5}
    s = stage_scores(compute, STAGE)
    # rank 3: 2.0 / median(1.0, 1.0, 1.0); ranks 0-2: 1.0 / median(1.0, 1.0, 2.0) = 1.0
    assert s == {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0, 4: 1.0, 5: 1.0, 6: 1.0, 7: 1.0}
    assert node_scores(s, NODE) == {"node-0": (1.0, 0), "node-1": (2.0, 3)}


def test_a_heavier_stage_and_a_lone_rank_get_no_score_against_other_stages():
    assert stage_scores({0: 1.0, 1: 3.0}, {0: 0, 1: 1}) == {}  # PP2, one rank per stage
    # A rank without a time or a stage is left out; the others still compare among themselves.
    assert stage_scores({0: 1.0, 1: 1.2, 2: None, 3: 0.0, 4: 9.0}, {0: 0, 1: 0, 2: 0, 3: 0}) == {
        0: pytest.approx(1 / 1.2),
        1: pytest.approx(1.2),
    }


def _feed(tracker, rounds, times):
    flagged = []
    for _ in range(rounds):
        for rank, t in times.items():
            flagged += tracker.observe(rank, NODE[rank], STAGE[rank], t)
    return flagged


EVEN = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.5, 5: 1.5, 6: 1.5, 7: 1.5}


def test_a_persistently_slow_rank_names_its_node_once():
    tracker = StragglerTracker(threshold=1.10, window=2, consecutive=3)
    slow = EVEN | {6: 1.8}  # 1.8 / median(1.5, 1.5, 1.5) = 1.2
    assert _feed(tracker, 3, slow) == []  # windows close at rounds 2 and 3
    assert tracker.scores == {"node-0": 1.0, "node-1": pytest.approx(1.2)}
    assert tracker.slowest["node-1"] == 6 and tracker.rank_scores[7] == 1.0
    assert _feed(tracker, 1, slow) == ["node-1"]
    assert _feed(tracker, 5, slow) == []  # once


def test_the_heavier_last_stage_flags_nobody():
    tracker = StragglerTracker(threshold=1.10, window=1, consecutive=1)
    assert _feed(tracker, 5, EVEN) == []
    assert set(tracker.rank_scores.values()) == {1.0}


def test_noise_and_a_brief_slowdown_are_not_flagged():
    tracker = StragglerTracker(threshold=1.10, window=3, consecutive=2)
    assert _feed(tracker, 10, EVEN | {2: 1.05}) == []
    tracker.observe(2, "node-1", 0, 5.0)  # one slow step among three: the median stays even
    assert _feed(tracker, 10, EVEN) == []


def test_recovery_rearms_and_reset_and_forget():
    tracker = StragglerTracker(threshold=1.5, window=1, consecutive=1)
    assert _feed(tracker, 1, EVEN | {1: 2.0}) == ["node-0"]
    assert _feed(tracker, 1, EVEN) == []
    assert _feed(tracker, 1, EVEN | {1: 2.0}) == ["node-0"]
    tracker.forget("node-0")
    assert "node-0" not in tracker.scores and 1 not in tracker.rank_scores
    assert set(tracker.rank_nodes().values()) == {"node-1"}
    tracker.reset()
    assert tracker.scores == {} and tracker.observe(0, "node-0", 0, None) == []
    assert tracker.observe(0, "node-0", None, 1.0) == []  # no stage: not scored
    with pytest.raises(ValueError):
        StragglerTracker(threshold=1.0)


def test_worker_signals_write_the_compute_time_and_stage(tmp_path):
    from megascale.probes import progress

    path = progress.progress_path(tmp_path, 3)
    signals = progress.WorkerSignals(_Recorder(), progress.ProgressFile(path, 3))
    signals.stage(1)
    signals.step_started(1)

    signals.step_done(_metrics(), None)  # nothing measured yet
    state = progress.read_progress(path)
    assert (state.stage, state.compute_time_s, state.compute_step) == (1, None, None)
    signals.step_done(metrics := _metrics(), (1, 0.25))
    state = progress.read_progress(path)
    assert (state.stage, state.compute_time_s, state.compute_step) == (1, 0.25, 1)
    assert metrics.compute_time_s == 0.25


def test_worker_signals_report_the_step_periods_blocked_time_by_group(tmp_path):
    from megascale.probes import progress

    path = progress.progress_path(tmp_path, 0)
    recorder = _Recorder()
    signals = progress.WorkerSignals(recorder, progress.ProgressFile(path, 0))
    signals.step_started(1)
    recorder.by_group = {"dp": 1.5, "tp": 0.5}
    signals.step_started(2)  # the period of step 1: 1.5 s blocked in dp, 0.5 s in tp
    signals.step_done(metrics := _metrics(), None)
    assert metrics.comm_time_s == {"dp": 1.5, "tp": 0.5}
    assert progress.read_progress(path).comm_time_s == {"dp": 1.5, "tp": 0.5}
    signals.enter("checkpoint")  # a period with a checkpoint in it is not a step's
    signals.step_started(3)
    recorder.by_group = {"dp": 2.0, "tp": 0.5}
    signals.step_started(4)
    assert signals.comm_time_s == {"dp": 0.5, "tp": 0.0}


def _metrics():
    from megascale.messages import StepMetrics

    return StepMetrics(step=1, loss=2.0, grad_norm=1.0, lr=0.1, step_time_s=0.5, tokens_per_s=1.0)


class _Recorder:
    blocked_s = 0.0
    by_group: dict = {}

    def blocked_by_group(self):
        return dict(self.by_group)

    def set_step(self, step):
        pass

    def set_section(self, name):
        pass
