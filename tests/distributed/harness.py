"""Run a few training steps of a JobConfig on N forked ranks and collect per-step numbers: gloo on
CPU (the distributed tier), NCCL on GPUs when ``job.train.device`` is "cuda" (tests/gpu).

megatron-core is imported once here, in the pytest process; ranks are forked from it, so an 8-rank
run costs seconds instead of eight ~8 s imports. Each rank activates the CPU backend in its own
(forked) process, so the pytest process itself is never modified.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import megatron.core  # noqa: F401  (import once, before forking)
import torch

from megascale.config import JobConfig, validate
from megascale.launcher.local import run_local
from megascale.parallel import async_comm, cpu_backend
from megascale.parallel.groups import build_groups, destroy_groups, init_distributed
from megascale.train.run import is_eval_step, seed_everything
from megascale.train.trainer import Trainer


def _rank_trainer(job: JobConfig, data_dir: Path) -> Trainer:
    device = "cuda" if job.train.device == "cuda" else "cpu"
    init_distributed(device)  # cuda: this rank's GPU is LOCAL_RANK
    if device == "cpu":
        torch.set_num_threads(1)
        cpu_backend.activate()
        if job.parallel.async_collectives:
            async_comm.install()  # NCCL-like: collectives return at once, run on comm threads
    groups = build_groups(job.parallel)
    seed_everything(job.train.seed, groups.tp_rank, device)
    return Trainer(job, groups, device, data_cache_dir=data_dir)


def _rank_steps(
    job: JobConfig, data_dir: Path, steps: int, evaluate: bool = False
) -> list[tuple[float, ...]]:
    trainer = _rank_trainer(job, data_dir)
    out = []
    for _ in range(steps):
        m = trainer.step()
        if evaluate:  # the run loop's rule (megascale.train.run.is_eval_step)
            out.append((m.loss, trainer.evaluate() if is_eval_step(job, m.step) else None))
        else:
            out.append((m.loss, m.grad_norm))
    destroy_groups()
    return out


def train_steps(
    job: JobConfig, world: int, data_dir: Path, steps: int = 3
) -> list[tuple[float, float]]:
    """(loss, grad_norm) per step as rank 0 sees them (every rank agrees on both)."""
    job = validate(job, world, "nccl" if job.train.device == "cuda" else "gloo")
    return run_local(_rank_steps, world, (job, data_dir, steps), timeout_s=300)[0]


def train_and_evaluate(
    job: JobConfig, world: int, data_dir: Path, steps: int = 3
) -> list[tuple[float, float | None]]:
    """(loss, validation loss or None) per step as rank 0 sees them, evaluating on the steps
    ``train.eval_interval`` picks, exactly as ``megascale train`` does."""
    job = validate(job, world, "gloo")
    return run_local(_rank_steps, world, (job, data_dir, steps, True), timeout_s=300)[0]


def with_changes(job: JobConfig, **sections: dict) -> JobConfig:
    """A copy of ``job`` with fields replaced per section: with_changes(job, parallel={"tp": 2})."""
    replaced = {
        name: dataclasses.replace(getattr(job, name), **changes)
        for name, changes in sections.items()
    }
    return dataclasses.replace(job, **replaced)
