"""One rank's life: join the job, build the trainer, resume, train, checkpoint, report.

``run_rank`` is what every rank executes, whether started by ``megascale train --nproc-per-node N``
(``megascale.launcher.local``) or by ``torchrun``. Rank 0 writes ``config.toml`` and
``metrics.jsonl`` and shows progress; every rank logs to ``logs/rank_NNNNN.log``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from megascale.config import JobConfig, to_toml
from megascale.diagnostics.flops import PEAK_TFLOPS, lookup_peak
from megascale.logs import setup_logging
from megascale.parallel import cpu_backend
from megascale.parallel.groups import build_groups, destroy_groups, init_distributed
from megascale.train import checkpoint
from megascale.train.trainer import StepMetrics, Trainer

logger = logging.getLogger("megascale")


def resolve_device(requested: str) -> str:
    """ "auto" -> "cuda" when a GPU is visible, else "cpu"."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device='cuda' but no CUDA device is visible; use 'cpu' or 'auto'")
    return requested


class Progress:
    """Rank 0's progress: a redrawn bar on a terminal, one plain line per log interval otherwise."""

    def __init__(self, total: int, interval: int, stream=sys.stdout) -> None:
        self.total, self.interval, self.stream = total, max(1, interval), stream
        self.tty = stream.isatty()

    def update(self, m: StepMetrics) -> None:
        mfu = f" mfu {m.mfu:.1%}" if m.mfu is not None else ""
        text = (
            f"step {m.step}/{self.total} loss {m.loss:.4f} grad_norm {m.grad_norm:.3f} "
            f"lr {m.lr:.2e} {m.step_time_s * 1e3:.0f} ms {m.tokens_per_s:,.0f} tok/s{mfu}"
        )
        if self.tty:
            filled = int(30 * m.step / self.total)
            bar = "#" * filled + "." * (30 - filled)
            end = "\n" if m.step == self.total else ""
            self.stream.write(f"\r[{bar}] {text}\x1b[K{end}")
            self.stream.flush()
        elif m.step % self.interval == 0 or m.step == self.total:
            self.stream.write(text + "\n")
            self.stream.flush()


def _peak_tflops(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    try:
        return lookup_peak(name)[1]
    except ValueError:
        logger.warning(
            "no dense bf16 peak known for %r (known: %s); MFU not reported",
            name,
            ", ".join(PEAK_TFLOPS),
        )
        return None


def run_rank(job: JobConfig, run_dir: Path, stop_after: int | None = None) -> list[StepMetrics]:
    """Train ``job`` as this rank (env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Collective.

    Resumes from the latest complete checkpoint in ``run_dir`` when ``checkpoint.resume`` is set.
    ``stop_after`` ends this process's run after that global step (a planned preemption): the
    schedule still follows ``train.steps``, so a later run resumes exactly where this one stopped.
    """
    run_dir = Path(run_dir)
    # Sequence parallelism relies on kernels being issued in order on one hardware queue.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    device = resolve_device(job.train.device)
    rank, _world = init_distributed(device)
    setup_logging(rank, run_dir)
    if device == "cpu":
        cpu_backend.activate()
        torch.set_num_threads(
            max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        )
    groups = build_groups(job.parallel)
    _seed(job.train.seed, groups.tp_rank, device)
    trainer = Trainer(
        job, groups, device, data_cache_dir=run_dir / "data", peak_tflops=_peak_tflops(device)
    )
    ckpt_root = run_dir / "checkpoints"
    if job.checkpoint.resume and (start := checkpoint.load_latest(trainer, ckpt_root)) is not None:
        logger.info("resuming at step %d", start)
    if rank == 0:
        (run_dir / "config.toml").write_text(to_toml(job))
        logger.info("%s; %d steps", groups.layout.describe(0), job.train.steps)
    progress = Progress(job.train.steps, job.train.log_interval) if rank == 0 else None
    history: list[StepMetrics] = []
    metrics_file = open(run_dir / "metrics.jsonl", "a") if rank == 0 else None
    try:
        last = job.train.steps if stop_after is None else min(stop_after, job.train.steps)
        while trainer.step_num < last:
            metrics = trainer.step()
            history.append(metrics)
            if metrics_file is not None:
                metrics_file.write(json.dumps({**metrics.to_dict(), "time": time.time()}) + "\n")
                metrics_file.flush()
            if progress is not None:
                progress.update(metrics)
            interval = job.checkpoint.interval
            if interval and (
                trainer.step_num % interval == 0 or trainer.step_num == job.train.steps
            ):
                checkpoint.save(trainer, ckpt_root, job.checkpoint.keep)
    finally:
        if metrics_file is not None:
            metrics_file.close()
    destroy_groups()
    return history


def _seed(seed: int, tp_rank: int, device: str) -> None:
    from megatron.core import tensor_parallel

    if device == "cpu":
        cpu_backend.seed_rng_tracker(seed, tp_rank)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
