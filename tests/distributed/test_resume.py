"""Stop after k steps, resume from the checkpoint, and get exactly the uninterrupted run's losses."""

from __future__ import annotations

import json

import pytest
from harness import with_changes

from megascale.config import load, validate
from megascale.launcher.local import run_local
from megascale.train.checkpoint import load as checkpoint_load
from megascale.train.checkpoint import save as checkpoint
from megascale.train.run import run_rank

pytestmark = pytest.mark.slow


def _job(optimizer: str = "lamb"):
    # PP2 x DP2 with the distributed optimizer (sharded optimizer state), and dropout so that the
    # RNG state has to be restored too.
    job = with_changes(
        load("tiny"),
        parallel={"pp": 2, "distributed_optimizer": True},
        model={"hidden_dropout": 0.1, "attention_dropout": 0.1, "seq_length": 32},
        optim={"name": optimizer, "warmup_steps": 2},
        train={"steps": 6, "global_batch_size": 8, "micro_batch_size": 2},
        checkpoint={"interval": 3, "keep": 2},
    )
    return validate(job, 4, "gloo")


def _losses(history):
    return [(m.step, m.loss, m.grad_norm) for m in history]


@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_resume_matches_uninterrupted_run(tmp_path, optimizer):
    job = _job(optimizer)
    whole = run_local(run_rank, 4, (job, tmp_path / "whole"), timeout_s=300)[0]

    first = run_local(run_rank, 4, (job, tmp_path / "resumed", 3), timeout_s=300)[0]
    assert [m.step for m in first] == [1, 2, 3]
    assert checkpoint_load.complete_checkpoints(tmp_path / "resumed" / "checkpoints")
    second = run_local(run_rank, 4, (job, tmp_path / "resumed"), timeout_s=300)[0]

    assert [m.step for m in second] == [4, 5, 6]
    assert _losses(first + second) == _losses(whole)  # exact, not approximate
    lines = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert all(json.loads(line)["data_wait_s"] >= 0.0 for line in lines)  # a figure every step


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path):
    job = with_changes(_job(), checkpoint={"interval": 2, "keep": 3})
    run_local(run_rank, 4, (job, tmp_path, 4), timeout_s=300)
    latest = checkpoint.step_dir(tmp_path / "checkpoints", 4)
    shard = latest / "rank_00003" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100] + b"\0" * 100)  # same size, wrong content

    resumed = run_local(run_rank, 4, (job, tmp_path), timeout_s=300)[0]
    assert [m.step for m in resumed] == [3, 4, 5, 6]  # resumed from step 2, not the corrupt 4
