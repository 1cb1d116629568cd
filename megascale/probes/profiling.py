"""Per-step memory, a torch profiler window, NVTX ranges and a CUDA memory snapshot (``[train]``).

* ``rss_gib``: this process's resident set size (host memory) in GiB, read at the step's end
  (``mem_rss_gib`` of ``metrics.jsonl`` and of each rank's progress record, on every device). It
  is the RSS *at the step's end*, not the step's peak: the kernel keeps only a process-lifetime
  high-water mark, and polling within the step would cost a thread.
* ``peak_memory_gib``: the step's peak allocated and reserved CUDA memory in GiB, reset at each
  step's start (``reset_peak_memory``); ``mem_max_allocated_gib`` / ``mem_max_reserved_gib`` of
  ``metrics.jsonl``. None on CPU.
* ``train.profile_steps = [first, last]``: ``torch.profiler`` (CPU, and CUDA on a GPU) records
  exactly those optimizer steps on the ranks of ``train.profile_ranks`` (default rank 0; []: every
  rank) and writes a Chrome trace to ``RUN_DIR/profile/rank_NNNNN.json``; each step is a span
  ``megascale::train::step#N``. A run resumed past ``first`` records the window's steps still
  ahead (none past ``last``) and says so.
* ``train.memory_history = true`` (CUDA): the allocator's history is recorded from the first step
  and dumped to ``RUN_DIR/profile/memory_rank_NNNNN.pickle`` (https://pytorch.org/memory_viz) at
  the end of the profile window, else after the first step this run logs (a multiple of
  ``train.log_interval``, or the last step), else when the run ends. A rank that runs out of CUDA
  memory while it records dumps ``memory_rank_NNNNN_oom.pickle`` (``out_of_memory``) before the
  error propagates.
* ``train.nvtx = true`` (CUDA): ``Nvtx.range(name)`` pushes and pops an NVTX range for Nsight
  Systems around the step and its parts, named as the timeline's spans (``megascale::train::step``,
  ``megascale::schedule::forward_backward``, ``megascale::optim::step``).

``open_profiling`` gives a ``Profiling`` (or ``NULL_PROFILING`` when both are off); the training
loop calls ``step_begin``/``step_end`` around every step and ``close`` once, in a ``finally``.
``open_nvtx`` gives an ``Nvtx`` (or ``NULL_NVTX``). Files are written through ``runfiles`` (never
through a planted symlink).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import torch

from megascale import runfiles
from megascale.config import JobConfig

logger = logging.getLogger(__name__)

GIB = 2**30
MEMORY_HISTORY_ENTRIES = 100_000
"""Allocator events kept by ``train.memory_history`` (torch's ring buffer; Megatron-LM's too)."""


def peak_gib(
    device: str, max_allocated: int, max_reserved: int
) -> tuple[float | None, float | None]:
    """(peak allocated, peak reserved) in GiB from byte counts on ``device``; (None, None) unless
    the device is CUDA (CPU tensors have no allocator statistics)."""
    if device != "cuda":
        return None, None
    return round(max_allocated / GIB, 3), round(max_reserved / GIB, 3)


def rss_gib() -> float:
    """This process's resident set size now, in GiB (host memory: the model's CPU copies, data
    loader buffers, pinned staging of checkpoints). The RSS at the time of the call, not a peak."""
    return round(psutil.Process().memory_info().rss / GIB, 3)


def reset_peak_memory(device: str) -> None:
    """Start a step's peak: host-side allocator counters, no device sync. No-op off CUDA."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib(device: str) -> tuple[float | None, float | None]:
    """This process's peak allocated and reserved CUDA memory since ``reset_peak_memory``, in
    GiB; (None, None) off CUDA."""
    if device != "cuda":
        return None, None
    return peak_gib(device, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())


def profile_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "profile"


def trace_path(run_dir: str | Path, rank: int) -> Path:
    """``RUN_DIR/profile/rank_NNNNN.json``: the rank's Chrome trace of the profile window."""
    return profile_dir(run_dir) / f"rank_{rank:05d}.json"


def snapshot_path(run_dir: str | Path, rank: int, oom: bool = False) -> Path:
    """``RUN_DIR/profile/memory_rank_NNNNN.pickle``: the rank's CUDA memory snapshot;
    ``memory_rank_NNNNN_oom.pickle`` the one taken when the rank ran out of memory."""
    return profile_dir(run_dir) / f"memory_rank_{rank:05d}{'_oom' if oom else ''}.pickle"


def profiles_rank(ranks: list[int], rank: int) -> bool:
    """Whether ``train.profile_ranks`` selects global ``rank`` ([] selects every rank)."""
    return not ranks or rank in ranks


def window_ahead(window: list[int], resumed_step: int) -> tuple[int, int] | None:
    """The steps of ``train.profile_steps`` a run starting after ``resumed_step`` still runs:
    ``(first, last)``, or None when the window is empty or already past."""
    if not window:
        return None
    first, last = window
    first = max(first, resumed_step + 1)
    return (first, last) if first <= last else None


