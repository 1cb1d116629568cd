"""Measure overlap: train a few steps per variant on every rank with a ``CommTrace`` installed.

``measure_rank`` runs on each rank (started by ``megascale.launcher.local.run_local``): for each
round and each variant it rebuilds the trainer with that variant's ``overlap`` settings, runs
``warmup`` untimed and ``steps`` timed steps, and returns per-step wall time, exposed communication,
loss, grad norm, and (optionally) the comm events and marks of the last step — so benchmarks and
ordering tests share one code path. Variants alternate within each round, so machine noise lands on
all of them alike.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from megascale.config import JobConfig
from megascale.overlap.trace import CommTrace
from megascale.parallel import cpu_backend
from megascale.parallel.groups import build_groups, destroy_groups, init_distributed
from megascale.train.run import seed_everything
from megascale.train.trainer import Trainer


def with_overlap(job: JobConfig, **changes) -> JobConfig:
    return dataclasses.replace(job, overlap=dataclasses.replace(job.overlap, **changes))


def _instrument(trainer: Trainer, trace: CommTrace) -> None:
    """Marks: step start, batch loaded, first forward of the step, backward done (grad finalize)."""
    first_forward = {"seen": False}

    def on_forward(_module, _inputs):
        if not first_forward["seen"]:
            first_forward["seen"] = True
            trace.mark("forward_start")

    trainer.model[0].module.register_forward_pre_hook(on_forward)
    finalize = trainer.config.finalize_model_grads_func

    def finalize_with_mark(*args, **kwargs):
        trace.mark("backward_done")
        return finalize(*args, **kwargs)

    trainer.config.finalize_model_grads_func = finalize_with_mark
    next_step = trainer.data.next_step

    def next_step_with_mark():
        batches = next_step()
        trace.mark("data_loaded")
        return batches

    trainer.data.next_step = next_step_with_mark
    trainer.reset_first_forward = lambda: first_forward.update(seen=False)


def measure_rank(
    variants: dict[str, JobConfig],
    data_dir: Path,
    *,
    steps: int,
    warmup: int,
    rounds: int,
    latency_s: float,
    keep_events: bool = False,
) -> dict[str, list[dict]]:
    """Per variant, one dict per timed step. Collective: every rank runs the same variants."""
    torch.set_num_threads(1)
    first = next(iter(variants.values()))
    device = "cuda" if first.train.device == "cuda" else "cpu"
    init_distributed(device)
    if device == "cpu":
        cpu_backend.activate()
    trace = CommTrace(latency_s).install()
    results: dict[str, list[dict]] = {name: [] for name in variants}
    order = list(variants)
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            job = variants[name]
            groups = build_groups(job.parallel)
            seed_everything(job.train.seed, groups.tp_rank, device)
            trainer = Trainer(job, groups, device, data_cache_dir=data_dir)
            _instrument(trainer, trace)
            for i in range(warmup + steps):
                trainer.reset_first_forward()
                trace.reset()
                torch.distributed.barrier()
                trace.mark("step_start")
                start = time.perf_counter()
                m = trainer.step()
                if device == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
                events, marks, exposed = trace.reset()
                if i < warmup:
                    continue
                row = {
                    "time_s": elapsed,
                    "exposed_s": exposed,
                    "loss": m.loss,
                    "grad_norm": m.grad_norm,
                }
                if keep_events:
                    row["events"] = [dataclasses.asdict(e) for e in events]
                    row["marks"] = [dataclasses.asdict(mk) for mk in marks]
                results[name].append(row)
            del trainer
    trace.uninstall()
    destroy_groups()
    return results
