"""The controller's job summary: figures from rank 0's node, never summed; the newest
durable checkpoint by time; written with decisions or at most every interval."""

from __future__ import annotations

from types import SimpleNamespace

from megascale.controller.effective import EffectiveTime
from megascale.controller.job_summary import JobSummary
from megascale.messages import DurableCheckpoint, Heartbeat, JobSummaryRecord, RankFigures

FSM = SimpleNamespace(
    state=SimpleNamespace(value="running"), generation=1, step=7, faults=[], restarts=0
)


def beat(step, tokens, mfu=0.1, durable=None):
    """A heartbeat of rank 0's node (the only one that carries job-wide figures)."""
    return Heartbeat(
        node="node-0",
        tokens_per_s=tokens,
        mfu=mfu,
        mfu_peak="p",
        durable=durable,
        ranks={"0": RankFigures(step=step), "1": RankFigures(step=step)},
    )


def test_figures_are_rank_0s_as_its_node_reports_them_never_summed():
    s = JobSummary()
    s.observe(Heartbeat(node="node-1", ranks={"2": RankFigures(step=6)}))  # no job figures
    assert (s.tokens_per_s, s.figures_step, s.changed) == (None, None, False)
    s.observe(beat(5, 1000.0))
    assert (s.tokens_per_s, s.figures_step) == (1000.0, 5)
    s.observe(beat(4, 800.0))  # an older report
    assert s.tokens_per_s == 1000.0
    s.observe(beat(7, 1100.0, mfu=0.2))
    assert (s.tokens_per_s, s.mfu, s.mfu_peak, s.figures_step) == (1100.0, 0.2, "p", 7)
    s.new_generation()  # restarted from step 4: the new generation's first report wins
    s.observe(beat(5, 700.0))
    assert (s.tokens_per_s, s.figures_step) == (700.0, 5)


def test_newest_durable_checkpoint_by_time_survives_a_rollback():
    s = JobSummary()
    s.observe(beat(8, 1.0, durable=DurableCheckpoint(8, 100.0, "u8")))
    s.observe(beat(9, 1.0, durable=DurableCheckpoint(4, 50.0, "u4")))
    assert s.checkpoint == DurableCheckpoint(8, 100.0, "u8")
    s.observe(beat(6, 1.0, durable=DurableCheckpoint(6, 200.0, "u6")))
    assert s.checkpoint.step == 6  # saved after a restart from step 4: newer, lower step


def test_written_when_changed_at_most_every_interval_or_with_a_decision():
    s = JobSummary()
    assert not s.due(0.0, 0.25)
    s.observe(beat(1, 10.0))
    assert s.due(0.0, 0.25)
    effective = EffectiveTime(0.0)
    value = JobSummaryRecord.decode(s.to_json(FSM, effective, 10.0))
    assert value.step == 7 and value.tokens_per_s == 10.0
    assert (value.effective.productive_s, value.effective.wall_s, value.effective.ratio) == (
        0.0,
        10.0,
        0.0,
    )
    assert not s.due(10.1, 0.25)  # nothing changed
    s.changed = True
    assert not s.due(10.1, 0.25) and s.due(10.1, 0.25, force=True) and s.due(10.3, 0.25)