class Profiling:
    """The profile window and memory history of one rank. Call ``step_begin(n)`` before step
    ``n`` and ``step_end(n)`` after it (every step, in order), and ``close`` once."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        device: str,
        window: tuple[int, int] | None,
        memory_history: bool,
        dump_after: int | None,
    ) -> None:
        self.run_dir, self.rank, self.device, self.window = Path(run_dir), rank, device, window
        self.dump_after = dump_after
        """The step after which the memory snapshot is dumped (None: no snapshot)."""
        self._profiler: torch.profiler.profile | None = None
        self._span: contextlib.AbstractContextManager | None = None
        self._recording_memory = memory_history
        if memory_history:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)

    def step_begin(self, step: int) -> None:
        if self.window is not None and step == self.window[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities, record_shapes=False, with_stack=False
            )
            self._profiler.start()
        if self._profiler is not None:
            self._span = torch.profiler.record_function(f"megascale::train::step#{step}")
            self._span.__enter__()

    def step_end(self, step: int) -> None:
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None
        if self._profiler is not None and self.window is not None and step == self.window[1]:
            self._write_trace()
        if self._recording_memory and step == self.dump_after:
            self._write_snapshot()

    def out_of_memory(self) -> None:
        """The rank ran out of CUDA memory: dump the memory history recorded so far to
        ``memory_rank_NNNNN_oom.pickle`` (when recording; otherwise nothing). Call from the
        handler of ``torch.cuda.OutOfMemoryError``, before re-raising it; a failure to dump is
        logged, never raised over the error."""
        if not self._recording_memory:
            return
        try:
            self._write_snapshot(oom=True)
        except Exception:  # the OOM is the error to report
            logger.exception("memory history: could not dump the snapshot after the OOM")

    def close(self) -> None:
        """Ends what is still open: a window the run stopped inside (its trace is written with
        the steps recorded), a memory history not yet dumped (dumped now). Idempotent."""
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None
        if self._profiler is not None:
            logger.warning("profile window cut short: the trace holds the steps run so far")
            self._write_trace()
        if self._recording_memory:
            self._write_snapshot()

    def _write_trace(self) -> None:
        """Stop the profiler and move its Chrome trace into place. torch writes to a path, so the
        trace goes to a private temporary directory first and then through ``runfiles``."""
        profiler, self._profiler = self._profiler, None
        assert profiler is not None
        profiler.stop()
        path = trace_path(self.run_dir, self.rank)
        runfiles.make_dir(path.parent)
        with tempfile.TemporaryDirectory(prefix="megascale-profile-") as tmp:
            staged = Path(tmp) / path.name
            profiler.export_chrome_trace(str(staged))
            runfiles.write_bytes(path, staged.read_bytes())
        logger.info("profile: wrote %s", path)

    def _write_snapshot(self, oom: bool = False) -> None:
        self._recording_memory = False
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)  # stop recording
        path = snapshot_path(self.run_dir, self.rank, oom)
        runfiles.make_dir(path.parent)
        runfiles.write_bytes(path, pickle.dumps(snapshot))  # what torch's _dump_snapshot writes
        logger.info("memory history: wrote %s (view at https://pytorch.org/memory_viz)", path)


class NullProfiling:
    """Profiling off: the same methods, no-ops."""

    def step_begin(self, step: int) -> None:
        pass

    def step_end(self, step: int) -> None:
        pass

    def out_of_memory(self) -> None:
        pass

    def close(self) -> None:
        pass


NULL_PROFILING = NullProfiling()


class Nvtx:
    """NVTX ranges on CUDA (``train.nvtx``): ``with nvtx.range(name): ...``."""

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()


class NullNvtx:
    """NVTX off: ``range`` does nothing."""

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        yield


NULL_NVTX = NullNvtx()


def open_nvtx(job: JobConfig, rank: int, device: str) -> Nvtx | NullNvtx:
    """``Nvtx`` when ``train.nvtx`` is on and the device is CUDA; ``NULL_NVTX`` otherwise (with a
    warning from rank 0 when it is on but "auto" found no GPU: the rules refuse "cpu")."""
    if not job.train.nvtx:
        return NULL_NVTX
    if device != "cuda":
        if rank == 0:
            logger.warning("train.nvtx = true: skipped, the device is %s, not cuda", device)
        return NULL_NVTX
    return Nvtx()


def open_profiling(
    job: JobConfig, run_dir: Path, rank: int, device: str, resumed_step: int
) -> Profiling | NullProfiling:
    """This rank's profiling for a run that starts after ``resumed_step`` (0: fresh), or
    ``NULL_PROFILING`` when ``train.profile_steps`` and ``train.memory_history`` are off (or left
    nothing to do). Logs what a resume left of the window (the first profiled rank), and a
    memory history skipped on CPU. Ranks outside ``train.profile_ranks`` get no window."""
    t = job.train
    window = window_ahead(t.profile_steps, resumed_step)
    says = rank == min(t.profile_ranks or [0])  # one rank says what a resume left
    if not profiles_rank(t.profile_ranks, rank):
        window = None
    elif t.profile_steps and window != tuple(t.profile_steps) and says:
        first, last = t.profile_steps
        if window is None:
            logger.info(
                "train.profile_steps = [%d, %d]: resumed after step %d, past the window: "
                "no profile", first, last, resumed_step,
            )  # fmt: skip
        else:
            logger.info(
                "train.profile_steps = [%d, %d]: resumed after step %d, profiling steps %d to %d",
                first, last, resumed_step, *window,
            )  # fmt: skip
    memory_history = t.memory_history and device == "cuda"
    if t.memory_history and not memory_history and rank == 0:
        logger.warning("train.memory_history = true: skipped, the device is %s, not cuda", device)
    if window is None and not memory_history:
        return NULL_PROFILING
    dump_after = None
    if memory_history:
        dump_after = window[1] if window is not None else first_logged_step(job, resumed_step)
    return Profiling(run_dir, rank, device, window, memory_history, dump_after)


def first_logged_step(job: JobConfig, resumed_step: int) -> int:
    """The first step after ``resumed_step`` that the progress line shows: a multiple of
    ``train.log_interval``, or the last step."""
    interval = max(1, job.train.log_interval)
    return min((resumed_step // interval + 1) * interval, job.train.steps)
