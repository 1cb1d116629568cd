"""A checkpoint saved at TP2 x PP2 x DP2 + SP with the distributed optimizer resumes at other
layouts and continues exactly as the uninterrupted 1-process run; a layout change never touches
the checkpoints it cannot use."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import with_changes

from megascale.config import load, validate
from megascale.launcher.local import run_local
from megascale.train.checkpoint import load as checkpoint_load
from megascale.train.checkpoint.storage import Storage
from megascale.train.run import run_rank

pytestmark = pytest.mark.slow

SAVED = (8, {"tp": 2, "pp": 2, "sequence_parallel": True, "distributed_optimizer": True})
TARGETS = {
    "1-rank": (1, {}),
    "dp4": (4, {"distributed_optimizer": True}),
    "tp2xdp2": (4, {"tp": 2, "distributed_optimizer": True}),
    "pp2xvpp2xdp2": (4, {"pp": 2, "vpp": 2, "distributed_optimizer": True}),
    "dp2-no-distopt": (2, {"distributed_optimizer": False}),
}
CASES = [
    *[("adam", False, target) for target in TARGETS],
    *[("lamb", True, target) for target in ("1-rank", "pp2xvpp2xdp2", "dp2-no-distopt")],
]


def _job(world: int, optimizer: str, parallel_block: bool, **parallel):
    job = with_changes(
        load("tiny"),
        parallel=parallel,
        model={"seq_length": 32, "parallel_block": parallel_block},
        optim={"name": optimizer, "warmup_steps": 2},
        train={"steps": 6, "global_batch_size": 8, "micro_batch_size": 2},
        checkpoint={"interval": 3, "keep": 2},
    )
    return validate(job, world, "gloo")


def _numbers(history):
    return [(m.step, m.loss, m.grad_norm) for m in history]


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """Per (optimizer, block): the uninterrupted 1-process run, and a run dir whose TP2xPP2xDP2+SP
    run stopped after step 3 with its checkpoint."""
    cache = {}

    def get(optimizer: str, parallel_block: bool):
        if (optimizer, parallel_block) not in cache:
            root = tmp_path_factory.mktemp(f"{optimizer}-{parallel_block}")
            reference = run_local(
                run_rank, 1, (_job(1, optimizer, parallel_block), root / "ref"), timeout_s=300
            )[0]
            world, parallel = SAVED
            job = _job(world, optimizer, parallel_block, **parallel)
            first = run_local(run_rank, world, (job, root / "saved", 3), timeout_s=300)[0]
            cache[optimizer, parallel_block] = (_numbers(reference), _numbers(first), root)
        return cache[optimizer, parallel_block]

    return get


@pytest.mark.parametrize(
    "optimizer, parallel_block, target",
    CASES,
    ids=[f"{o}-{'parallel' if b else 'serial'}-{t}" for o, b, t in CASES],
)
def test_resume_at_another_layout_matches_the_uninterrupted_run(
    saved_runs, tmp_path, optimizer, parallel_block, target
):
    reference, first, root = saved_runs(optimizer, parallel_block)
    run_dir = tmp_path / "run"
    shutil.copytree(root / "saved", run_dir)
    world, parallel = TARGETS[target]
    job = _job(world, optimizer, parallel_block, **parallel)
    second = _numbers(run_local(run_rank, world, (job, run_dir), timeout_s=300)[0])

    assert [s for s, _, _ in second] == [4, 5, 6]
    for (step, loss, norm), (ref_step, ref_loss, ref_norm) in zip(
        first + second, reference, strict=True
    ):
        assert step == ref_step
        assert loss == pytest.approx(ref_loss, abs=1e-5), f"loss at step {step}"
        assert norm == pytest.approx(ref_norm, abs=1e-5), f"grad norm at step {step}"


def _vocab_job(world: int, **parallel):
    """A vocabulary of 300: 384 rows at TP1, 512 at TP2 (padded to 128 x TP)."""
    job = with_changes(_job(1, "adam", False), model={"vocab_size": 300}, parallel=parallel)
    return validate(job, world, "gloo")


@pytest.mark.parametrize(
    "saved, resumed",
    [((1, {}), (2, {"tp": 2})), ((2, {"tp": 2, "sequence_parallel": True}), (1, {}))],
    ids=["tp1-to-tp2", "tp2-to-tp1"],
)
def test_a_vocabulary_padded_for_another_tp_resumes_the_run(tmp_path, saved, resumed):
    """The padding rows differ (384 and 512) but take no part in the loss: the run saved at one TP
    and resumed at the other continues as the uninterrupted 1-process run, step by step."""
    reference = _numbers(
        run_local(run_rank, 1, (_vocab_job(1), tmp_path / "ref"), timeout_s=300)[0]
    )
    run_dir = tmp_path / "run"
    (world, parallel), (world2, parallel2) = saved, resumed
    first = run_local(run_rank, world, (_vocab_job(world, **parallel), run_dir, 3), timeout_s=300)
    second = run_local(run_rank, world2, (_vocab_job(world2, **parallel2), run_dir), timeout_s=300)
    numbers = _numbers(first[0]) + _numbers(second[0])
    assert [s for s, _, _ in numbers] == [1, 2, 3, 4, 5, 6]
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(numbers, reference, strict=True):
        assert loss == pytest.approx(ref_loss, abs=1e-5), f"loss at step {step}"
        assert norm == pytest.approx(ref_norm, abs=1e-5), f"grad norm at step {step}"


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _train(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megascale.cli", "train", "--run-dir", str(run_dir)]
    command += ["--set", "checkpoint.interval=5", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def test_layout_change_reshards_or_refuses_and_never_touches_the_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    first = _train(run_dir, "--set", "train.steps=10")
    assert first.returncode == 0, first.stderr[-2000:]
    before = _tree_digest(run_dir / "checkpoints")
    metrics = (run_dir / "metrics.jsonl").read_text()
    assert Storage(run_dir / "checkpoints").complete_steps() == [5, 10]

    refused = _train(
        run_dir,
        "--set",
        "train.steps=20",
        "--nproc-per-node",
        "2",
        "--set",
        "checkpoint.reshard=false",
    )
    assert refused.returncode == 2
    assert "Traceback" not in refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("megascale: cannot start:"), line
    assert "TP1 x PP1 x DP1" in line and "TP1 x PP1 x DP2" in line
    assert "checkpoint.reshard = true" in line
    assert _tree_digest(run_dir / "checkpoints") == before  # nothing removed, demoted or added
    assert (run_dir / "metrics.jsonl").read_text() == metrics

    resumed = _train(run_dir, "--set", "train.steps=20", "--nproc-per-node", "2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))  # continued from step 10, not from step 1
    manifest = json.loads((run_dir / "checkpoints" / "step_00000020" / "manifest.json").read_text())
    assert manifest["layout"]["dp"] == 2
    assert checkpoint_load.complete_checkpoints(run_dir / "checkpoints")[-1].name == "step_00000020"
