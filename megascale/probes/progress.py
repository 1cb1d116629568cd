"""Progress file: what a worker tells its node agent, in ``RUN_DIR/progress/rank_NNNNN.json``.

The worker rewrites the file (write to a temporary name, then ``os.replace``: a reader sees the old
or the new content, never a torn one; no fsync) when a section starts and after every step. Its
content is a ``megascale.messages.RankProgress`` (the fields, and the figures' meanings, are
defined there once).

``val_loss`` (absent or None until the first evaluation) is the last validation loss.
``mfu`` and ``mfu_peak`` (None without a peak) are the last step's job-wide MFU and the peak it is
against, in words (``probes.peak.peak_label``). ``durable`` (None until one is durable; rank 0
only) is the newest checkpoint this process saved completely (``messages.DurableCheckpoint``),
written when the rank learns that its manifest is written.

``compute_time_s`` (None until known) is the forward and backward compute time of a recent step
(``compute_step``), measured on the device (``megascale.probes.compute_time``: CUDA events
on a GPU, the host clock less time blocked in communication on CPU): pipeline bubbles and waiting
for peers are not in it, so a straggler shows as the rank that computes longest. ``stage`` (None
until known) is the rank's pipeline stage (its ``pp`` coordinate): the straggler model compares a
rank only with the ranks of its stage, which do the same work. ``comm_time_s`` is the time the
rank was blocked in communication during the previous step period, by group (dp, pp, tp, other;
the flight recorder's per-group totals).

Sections (STYLE.md #9) are "init" (start of the process to the first step), "step", "checkpoint",
and "done" (written by ``close``). ``durations`` holds the last observed length of each finished
section ("step": the last step's time), from which the controller learns per-section timeouts.
``heartbeat`` is the time of the last write; the worker writes only from its training thread, so
a hung worker's heartbeat stops (a long section may call ``beat()`` to say it is still moving).
Monotonic times are CLOCK_MONOTONIC, comparable with ``time.monotonic()`` on the same host.

``WorkerSignals`` bundles this file with the flight recorder
(``megascale.probes.flight.recorder``) for the trainer's run loop: the two things the agent
reads without the worker's cooperation.
``read_progress`` is the agent's reader (no torch).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megascale import runfiles
from megascale.messages import CheckpointFigures, DurableCheckpoint, RankProgress

logger = logging.getLogger(__name__)

SECTIONS = ("init", "step", "checkpoint", "done")


def progress_path(run_dir: Path | str, rank: int) -> Path:
    """Where rank ``rank`` of the run in ``run_dir`` writes its progress."""
    return Path(run_dir) / "progress" / f"rank_{rank:05d}.json"


class ProgressFile:
    """This rank's progress file (a ``messages.RankProgress``). Call from the training thread."""

    def __init__(self, path: Path | str, rank: int) -> None:
        self.path = Path(path)
        runfiles.make_dir(self.path.parent)
        self.record = RankProgress(rank=rank, pid=os.getpid())

    def enter(self, section: str) -> None:
        """Start ``section`` (the previous one ends, and its duration is kept)."""
        if section not in SECTIONS:
            raise ValueError(f"section={section!r}; expected one of {', '.join(SECTIONS)}")
        record, now = self.record, time.monotonic()
        if record.section and record.section != "step":  # a step's duration is its step time
            record.durations[record.section] = now - record.section_started_mono
        record.section, record.section_started_mono = section, now
        record.section_started = time.time()
        self._write()

    def step(
        self,
        step: int,
        step_time_s: float,
        tokens_per_s: float,
        val_loss: float | None = None,
        *,
        mfu: float | None = None,
        mfu_peak: str | None = None,
        data_wait_s: float | None = None,
        memory_gib: tuple[float | None, float | None, float | None] = (None, None, None),
    ) -> None:
        """After step ``step``: its time and throughput (and validation loss if it evaluated;
        ``mfu`` with its peak in words when a peak is known; ``memory_gib``: RSS, peak allocated
        and peak reserved CUDA memory, as ``messages.StepMetrics`` has them)."""
        record = self.record
        record.step, record.step_time_s, record.tokens_per_s = step, step_time_s, tokens_per_s
        record.mfu, record.mfu_peak, record.data_wait_s = mfu, mfu_peak, data_wait_s
        record.mem_rss_gib, record.mem_max_allocated_gib, record.mem_max_reserved_gib = memory_gib
        if val_loss is not None:
            record.val_loss = val_loss
        record.durations["step"] = step_time_s
        self._write()

    def compute_time(self, step: int, seconds: float) -> None:
        """Step ``step``'s compute time (written with the next write)."""
        self.record.compute_step, self.record.compute_time_s = step, seconds

    def comm_time(self, comm_s: dict[str, float]) -> None:
        """The last full step period's exposed communication by group (written with the next
        write)."""
        self.record.comm_time_s = comm_s

    def stage(self, pp_rank: int) -> None:
        """This rank's pipeline stage (written with the next write)."""
        self.record.stage = pp_rank

    def checkpoint(self, figures: CheckpointFigures) -> None:
        """The latest save's figures (written with the next write)."""
        self.record.checkpoint = figures

    def durable(self, checkpoint: DurableCheckpoint) -> None:
        """A checkpoint became durable (written now)."""
        self.record.durable = checkpoint
        self._write()

    def beat(self) -> None:
        """Still moving inside a long section."""
        self._write()

    def close(self) -> None:
        self.enter("done")

    def _write(self) -> None:
        record = self.record
        record.heartbeat, record.heartbeat_mono = time.time(), time.monotonic()
        runfiles.write_text(self.path, json.dumps(record.encode()))


