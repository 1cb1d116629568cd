"""Every parallel layout that fits 1 to 8 GPUs gives the loss and grad norm of the 1-GPU reference,
step by step, over NCCL (the distributed tier's gloo comparisons, on real GPUs)."""

from __future__ import annotations

import math

import pytest
from gpu_jobs import small_job
from harness import train_steps, with_changes

pytestmark = pytest.mark.gpu

LAYOUTS = {
    # name: (GPUs, parallel settings)
    "dp2": (2, {}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "pp2": (2, {"pp": 2}),
    "tp2-dp2-sp": (4, {"tp": 2, "sequence_parallel": True}),
    "tp2-pp2": (4, {"tp": 2, "pp": 2}),
    "pp4-vpp2": (4, {"pp": 4, "vpp": 2}),
    "dp8-replicated-optimizer": (8, {"distributed_optimizer": False}),
    "tp8-sp": (8, {"tp": 8, "sequence_parallel": True}),
    "tp2-pp2-dp2-sp-vpp2": (8, {"tp": 2, "pp": 2, "vpp": 2, "sequence_parallel": True}),
}
STEPS = 3
# fp32 on GPU: TP/DP split the GEMMs and reductions differently, and kernels are not
# deterministic; this is far below any real bug (a wrong shard, a missing reduction: >1e-2).
REL_TOL = 2e-4


@pytest.fixture(scope="module")
def reference(data_dir):
    return train_steps(small_job(), 1, data_dir, steps=STEPS)


def _assert_close(got, want, what):
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want, strict=True), 1):
        assert math.isclose(loss, ref_loss, rel_tol=REL_TOL), (what, step, "loss", loss, ref_loss)
        assert math.isclose(norm, ref_norm, rel_tol=REL_TOL), (what, step, "grad", norm, ref_norm)


def test_reference_trains_and_matches_cpu(reference, data_dir):
    """One GPU vs one CPU process: same model, same data, same numbers (to fp32 noise)."""
    assert reference[0][0] != reference[-1][0]
    cpu = train_steps(small_job("cpu"), 1, data_dir, steps=STEPS)
    _assert_close(reference, cpu, "cuda vs cpu")


@pytest.mark.parametrize(
    "layout", [pytest.param(n, marks=pytest.mark.gpu(w)) for n, (w, _) in LAYOUTS.items()]
)
def test_layout_matches_one_gpu_reference(layout, reference, data_dir):
    world, parallel = LAYOUTS[layout]
    job = with_changes(small_job(), parallel=parallel)
    _assert_close(train_steps(job, world, data_dir, steps=STEPS), reference, layout)
