"""One rank's life: join the job, build the trainer, resume, train, checkpoint, report.

``run_rank`` is what every rank executes, whether started by ``megascale train --nproc-per-node N``
(``megascale.launcher.local``) or by ``torchrun``. Rank 0 writes ``config.toml`` and
``metrics.jsonl`` and shows progress; every rank logs to ``logs/rank_NNNNN.log``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from megascale import runfiles
from megascale.config import ConfigError, JobConfig, to_dict, to_toml
from megascale.data.blend import parse_blend
from megascale.data.corpus import default_token_file
from megascale.data.indexed import (
    TOKENIZER_FILES,
    DatasetInfo,
    bin_path,
    idx_path,
    tokenizer_copy_path,
)
from megascale.logs import setup_logging
from megascale.machine_check import resolve_device
from megascale.messages import CheckpointFigures, StepMetrics
from megascale.model.gpt import use_te_spec
from megascale.parallel import async_comm, cpu_backend
from megascale.parallel.groups import build_groups, destroy_groups, init_distributed
from megascale.probes import inject
from megascale.probes.fatal import RUN_DIR_ENV, fail_job
from megascale.probes.peak import Peak, peak_label, run_peak
from megascale.probes.profiling import open_nvtx, open_profiling
from megascale.probes.progress import WorkerSignals
from megascale.probes.sinks import Sinks, open_sinks
from megascale.probes.timers import build_timeline
from megascale.train.checkpoint import load as checkpoint_load
from megascale.train.checkpoint import save as checkpoint
from megascale.train.memory_snapshot import SnapshotStore
from megascale.train.trainer import Trainer

logger = logging.getLogger("megascale")


class Progress:
    """Rank 0's progress: a redrawn bar on a terminal, one plain line per log interval otherwise."""

    def __init__(self, total: int, interval: int, stream=sys.stdout) -> None:
        self.total, self.interval, self.stream = total, max(1, interval), stream
        self.tty = stream.isatty()

    def update(self, m: StepMetrics) -> None:
        mfu = ""
        if m.mfu is not None:  # labelled: a measured CPU peak is not a data-sheet GPU peak
            mfu = f" mfu {m.mfu:.1%} [peak {peak_label(m.mfu_peak_tflops, m.mfu_peak_source)}]"
        val = f" val_loss {m.val_loss:.4f}" if m.val_loss is not None else ""
        mem = ""  # CUDA only: the step's peak reserved memory
        if m.mem_max_reserved_gib is not None:
            mem = f" mem {m.mem_max_reserved_gib:.1f} GiB"
        text = (
            f"step {m.step}/{self.total} loss {m.loss:.4f}{val} grad_norm {m.grad_norm:.3f} "
            f"lr {m.lr:.2e} {m.step_time_s * 1e3:.0f} ms {m.tokens_per_s:,.0f} tok/s{mem}{mfu}"
        )
        if self.tty:
            filled = int(30 * m.step / self.total)
            bar = "#" * filled + "." * (30 - filled)
            end = "\n" if m.step == self.total else ""
            self.stream.write(f"\r[{bar}] {text}\x1b[K{end}")
            self.stream.flush()
        elif m.step % self.interval == 0 or m.step == self.total or m.val_loss is not None:
            self.stream.write(text + "\n")
            self.stream.flush()


def fp32_gemms_as_tf32(job: JobConfig, device: str) -> bool:
    """Whether the job's fp32 GEMMs run as TF32 on the tensor cores, which sets its MFU peak:
    Transformer Engine's always do (its spec on CUDA), torch's when
    ``torch.backends.cuda.matmul.allow_tf32`` is set (off by default). False on CPU."""
    if device != "cuda":
        return False
    try:
        te = use_te_spec(job.model, device)
    except ValueError:  # the TE spec without TE: the trainer refuses the job, on every rank
        te = False
    return te or torch.backends.cuda.matmul.allow_tf32


