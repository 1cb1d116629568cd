"""In-memory snapshots from GPU memory (``train.memory_snapshot``): a rank's state is copied
into pinned host memory after a step, on a stream of its own while the next step runs (whose
update waits for the copy), and a second generation in the same process, with the process
groups torn down and formed again, restores it into a freshly built trainer on the GPU and
continues as the run without the interruption did."""

from __future__ import annotations

import math
import os

import pytest
from gpu_jobs import in_child, small_job

from megascale.train.run import run_rank

pytestmark = pytest.mark.gpu

STEPS, STOP, EVERY = 8, 5, 2  # snapshots after steps 2 and 4; step 5 updates after the copy


def _two_generations(job, run_dir):
    from megascale.launcher.local import free_port
    from megascale.model.gpt import release_model_caches
    from megascale.train.memory_snapshot import SnapshotStore

    store = SnapshotStore(interval=EVERY, local_world=1)
    first = run_rank(job, run_dir, stop_after=STOP, memory=store)  # its groups end with it
    taken = store.take_s
    pinned = store.own[-1].payload.is_pinned()
    release_model_caches()
    os.environ["MASTER_PORT"] = str(free_port())  # the next generation's rendezvous
    second = run_rank(job, run_dir, memory=store)
    return first, second, taken, pinned


def test_a_snapshot_in_host_memory_restores_a_gpu_trainer(tmp_path):
    job = small_job(train={"steps": STEPS}, checkpoint={"interval": 0})
    reference = in_child(run_rank, job, tmp_path / "reference")
    first, second, taken_s, pinned = in_child(_two_generations, job, tmp_path / "resident")
    assert [m.step for m in first] == list(range(1, STOP + 1))
    # restored from memory (no checkpoint was written): step 4's snapshot, taken before step 5
    # updated the state in place, so the second generation redoes step 5
    assert [m.step for m in second] == list(range(4 + 1, STEPS + 1))
    assert not (tmp_path / "resident" / "checkpoints").exists() or not any(
        (tmp_path / "resident" / "checkpoints").iterdir()
    )
    assert pinned and 0 < taken_s < 5, (pinned, taken_s)
    for got, want in zip(first[:4] + second, reference, strict=True):
        # the same kernels on the same GPU; atomics in a few backward kernels may reorder sums
        assert math.isclose(got.loss, want.loss, rel_tol=1e-5), (got, want)
        assert math.isclose(got.grad_norm, want.grad_norm, rel_tol=1e-4), (got, want)
