"""The ideal-machine pipeline model behind the PP figures in benchmarks/RESULTS.md
(``benchmarks/pp_schedule_bound.py``): megatron-core's orders, counted by the benchmark's measure."""

from __future__ import annotations

import pytest
from script_loader import load_script


@pytest.fixture(scope="module")
def bound():
    return load_script("benchmarks/pp_schedule_bound.py", "pp_schedule_bound")


@pytest.mark.parametrize("stages,chunks,microbatches", [(2, 1, 8), (4, 1, 4), (2, 2, 8), (4, 3, 8)])
def test_every_stage_runs_each_forward_and_backward_once_forward_first(
    bound, stages, chunks, microbatches
):
    for ops in bound.schedule(stages, microbatches, chunks):
        expected = {(k, c, i) for k in "FB" for c in range(chunks) for i in range(microbatches)}
        assert sorted(ops) == sorted(expected)
        assert all(ops.index(("F", c, i)) < ops.index(("B", c, i)) for _, c, i in ops)


def test_plain_1f1b_two_stages_two_microbatches_by_hand(bound):
    # Stage 1 waits for a0 (fill), stage 0 for g0 and for g1 (its last backward): three of the
    # four transfers are on the critical path; a1 arrives while stage 1 computes F0.
    assert bound.hidden_share(2, 2, 0.2) == pytest.approx(0.25)
    _, step = bound.run(2, 2, 0.2)
    assert step == pytest.approx(7.2 + 0.2 + 2.0)  # stage 0's B1 starts when g1 lands


def test_interleaving_hides_what_plain_1f1b_cannot(bound):
    plain = [bound.hidden_share(2, m, 0.2) for m in (8, 32)]
    assert max(plain) <= 0.5  # the steady phase's round trip stays on the critical path
    assert bound.hidden_share(2, 8, 0.2, chunks=2) > 0.75 > max(plain)
    assert bound.hidden_share(2, 32, 0.2, chunks=2) > bound.hidden_share(2, 8, 0.2, chunks=2)