class NullProgressFile:
    """The progress file when disabled: same methods, nothing written."""

    path = None

    def enter(self, section: str) -> None:
        pass

    def step(self, step: int, step_time_s: float, tokens_per_s: float, *args, **kwargs) -> None:
        pass

    def compute_time(self, step: int, seconds: float) -> None:
        pass

    def comm_time(self, comm_s: dict[str, float]) -> None:
        pass

    def stage(self, pp_rank: int) -> None:
        pass

    def checkpoint(self, figures: CheckpointFigures) -> None:
        pass

    def durable(self, checkpoint: DurableCheckpoint) -> None:
        pass

    def beat(self) -> None:
        pass

    def close(self) -> None:
        pass


def read_progress(path: Path | str) -> RankProgress:
    """Read a progress file; ``ValueError`` naming the file and the problem if it is not one."""
    path = Path(path)
    try:
        return RankProgress.from_json(path.read_bytes())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a megascale progress file ({e})") from None


class WorkerSignals:
    """The worker's side of the agent contract, in one object for the run loop: the flight
    recorder (``RUN_DIR/flight/``) and the progress file (``RUN_DIR/progress/``).

    Lifecycle: ``open`` before ``init_distributed`` (section "init" starts, the recorder is
    installed); ``step_started(k)`` before step k and ``step_done(metrics)`` after it;
    ``with section("checkpoint"):`` around a checkpoint save; ``close()`` at the end. Either part
    is a null object when disabled: ``MEGASCALE_FLIGHT_RECORDER=0`` / ``MEGASCALE_PROGRESS=0``.
    """

    def __init__(self, recorder, progress) -> None:
        self.recorder, self.progress = recorder, progress
        self.current = ""
        self._step_mark: dict[str, float] | None = None  # blocked seconds by group, step start
        self.comm_time_s: dict[str, float] = {}  # of the last full step period
        self.progress_checkpoint: tuple | None = None  # the save figures last handed over
        self._durable: DurableCheckpoint | None = None  # the last one reported

    @classmethod
    def open(cls, run_dir: Path | str, rank: int, world_size: int) -> WorkerSignals:
        from megascale.probes.flight.recorder import open_recorder

        recorder = open_recorder(
            run_dir, rank, world_size, enabled=_enabled("MEGASCALE_FLIGHT_RECORDER")
        )
        progress = (
            ProgressFile(progress_path(run_dir, rank), rank)
            if _enabled("MEGASCALE_PROGRESS")
            else NullProgressFile()
        )
        signals = cls(recorder, progress)
        signals.enter("init")
        return signals

    def enter(self, section: str) -> None:
        if section != "step":
            self._step_mark = None  # a period with a checkpoint in it is not a step's
        self.current = section
        self.progress.enter(section)
        self.recorder.set_section(section)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """``name`` for the duration of the block, then back to "step"."""
        self.enter(name)
        try:
            yield
        finally:
            self.enter("step")

    def step_started(self, step: int) -> None:
        if self.current != "step":
            self.enter("step")
        by_group = self.recorder.blocked_by_group()
        if self._step_mark is not None:
            before = self._step_mark
            self.comm_time_s = {g: s - before.get(g, 0.0) for g, s in by_group.items()}
            self.progress.comm_time(self.comm_time_s)
        self._step_mark = by_group
        self.recorder.set_step(step)

    def stage(self, pp_rank: int) -> None:
        """This rank's pipeline stage, for the straggler model."""
        self.progress.stage(pp_rank)

    def step_done(self, metrics, compute: tuple[int, float] | None = None) -> None:
        """``metrics``: the step's ``messages.StepMetrics``; ``compute``: (step, seconds) of the
        newest step whose compute time is known, or None (``Trainer.compute.latest``). The
        compute time and the last full step period's communication by group are copied into
        ``metrics``."""
        if compute is not None:
            self.progress.compute_time(*compute)
        metrics.compute_time_s = compute[1] if compute is not None else None
        metrics.comm_time_s = self.comm_time_s
        mfu_peak = None
        if metrics.mfu is not None:
            from megascale.probes.peak import peak_label

            mfu_peak = peak_label(metrics.mfu_peak_tflops, metrics.mfu_peak_source)
        self.progress.step(
            metrics.step,
            metrics.step_time_s,
            metrics.tokens_per_s,
            metrics.val_loss,
            mfu=metrics.mfu,
            mfu_peak=mfu_peak,
            data_wait_s=metrics.data_wait_s,
            memory_gib=(
                metrics.mem_rss_gib,
                metrics.mem_max_allocated_gib,
                metrics.mem_max_reserved_gib,
            ),
        )

    def checkpoint_durable(self, record: dict[str, Any] | None) -> None:
        """The newest durable checkpoint (``Checkpointer.durable``: ``{"step", "time",
        "url"}``); written when it changed. Cheap when it did not: call after every step."""
        if record is None:
            return
        durable = DurableCheckpoint(**record)
        if durable != self._durable:
            self._durable = durable
            self.progress.durable(durable)

    def checkpoint_saved(self, figures: CheckpointFigures) -> None:
        """A save's figures (``stall_s`` now; ``durable_s`` again once its write finished)."""
        self.progress.checkpoint(figures)

    def close(self) -> None:
        self.progress.close()
        self.recorder.close()


def _enabled(variable: str) -> bool:
    value = os.environ.get(variable, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on", ""):
        logger.warning("%s=%r not understood (use 0 or 1); keeping it on", variable, value)
    return value not in ("0", "false", "off")