def agreed_peak(job: JobConfig, device: str) -> Peak | None:
    """The MFU peak every rank uses: rank 0's (``probes.peak.run_peak``: measured once on
    CPU, cached per machine), broadcast so that all ranks report one MFU. Collective; before the
    first step, never on the step path."""
    found = [None]
    if torch.distributed.get_rank() == 0:
        tf32 = fp32_gemms_as_tf32(job, device)
        found[0] = run_peak(device, job.model.params_dtype, job.train.peak_tflops, tf32=tf32)
    torch.distributed.broadcast_object_list(found, src=0)
    return found[0]


class MetricsLog:
    """``metrics.jsonl``: one JSON object per step, written by rank 0.

    On open it keeps only the lines up to ``resumed_step`` (0 for a fresh run), so steps redone after
    a restart from an older checkpoint appear once, and a fresh run in an old directory starts clean.
    Each record also goes to ``sinks`` (TensorBoard, W&B: ``probes.sinks``; none by default).
    """

    def __init__(self, path: Path, resumed_step: int, sinks: Sinks | None = None) -> None:
        self.sinks = sinks or Sinks()
        kept = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= resumed_step:
                        kept.append(line + "\n")
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line from a crash
        runfiles.write_text(path, "".join(kept))
        self._file = runfiles.open_append(path)

    def write(self, metrics: StepMetrics) -> None:
        metrics.time = time.time()
        record = metrics.encode()
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.sinks.write(record)

    def close(self) -> None:
        self._file.close()
        self.sinks.close()


def start_rank(
    job: JobConfig, run_dir: Path, memory: SnapshotStore | None = None
) -> tuple[Trainer, str]:
    """Join the job and build this rank's trainer, resumed from the newest in-memory snapshot
    every rank can reach (``memory``, in-process recovery) or else the latest checkpoint.
    Collective."""
    # Sequence parallelism relies on kernels being issued in order on one hardware queue.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    check_data_path(job, run_dir)
    device = resolve_device(job.train.device)
    rank, _world = init_distributed(device)
    setup_logging(rank, run_dir)
    if rank == 0:
        runfiles.write_text(run_dir / "config.toml", to_toml(job))
    if device == "cpu":
        cpu_backend.activate()
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    groups = build_groups(job.parallel)
    seed_everything(job.train.seed, groups.tp_rank, device)
    data_dir = run_dir / "data"
    if rank == 0:
        if job.data.path is None and job.data.blend is None:
            default_token_file(data_dir)  # once, before the other ranks open it
        copy_tokenizer(job, run_dir)
    torch.distributed.barrier()
    trainer = Trainer(
        job,
        groups,
        device,
        data_cache_dir=data_dir,
        peak=agreed_peak(job, device),
        timeline=build_timeline(job.diagnostics, run_dir, groups, device),  # null when off
    )
    if memory is not None:
        memory.attach(rank, groups.layout.world_size)
    restored = memory is not None and restore_from_memory(trainer, memory, run_dir)
    if job.checkpoint.resume and not restored:
        try:
            trainer.resumed_from = checkpoint_load.resume(trainer, job.checkpoint, run_dir)
        except checkpoint.CheckpointUnusable as e:
            if os.environ.get(RUN_DIR_ENV):  # under a node agent: no restart can fix it
                fail_job(str(e), run_dir)
            raise  # `megascale train` and torchrun: the CLI prints it as one line
    if rank == 0:
        logger.info(
            "%s; world %d; step %d of %d",
            groups.layout.describe(0),
            groups.layout.world_size,
            trainer.step_num,
            job.train.steps,
        )
    return trainer, device


