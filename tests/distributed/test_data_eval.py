"""Validation loss: at the configured steps, and equal for every parallel layout (DP2 with the
distributed optimizer's overlapped param gather, TP2, PP2 with megatron-core's forward-only
pipeline schedule) to the 1-process run's."""

from __future__ import annotations

import math

import pytest
from harness import train_and_evaluate, with_changes

from megascale.config import load

pytestmark = pytest.mark.slow

STEPS = 4
RTOL = 1e-5

LAYOUTS = {
    "dp2-distopt": (2, {"distributed_optimizer": True}),
    "tp2": (2, {"tp": 2}),
    "pp2": (2, {"pp": 2}),
}


def _job():
    return with_changes(
        load("tiny"),
        model={"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 32},
        train={"global_batch_size": 4, "micro_batch_size": 1, "steps": STEPS,
               "eval_interval": 3, "eval_steps": 2},
        optim={"warmup_steps": 0, "lr": 3e-3},
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(data_dir):
    return train_and_evaluate(_job(), 1, data_dir, STEPS)


def test_validation_loss_at_the_configured_steps(reference):
    # eval_interval 3 over 4 steps: step 3, and the last step.
    assert [step for step, (_, val) in enumerate(reference, 1) if val is not None] == [3, 4]
    assert all(math.isfinite(val) for _, val in reference if val is not None)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_validation_loss_equal_across_layouts(reference, data_dir, layout):
    world, parallel = LAYOUTS[layout]
    got = train_and_evaluate(with_changes(_job(), parallel=parallel), world, data_dir, STEPS)
    for step, ((loss, val), (ref_loss, ref_val)) in enumerate(zip(got, reference, strict=True), 1):
        assert loss == pytest.approx(ref_loss, rel=RTOL), (layout, step)
        if ref_val is None:
            assert val is None
        else:
            assert val == pytest.approx(ref_val, rel=RTOL, abs=1e-5), (layout, step)
