"""Progress file: what a worker tells its node agent, in ``RUN_DIR/progress/rank_NNNNN.json``.

The worker rewrites the file (write to a temporary name, then ``os.replace``: a reader sees the old
or the new content, never a torn one; no fsync) when a section starts and after every step::

  {"version": 1, "rank": 3, "pid": 4242, "section": "step", "section_started": <wall>,
   "section_started_mono": <monotonic>, "step": 120, "step_time_s": 0.41, "tokens_per_s": 9987.0,
   "heartbeat": <wall>, "heartbeat_mono": <monotonic>, "durations": {"init": 12.5, "step": 0.41},
   "compute_time_s": 0.30, "val_loss": 2.31}

``val_loss`` (absent or None until the first evaluation) is the last validation loss.
``mfu`` and ``mfu_peak`` (absent or None without a peak) are the last step's job-wide MFU and the
peak it is against, in words (``diagnostics.peak.peak_label``). ``checkpoint`` (absent or None
until one is durable; rank 0 only) is the newest checkpoint this process saved completely:
``{"step", "time", "url"}``, written when the rank learns that its manifest is written.

``compute_time_s`` (absent or None until known) is the *previous* step's period (its start to
this step's start) minus the time the rank was blocked in communication (the flight recorder's
``blocked_s``): in synchronous training every rank's step takes as long as the slowest one's,
and a straggler shows as the rank that computes longest while its peers wait for it.

Sections (STYLE.md #9) are "init" (start of the process to the first step), "step", "checkpoint",
and "done" (written by ``close``). ``durations`` holds the last observed length of each finished
section ("step": the last step's time), from which the controller learns per-section timeouts.
``heartbeat`` is the time of the last write; the worker writes only from its training thread, so
a hung worker's heartbeat stops (a long section may call ``beat()`` to say it is still moving).
Monotonic times are CLOCK_MONOTONIC, comparable with ``time.monotonic()`` on the same host.

``WorkerSignals`` bundles this file with the flight recorder
(``megascale.robustness.flight_recorder``) for the trainer's run loop: the two things the agent
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

VERSION = 1
SECTIONS = ("init", "step", "checkpoint", "done")
JOB_FIGURES = ("tokens_per_s", "mfu", "mfu_peak", "checkpoint")
"""The fields of a progress file that the agent passes on per rank in its heartbeat's ``ranks``
(the controller's job summary reads them: ``robustness.job_summary``)."""


def progress_path(run_dir: Path | str, rank: int) -> Path:
    """Where rank ``rank`` of the run in ``run_dir`` writes its progress."""
    return Path(run_dir) / "progress" / f"rank_{rank:05d}.json"


class ProgressFile:
    """This rank's progress file. Call from the training thread only."""

    def __init__(self, path: Path | str, rank: int) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        self._state: dict[str, Any] = {
            "version": VERSION,
            "rank": rank,
            "pid": os.getpid(),
            "section": "",
            "section_started": 0.0,
            "section_started_mono": 0.0,
            "step": 0,
            "step_time_s": None,
            "tokens_per_s": None,
            "heartbeat": 0.0,
            "heartbeat_mono": 0.0,
            "durations": {},
            "compute_time_s": None,
            "val_loss": None,
            "mfu": None,
            "mfu_peak": None,
            "checkpoint": None,
        }

    def enter(self, section: str) -> None:
        """Start ``section`` (the previous one ends, and its duration is kept)."""
        if section not in SECTIONS:
            raise ValueError(f"section={section!r}; expected one of {', '.join(SECTIONS)}")
        state, now = self._state, time.monotonic()
        if state["section"] and state["section"] != "step":  # a step's duration is its step time
            state["durations"][state["section"]] = now - state["section_started_mono"]
        state["section"], state["section_started_mono"] = section, now
        state["section_started"] = time.time()
        self._write()

    def step(
        self,
        step: int,
        step_time_s: float,
        tokens_per_s: float,
        val_loss: float | None = None,
        mfu: tuple[float, str] | None = None,
    ) -> None:
        """After step ``step``: its time and throughput (and validation loss if it evaluated;
        ``mfu``: (MFU, its peak in words) when a peak is known)."""
        state = self._state
        state["step"], state["step_time_s"], state["tokens_per_s"] = step, step_time_s, tokens_per_s
        if val_loss is not None:
            state["val_loss"] = val_loss
        if mfu is not None:
            state["mfu"], state["mfu_peak"] = mfu
        state["durations"]["step"] = step_time_s
        self._write()

    def compute_time(self, seconds: float) -> None:
        """The last full step period's compute time (written with the next write)."""
        self._state["compute_time_s"] = seconds

    def checkpoint(self, record: dict[str, Any]) -> None:
        """A checkpoint became durable: ``{"step", "time", "url"}`` (written now)."""
        self._state["checkpoint"] = dict(record)
        self._write()

    def beat(self) -> None:
        """Still moving inside a long section."""
        self._write()

    def close(self) -> None:
        self.enter("done")

    def _write(self) -> None:
        state = self._state
        state["heartbeat"], state["heartbeat_mono"] = time.time(), time.monotonic()
        self._tmp.write_text(json.dumps(state))
        os.replace(self._tmp, self.path)


class NullProgressFile:
    """The progress file when disabled: same methods, nothing written."""

    path = None

    def enter(self, section: str) -> None:
        pass

    def step(
        self,
        step: int,
        step_time_s: float,
        tokens_per_s: float,
        val_loss: float | None = None,
        mfu: tuple[float, str] | None = None,
    ) -> None:
        pass

    def compute_time(self, seconds: float) -> None:
        pass

    def checkpoint(self, record: dict[str, Any]) -> None:
        pass

    def beat(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class ProgressState:
    """A progress file as the agent reads it."""

    rank: int
    pid: int
    section: str
    section_started: float
    section_started_mono: float
    step: int
    step_time_s: float | None
    tokens_per_s: float | None
    heartbeat: float
    heartbeat_mono: float
    durations: dict[str, float] = field(default_factory=dict)
    compute_time_s: float | None = None
    val_loss: float | None = None
    mfu: float | None = None
    mfu_peak: str | None = None
    checkpoint: dict[str, Any] | None = None


def read_progress(path: Path | str) -> ProgressState:
    """Read a progress file; ``ValueError`` naming the file and the problem if it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        if data.get("version") != VERSION:
            raise ValueError(f"version {data.get('version')!r}, this reader reads {VERSION}")
        return ProgressState(
            rank=int(data["rank"]),
            pid=int(data["pid"]),
            section=str(data["section"]),
            section_started=float(data["section_started"]),
            section_started_mono=float(data["section_started_mono"]),
            step=int(data["step"]),
            step_time_s=data["step_time_s"],
            tokens_per_s=data["tokens_per_s"],
            heartbeat=float(data["heartbeat"]),
            heartbeat_mono=float(data["heartbeat_mono"]),
            durations={str(k): float(v) for k, v in data["durations"].items()},
            compute_time_s=data.get("compute_time_s"),
            val_loss=data.get("val_loss"),
            mfu=data.get("mfu"),
            mfu_peak=data.get("mfu_peak"),
            checkpoint=data.get("checkpoint"),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a megascale progress file ({e!r})") from None


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
        self._checkpoint: dict[str, Any] | None = None  # the last one reported
        self._step_mark: tuple[float, float] | None = None  # (monotonic, blocked_s) at a start

    @classmethod
    def open(cls, run_dir: Path | str, rank: int, world_size: int) -> WorkerSignals:
        from megascale.robustness.flight_recorder import open_recorder

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
        now, blocked = time.monotonic(), float(self.recorder.blocked_s)
        if self._step_mark is not None:
            period, waited = now - self._step_mark[0], blocked - self._step_mark[1]
            self.progress.compute_time(max(0.0, period - waited))
        self._step_mark = (now, blocked)
        self.recorder.set_step(step)

    def step_done(self, metrics) -> None:
        """``metrics``: the trainer's ``StepMetrics`` (step, step_time_s, tokens_per_s, val_loss,
        mfu and its peak)."""
        from megascale.diagnostics.peak import peak_label

        mfu = None
        if metrics.mfu is not None:
            mfu = (metrics.mfu, peak_label(metrics.mfu_peak_tflops, metrics.mfu_peak_source))
        self.progress.step(
            metrics.step, metrics.step_time_s, metrics.tokens_per_s, metrics.val_loss, mfu
        )

    def checkpoint_durable(self, record: dict[str, Any] | None) -> None:
        """The newest durable checkpoint (``Checkpointer.durable``); written when it changed.
        Cheap when it did not: call after every step."""
        if record is not None and record != self._checkpoint:
            self._checkpoint = dict(record)
            self.progress.checkpoint(record)

    def close(self) -> None:
        self.progress.close()
        self.recorder.close()


def _enabled(variable: str) -> bool:
    value = os.environ.get(variable, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on", ""):
        logger.warning("%s=%r not understood (use 0 or 1); keeping it on", variable, value)
    return value not in ("0", "false", "off")