def restore_from_memory(trainer: Trainer, memory: SnapshotStore, run_dir: Path) -> bool:
    """Restore the newest snapshot every rank can reach when it is at least as new as the newest
    complete checkpoint (then nothing is read from storage). Collective; True when restored."""
    from megascale.train.checkpoint.storage import Storage, location

    start = time.perf_counter()
    newest = [None]
    if trainer.groups.rank == 0:
        steps = Storage(location(trainer.job.checkpoint, run_dir)).complete_steps()
        newest[0] = steps[-1] if steps else None
    torch.distributed.broadcast_object_list(newest, src=0)
    restored = memory.restore(trainer, newest[0])
    if restored is None:
        return False
    step, where = restored
    trainer.resumed_from = step
    logger.warning(
        "restored step %d from %s in %.3f s (no checkpoint read)",
        step,
        where,
        time.perf_counter() - start,
    )
    return True


def rank0_sinks(job: JobConfig, run_dir: Path, trainer: Trainer) -> Sinks:
    """The optional sinks of ``metrics.jsonl``'s records (``[metrics]``). A sink whose package is
    missing ends the job under a node agent (no restart can install it), else raises."""
    try:
        return open_sinks(job.metrics, run_dir, trainer.step_num, to_dict(job))
    except ConfigError as e:
        if os.environ.get(RUN_DIR_ENV):
            fail_job(str(e), run_dir)
        raise


def check_data_path(job: JobConfig, run_dir: Path) -> None:
    """A ``data.path`` whose files do not exist would fail on every node: end the job
    (``probes.fatal.fail_job``) instead of letting the controller restart it."""
    if job.data.path is None:
        return
    missing = [
        str(p) for p in (bin_path(job.data.path), idx_path(job.data.path)) if not p.is_file()
    ]
    if missing:
        fail_job(
            f"data.path = {job.data.path!r}: {' and '.join(missing)} not found (make the token "
            "file with `megascale data build`, or leave data.path out for the bundled corpus)",
            run_dir,
        )


