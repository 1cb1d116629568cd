"""``EffectiveTime``: time on steps that were kept counts once; start-up and lost work do not."""

from __future__ import annotations

import pytest

from megascale.controller.effective import EffectiveTime


def test_steps_count_once_with_their_latest_time_and_start_up_is_lost():
    eff = EffectiveTime(start=0.0)
    eff.new_generation()
    eff.observe(1, 10.0)  # 10 s of start-up before the first step: not productive
    eff.observe(5, 14.0)  # steps 2-5: 1 s each
    eff.observe(5, 15.0)  # no progress
    eff.observe(9, 22.0)  # steps 6-9: 2 s each (8 s since step 5 was seen done)
    assert eff.productive_s == pytest.approx(4 + 8)
    assert eff.ratio(22.0) == pytest.approx(12 / 22)
    # A fault; generation 2 resumes from the checkpoint at step 4 and redoes 5-9 at 0.5 s each.
    eff.new_generation()
    eff.observe(5, 40.0)
    eff.observe(9, 42.0)
    # Steps 2-4 (1 s each) and step 5's first time stay; 6-9 count with their new time.
    assert eff.productive_s == pytest.approx(3 + 1 + 4 * 0.5)
    eff.observe(12, 43.5)
    assert eff.productive_s == pytest.approx(6 + 3 * 0.5)
    assert eff.ratio(43.5) == pytest.approx(7.5 / 43.5)


def test_nothing_counts_before_time_passes_or_a_step_is_done():
    eff = EffectiveTime(start=5.0)
    assert eff.ratio(5.0) == 0.0
    eff.observe(3, 6.0)
    assert eff.productive_s == 0.0 and eff.ratio(7.0) == 0.0
