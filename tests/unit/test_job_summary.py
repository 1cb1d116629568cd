"""The controller's job summary: figures from one rank (the lowest), never summed; the newest
durable checkpoint by time; written with decisions or at most every interval."""

from __future__ import annotations

from types import SimpleNamespace

from megascale.robustness.effective import EffectiveTime
from megascale.robustness.job_summary import VERSION, JobSummary

FSM = SimpleNamespace(
    state=SimpleNamespace(value="running"), generation=1, step=7, faults=[], restarts=0
)


def entry(step, tokens, mfu=0.1, checkpoint=None):
    return {
        "step": step,
        "tokens_per_s": tokens,
        "mfu": mfu,
        "mfu_peak": "p",
        "checkpoint": checkpoint,
    }


def test_figures_come_from_the_lowest_rank_once_not_summed():
    s = JobSummary()
    s.observe({"2": entry(6, 900.0), "3": entry(6, 950.0)})  # node-1's ranks arrive first
    assert (s.tokens_per_s, s.figures_step) == (900.0, 6)
    s.observe({"0": entry(5, 1000.0), "1": entry(5, 1010.0)})
    assert (s.tokens_per_s, s.figures_step) == (1000.0, 5)  # rank 0 from now on
    s.observe({"2": entry(8, 800.0)})
    assert s.tokens_per_s == 1000.0
    s.observe({"0": entry(7, 1100.0, mfu=0.2)})
    assert (s.tokens_per_s, s.mfu, s.figures_step) == (1100.0, 0.2, 7)
    s.new_generation()  # restarted from step 4: the new generation's first report wins
    s.observe({"1": entry(5, 700.0)})
    assert (s.tokens_per_s, s.figures_step) == (700.0, 5)


def test_newest_durable_checkpoint_by_time_survives_a_rollback():
    s = JobSummary()
    s.observe({"0": entry(8, 1.0, checkpoint={"step": 8, "time": 100.0, "url": "u8"})})
    s.observe({"0": entry(9, 1.0, checkpoint={"step": 4, "time": 50.0, "url": "u4"})})
    assert s.checkpoint == {"step": 8, "time": 100.0, "url": "u8"}
    s.observe({"0": entry(6, 1.0, checkpoint={"step": 6, "time": 200.0, "url": "u6"})})
    assert s.checkpoint["step"] == 6  # saved after a restart from step 4: newer, lower step


def test_written_when_changed_at_most_every_interval_or_with_a_decision():
    s = JobSummary()
    assert not s.due(0.0, 0.25)
    s.observe({"0": entry(1, 10.0)})
    assert s.due(0.0, 0.25)
    effective = EffectiveTime(0.0)
    value = s.to_json(FSM, effective, 10.0)
    assert value["version"] == VERSION and value["step"] == 7 and value["tokens_per_s"] == 10.0
    assert value["effective"] == {"productive_s": 0.0, "wall_s": 10.0, "ratio": 0.0}
    assert not s.due(10.1, 0.25)  # nothing changed
    s.changed = True
    assert not s.due(10.1, 0.25) and s.due(10.1, 0.25, force=True) and s.due(10.3, 0.25)