def run_rank(
    job: JobConfig,
    run_dir: Path,
    stop_after: int | None = None,
    memory: SnapshotStore | None = None,
) -> list[StepMetrics]:
    """Train ``job`` as this rank (env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Collective.

    Resumes from the latest complete checkpoint in ``run_dir`` when ``checkpoint.resume`` is set.
    ``stop_after`` ends this process's run after that global step (a planned preemption): the
    schedule still follows ``train.steps``, so a later run resumes exactly where this one stopped.
    ``memory`` (in-process recovery, ``train.resident``): where the rank's snapshots are kept
    across generations; it restores from them and takes one every ``snapshot_interval`` steps.
    """
    run_dir = Path(run_dir)
    if job.parallel.async_collectives and resolve_device(job.train.device) == "cpu":
        async_comm.install()  # under the flight recorder, which must see the host's calls
    # What the node agent reads without our cooperation: RUN_DIR/flight/ (every collective, from
    # here on) and RUN_DIR/progress/ (section "init" until the first step). Null when disabled.
    signals = WorkerSignals.open(run_dir, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    faults = inject.worker_faults(int(os.environ["RANK"]), run_dir)  # $MEGASCALE_INJECT, or none
    trainer, device = start_rank(job, run_dir, memory)
    signals.stage(trainer.groups.pp_rank)
    trainer.compute.stretch(faults.slow)  # slow-rank / slow-node: compute takes factor x as long
    is_rank0 = trainer.groups.rank == 0
    log = None
    if is_rank0:
        log = MetricsLog(
            run_dir / "metrics.jsonl", trainer.step_num, rank0_sinks(job, run_dir, trainer)
        )
    progress = Progress(job.train.steps, job.train.log_interval) if is_rank0 else None
    last = job.train.steps if stop_after is None else min(stop_after, job.train.steps)
    interval = job.checkpoint.interval
    saver = checkpoint.Checkpointer(
        job.checkpoint,
        run_dir,
        trainer,
        trainer.resumed_from,
        copier=memory.checkpoint_copier if memory is not None else None,
    )
    history: list[StepMetrics] = []
    # train.profile_steps / train.memory_history / train.nvtx; null when off
    profiling = open_profiling(job, run_dir, trainer.groups.rank, device, trainer.step_num)
    trainer.nvtx = open_nvtx(job, trainer.groups.rank, device)
    try:
        while trainer.step_num < last:
            profiling.step_begin(trainer.step_num + 1)
            signals.step_started(trainer.step_num + 1)
            faults.before_step(trainer.step_num + 1)  # kill-worker / hang-worker fire here, once
            with trainer.nvtx.range("megascale::train::step"):
                metrics = trainer.step()
            if is_eval_step(job, trainer.step_num):
                metrics.val_loss = trainer.evaluate()  # collective: every rank evaluates
            step = trainer.step_num
            if interval and (step % interval == 0 or step == job.train.steps):
                with (
                    signals.section("checkpoint"),
                    trainer.timeline.span("megascale::checkpoint::save"),
                ):
                    # stage 1 only; the write goes on in the background
                    metrics.checkpoint_stall_s = saver.save(trainer)
            report_checkpoint(saver, signals)
            if memory is not None and memory.due(step):
                memory.take(trainer)
            signals.step_done(metrics, trainer.compute.latest)
            signals.checkpoint_durable(saver.durable)  # a background save may have finished
            history.append(metrics)
            if log is not None and progress is not None:
                log.write(metrics)
                progress.update(metrics)
            profiling.step_end(step)
        with signals.section("checkpoint"):
            saver.finalize()  # the last save's files and manifest are written
        report_checkpoint(saver, signals)  # its time until durable, with the "done" write
        signals.checkpoint_durable(saver.durable)
        if memory is not None:
            memory.drain()  # the peers' last copies pair up before the groups go
    except torch.cuda.OutOfMemoryError:
        profiling.out_of_memory()  # the allocator's history up to the OOM, when recorded
        raise
    finally:
        if memory is not None:
            memory.detach()
        profiling.close()  # a window or memory history the run stopped inside
        trainer.timeline.close()  # writes the last steps' segments
        if log is not None:
            log.close()
        signals.close()
    destroy_groups()
    return history


def report_checkpoint(saver: checkpoint.Checkpointer, signals: WorkerSignals) -> None:
    """Hand the latest save's figures (stall, and time until durable once written) to the
    progress record whenever they changed."""
    last = saver.last_save
    if last is not None and last != signals.progress_checkpoint:
        signals.progress_checkpoint = last
        signals.checkpoint_saved(CheckpointFigures(*last))


def is_eval_step(job: JobConfig, step: int) -> bool:
    """Every ``train.eval_interval`` steps and at the last step; never when the interval is 0."""
    interval = job.train.eval_interval
    return bool(interval) and (step % interval == 0 or step == job.train.steps)


def copy_tokenizer(job: JobConfig, run_dir: Path) -> None:
    """``RUN_DIR/tokenizer/tokenizer.json`` (``tokenizer.model``, ``tiktoken.json``): the tokenizer
    file the data was built with (the copy next to the first dataset that has one); nothing for
    byte-level data."""
    for prefix in [job.data.path] if job.data.blend is None else parse_blend(job.data.blend)[0]:
        if prefix is None:
            continue
        info = DatasetInfo.read(prefix)
        kind = "hf" if info is None else info.tokenizer  # no sidecar: a tokenizer.json, if any
        if kind in TOKENIZER_FILES and tokenizer_copy_path(prefix, kind).is_file():
            (run_dir / "tokenizer").mkdir(exist_ok=True)
            shutil.copyfile(
                tokenizer_copy_path(prefix, kind), run_dir / "tokenizer" / TOKENIZER_FILES[kind]
            )
            return


def seed_everything(seed: int, tp_rank: int, device: str) -> None:
    from megatron.core import tensor_parallel

    if device == "cpu":
        cpu_backend.seed_rng_tracker(seed, tp_rank)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
