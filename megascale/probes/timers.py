"""Per-rank timeline: named segments timed on the hot path without syncing, written in the background.

Every rank of a run records its segments to ``RUN_DIR/timeline/rank_NNNNN.jsonl``;
``megascale timeline`` (``megascale.tools.timeline``) merges them into one trace and
``megascale.tools.straggler`` finds slow ranks and machines in them.

Where the segments come from (span names follow ``megascale::<pkg>::<op>``, see
``timeline_segments``, which names them and assigns communication calls to their parallelism):

* The trainer: ``megascale::train::step``, ``megascale::data::wait`` (the time the step waits for
  its micro-batches; ``megascale::data::load`` in older files), ``megascale::optim::step``,
  and ``megascale::checkpoint::save`` from the run loop (``Timeline.span``).
* megatron-core's own instrumentation: its schedules, p2p communication, ``finalize_model_grads``
  and optimizers call ``config.timers(name).start()/.stop()`` when a timers object is set
  (``ModelParallelConfig.timers``, ``OptimizerConfig.timers``). ``Timeline.attach`` sets ours, so
  every micro-batch's forward and backward, each pipeline send/receive and the DP grad sync are
  segments with no patching of megatron-core (``MEGATRON_SEGMENTS`` maps the names).
* On CPU (gloo), every collective and p2p call: the interval the caller was blocked (a
  synchronous call, or ``wait()`` on an asynchronous one) becomes a ``comm.dp``/``comm.pp``/
  ``comm.tp``/``comm.other`` segment, and an asynchronous call's issue-to-completion interval an
  "in flight" record. Which parallelism a call belongs to is read from its kind and the segment
  that issued it (``classify_comm``). The records come from the flight recorder when it is
  installed (training runs install it before the trainer is built), so a call is wrapped once;
  otherwise from an in-memory flight recorder of the timeline's own (``comm_timer.timeline_comm``). A span notes
  the comm record count on entry and exit; the records are taken at each step boundary and turned
  into segments on the writer thread. In the NCCL-like CPU mode (``parallel.async_collectives``)
  a call returns at once, so the segment is instead the op's run on its communication thread,
  from its start to its completion as the flight recorder's watcher saw them (an op not yet seen
  complete at the step boundary keeps its host interval).

Clocks. On CPU every timestamp is ``time.monotonic_ns()`` (the flight recorder's clock). On CUDA,
device segments (forward, backward, optimizer, megatron-core's communication timers) are pairs of
CUDA events recorded on the current stream; nothing waits for them on the training thread. At each
step boundary the step's records are queued; every ``flush_interval_steps`` steps the background
writer receives them, waits for the events *there*, and places each at ``host time of the step's
anchor event + elapsed_time(anchor, event)``. When the GPU runs behind the host the device segments
of a step are therefore shifted early by that lag, while their durations are exact. Host segments
(data loading, the step itself, checkpoint, the blocked intervals of comm calls) use the host clock
everywhere. On a GPU a NCCL call returns to the host at once, so host-side timing of comm calls says
nothing: a collective's segment there is its run on the device, from the flight recorder's timing
events recorded on the stream before and after it (``flight.watcher.DeviceSpan``), placed on the
host clock at the time the recorder's watcher first saw its start event complete, with the
duration the events measured (exact for a synchronous call; the placement is late by at most the
watcher's polling interval). An asynchronous NCCL call (``async_op=True``: every chunked TP
collective, DP buckets) has no event after it: its end is the poll that saw its ``Work`` complete
(late by up to ``flight.watcher.MAX_INTERVAL_S``, 20 ms) and its start the moment the compute
stream reached the call, not the moment NCCL's kernel began, so such a segment is an upper bound
on the op's run, quantised to the polling interval. So TP collectives inside a layer show as segments of their own within forward/backward;
comm records with no device times (ops in a coalescing block or a p2p batch, ops not yet seen
complete at the step boundary) are not drawn on a GPU.

Across ranks: ``Timeline.start`` (collective) passes a barrier, and every rank notes its monotonic
clock as it leaves; rank 0 also notes the wall clock and shares it. Merging places each rank's
timestamp at ``rank 0's wall time at the barrier + (t - this rank's monotonic time at the
barrier)``, so ranks (and machines) line up to within the barrier's exit skew. A restarted process
writes a new clock record and its steps use it.

File format (JSON lines): one ``{"type": "meta", ...}`` and one ``{"type": "clock", ...}`` per
process start, then one ``{"type": "step", "step": k, "spans": [[name, cat, start_ns, dur_ns], ...],
"inflight": [...]}`` per step; timestamps are the rank's monotonic ns. A step line holds the step's
segments and whatever ran after it until the next step began (a checkpoint).

Disabled (``diagnostics.timeline = false``): ``NULL_TIMELINE``, the same methods doing nothing.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megascale import runfiles
from megascale.probes.timeline_segments import SEGMENTS, comm_segments, megatron_segment

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
TIMELINE_DIR = "timeline"

# --------------------------------------------------------------------------------------------------
# Clocks: host nanoseconds everywhere, CUDA events for device segments on a GPU
# --------------------------------------------------------------------------------------------------


class _HostClock:
    """Device segments on CPU: the host clock (``monotonic_ns``)."""

    host_comm = True  # a comm call's host interval says when it ran (gloo blocks in it)

    def now(self) -> int:
        return time.monotonic_ns()

    def anchor(self) -> None:
        return None

    def resolve(self, token: Any, anchor: Any, anchor_ns: int) -> int:
        return token


class _CudaClock:
    """Device segments on a GPU: a CUDA event recorded on the current stream, never waited for
    on the training thread; ``resolve`` runs on the writer thread and may block there."""

    host_comm = False  # a NCCL call returns at once: only device-timed comm records are segments

    def __init__(self, device_index: int) -> None:
        import torch

        self.torch, self.device_index = torch, device_index

    def now(self) -> Any:
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    anchor = now

    def resolve(self, token: Any, anchor: Any, anchor_ns: int) -> int:
        if isinstance(token, int):
            return token
        token.synchronize()  # on the writer thread
        return anchor_ns + int(anchor.elapsed_time(token) * 1e6)


# --------------------------------------------------------------------------------------------------
# The recorder
# --------------------------------------------------------------------------------------------------


@dataclass
class _Batch:
    """One step's raw records, handed to the writer thread."""

    step: int
    anchor: Any
    anchor_ns: int
    # (name, category, start token, end token, first comm record index, end comm record index)
    spans: list[tuple] = field(default_factory=list)
    comm: list = field(default_factory=list)  # chunks of comm records (see comm_timer)


class _Span:
    """A context manager for one segment; ``Timeline.span`` returns a fresh one per use."""

    __slots__ = ("_timeline", "_name", "_cat", "_now", "_start", "_first")

    def __init__(self, timeline: Timeline, name: str, cat: str, now: Callable[[], Any]) -> None:
        self._timeline, self._name, self._cat, self._now = timeline, name, cat, now

    def __enter__(self) -> _Span:
        self._first = self._timeline._comm.count()
        self._start = self._now()
        return self

    def __exit__(self, *exc) -> None:
        self._timeline._record(self._name, self._cat, self._start, self._now(), self._first)


class _MegatronTimer:
    """What megatron-core gets back from ``config.timers(name, log_level=...)``."""

    __slots__ = ("_span",)

    def __init__(self, span: _Span) -> None:
        self._span = span

    def start(self, barrier: bool = False) -> None:
        self._span.__enter__()  # never a barrier: that would sync the ranks we measure

    def stop(self, barrier: bool = False) -> None:
        self._span.__exit__()


class _MegatronTimers:
    """A stand-in for ``megatron.core.timers.Timers``: megatron-core only ever calls it."""

    def __init__(self, timeline: Timeline) -> None:
        self._timeline = timeline
        self._timers: dict[str, _MegatronTimer] = {}

    def __call__(self, name: str, log_level: int | None = None) -> _MegatronTimer:
        timer = self._timers.get(name)
        if timer is None:
            span_name, cat = megatron_segment(name)
            clock = self._timeline._device_clock
            timer = self._timers[name] = _MegatronTimer(
                _Span(self._timeline, span_name, cat, clock.now)
            )
        return timer


class Timeline:
    """Records this rank's segments and writes them to ``path`` from a background thread.

    Contract: construct on every rank, call ``start`` (collective: a barrier), ``attach`` the
    trainer's megatron-core config and optimizer, then per step ``step_begin(k)`` ... segments ...
    ``step_end()``; ``close`` at the end of the run (in a ``finally``: it writes what is left and
    uninstalls the communication trace). Everything but ``start`` and ``close`` is cheap and
    never blocks on the device: a step costs a few microseconds per segment. Write errors are
    logged once and recording goes on; training never fails because of the timeline.
    """

    enabled = True

    def __init__(
        self,
        path: Path,
        meta: dict[str, Any],
        *,
        flush_interval_steps: int = 10,
        device: str = "cpu",
        trace_comm: bool = True,
    ) -> None:
        if flush_interval_steps < 1:
            raise ValueError(
                f"diagnostics.flush_interval_steps = {flush_interval_steps}: must be >= 1"
            )
        self.path, self.meta = Path(path), meta
        self.flush_interval_steps = flush_interval_steps
        self._device_clock = _CudaClock(_cuda_index()) if device == "cuda" else _HostClock()
        self._trace_comm = trace_comm
        self._comm: Any = _NO_COMM  # a comm record source (comm_timer), while attached
        self._batch = _Batch(step=0, anchor=None, anchor_ns=time.monotonic_ns())
        self._step_start = 0
        self._pending: list[_Batch] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._megatron_timers = _MegatronTimers(self)
        self._attached: list[Any] = []
        self.write_seconds = 0.0
        """CPU seconds the writer thread spent resolving and writing records (off the hot path)."""

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self, group=None) -> Timeline:
        """Align clocks (collective over ``group``: every rank calls it once per process), open the
        file and start the writer thread."""
        import torch
        import torch.distributed as dist

        dist.barrier(group=group)
        mono_ns = time.monotonic_ns()  # as this rank leaves the barrier
        wall = torch.tensor([time.time_ns() if dist.get_rank() == 0 else 0], dtype=torch.int64)
        if dist.get_backend(group) == "nccl":
            wall = wall.cuda()
        dist.all_reduce(wall, group=group)  # rank 0's wall clock at the barrier, to every rank
        return self.open(int(wall.item()), mono_ns)

    def open(self, ref_wall_ns: int, mono_ns: int) -> Timeline:
        """Write the meta and clock records (``mono_ns`` on this rank's clock is ``ref_wall_ns``
        on the shared one) and start the writer thread. ``start`` calls it; tests without a
        process group call it directly."""
        runfiles.make_dir(self.path.parent)
        head = [
            {"type": "meta", "format": FORMAT_VERSION, **self.meta},
            {"type": "clock", "ref_wall_ns": ref_wall_ns, "mono_ns": mono_ns},
        ]
        with runfiles.open_append(self.path) as f:
            f.writelines(json.dumps(line) + "\n" for line in head)
        self._writer = threading.Thread(
            target=self._write_loop, name=f"timeline-writer-{self.path.stem}", daemon=True
        )
        self._writer.start()
        return self

    def attach(self, config, optimizer) -> None:
        """Have megatron-core's own timers (schedule, p2p, grad sync, optimizer) report here, and
        start recording communication calls (after ``open``; between steps).

        ``config`` is the model's ``TransformerConfig`` (the schedule reads ``config.timers``),
        ``optimizer`` megatron-core's optimizer (each inner optimizer's config is set too).
        Communication is read from the flight recorder if one is installed now, else from an
        in-memory recorder the timeline installs (``comm_timer.timeline_comm``).
        """
        targets = [config]
        for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            if getattr(opt, "config", None) is not None:
                targets.append(opt.config)
        for target in targets:
            _set_timers(target, self._megatron_timers)
        self._attached = targets
        if self._trace_comm and self._writer is not None and self._comm is _NO_COMM:
            from megascale.probes.comm_timer import timeline_comm

            self._comm = timeline_comm()

    def detach(self) -> None:
        """Undo ``attach``: megatron-core's timers unset, communication no longer recorded
        (``close`` does it; benchmarks compare steps with and without the timeline)."""
        for target in self._attached:
            _set_timers(target, None)
        self._attached = []
        if self._comm is not _NO_COMM:
            self._take_comm()  # keep this step's calls so far
            self._comm.uninstall()
            self._comm = _NO_COMM

    def flush(self) -> None:
        """Hand every finished step to the writer and wait until it is written (e.g. before
        reading the file during a run, or when a fault stops the job); not for the hot path."""
        if self._writer is None:
            return
        done = threading.Event()
        self._hand_off()
        self._queue.put(done)
        done.wait()

    def close(self) -> None:
        """Write everything recorded and stop the writer; idempotent."""
        if self._writer is None:
            return
        self._close_batch()
        self._hand_off()
        self._queue.put(None)
        self._writer.join()
        self._writer = None
        self.detach()

    # -- the hot path ------------------------------------------------------------------------------

    def step_begin(self, step: int) -> None:
        """Step ``step`` (1-based) starts: the previous step's records (and anything that ran
        after it, e.g. a checkpoint) are queued; every ``flush_interval_steps`` steps the writer
        gets them."""
        self._close_batch()
        if len(self._pending) >= self.flush_interval_steps:
            self._hand_off()
        now = time.monotonic_ns()
        self._batch = _Batch(step=step, anchor=self._device_clock.anchor(), anchor_ns=now)
        self._step_start = now

    def step_end(self) -> None:
        """The step's last operation returned (its loss is known)."""
        self._batch.spans.append(
            ("megascale::train::step", "step", self._step_start, time.monotonic_ns(), 0, 0)
        )

    def span(self, name: str) -> _Span:
        """``with timeline.span("megascale::data::load"): ...``: one of ``SEGMENTS``."""
        cat, on_device = SEGMENTS[name]
        now = self._device_clock.now if on_device else time.monotonic_ns
        return _Span(self, name, cat, now)

    def _record(self, name: str, cat: str, start: Any, end: Any, first_comm: int) -> None:
        self._batch.spans.append((name, cat, start, end, first_comm, self._comm.count()))

    def _close_batch(self) -> None:
        self._take_comm()
        batch = self._batch
        if batch.spans or batch.comm:
            self._pending.append(batch)

    def _take_comm(self) -> None:
        chunk = self._comm.take()
        if len(chunk):
            self._batch.comm.append(chunk)

    def _hand_off(self) -> None:
        if self._pending:
            self._queue.put(self._pending)
            self._pending = []

    # -- the writer thread -------------------------------------------------------------------------

    def _write_loop(self) -> None:
        if isinstance(self._device_clock, _CudaClock):
            import torch

            torch.cuda.set_device(self._device_clock.device_index)
        failed = False
        with runfiles.open_append(self.path) as f:
            while (batches := self._queue.get()) is not None:
                if isinstance(batches, threading.Event):  # flush(): all before it is written
                    batches.set()
                    continue
                started = time.thread_time()  # this (the writer) thread's CPU time
                try:
                    f.writelines(
                        json.dumps(resolve_batch(b, self._device_clock)) + "\n" for b in batches
                    )
                    f.flush()
                except Exception:  # never take training down; say so once
                    if not failed:
                        logger.exception(
                            "timeline: cannot write %s; later steps are lost", self.path
                        )
                    failed = True
                self.write_seconds += time.thread_time() - started


def resolve_batch(batch: _Batch, clock) -> dict[str, Any]:
    """One step's JSON record: device times resolved, comm calls turned into segments."""
    spans = []
    for name, cat, start, end, _first, _last in batch.spans:
        s = clock.resolve(start, batch.anchor, batch.anchor_ns)
        e = clock.resolve(end, batch.anchor, batch.anchor_ns)
        spans.append([name, cat, s, max(0, e - s)])
    records = [record for chunk in batch.comm for record in chunk.records()]
    blocked, inflight = comm_segments(records, batch.spans, host=clock.host_comm)
    return {"type": "step", "step": batch.step, "spans": spans + blocked, "inflight": inflight}


class _NoComm:
    """The comm record source while none is attached: no records."""

    def count(self) -> int:
        return 0

    def take(self) -> list:
        return []

    def uninstall(self) -> None:
        pass


_NO_COMM = _NoComm()


def _set_timers(target, timers) -> None:
    """Set ``target.timers``, or, where a chain stands there (``compute_time.ComputeMeter``), the
    timers behind it."""
    if hasattr(getattr(target, "timers", None), "inner"):
        target.timers.inner = timers
    else:
        target.timers = timers


def _cuda_index() -> int:
    import torch

    return torch.cuda.current_device()


class NullTimeline:
    """The timeline when ``diagnostics.timeline`` is off: every method does nothing."""

    enabled = False

    def start(self, group=None) -> NullTimeline:
        return self

    def open(self, ref_wall_ns: int, mono_ns: int) -> NullTimeline:
        return self

    def attach(self, config, optimizer) -> None:
        pass

    def detach(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def step_begin(self, step: int) -> None:
        pass

    def step_end(self) -> None:
        pass

    def span(self, name: str) -> _NullSpan:
        return _NULL_SPAN

    def close(self) -> None:
        pass


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc) -> None:
        return None


_NULL_SPAN = _NullSpan()
NULL_TIMELINE = NullTimeline()


def node_name() -> str:
    """This machine's name in the timeline: ``MEGASCALE_NODE`` (the agent's node name) when set,
    else the host name."""
    return os.environ.get("MEGASCALE_NODE") or socket.gethostname()


def rank_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / TIMELINE_DIR / f"rank_{rank:05d}.jsonl"


def build_timeline(diagnostics, run_dir: Path, groups, device: str) -> Timeline | NullTimeline:
    """This rank's started timeline for ``diagnostics`` (a ``DiagnosticsConfig``), or
    ``NULL_TIMELINE`` when it is off. Collective when on: every rank calls it at the same point."""
    if not diagnostics.timeline:
        return NULL_TIMELINE
    layout = groups.layout
    device_name = "cpu"
    if device == "cuda":
        import torch

        device_name = torch.cuda.get_device_name()
    meta = {
        "rank": groups.rank,
        "world_size": layout.world_size,
        "layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp},
        "coords": {"dp": groups.dp_rank, "pp": groups.pp_rank, "tp": groups.tp_rank},
        "node": node_name(),
        "pid": os.getpid(),
        "device": device,
        "device_name": device_name,
        "generation": os.environ.get("MEGASCALE_GENERATION"),
    }
    timeline = Timeline(
        rank_file(run_dir, groups.rank),
        meta,
        flush_interval_steps=diagnostics.flush_interval_steps,
        device=device,
        trace_comm=True,  # on CUDA: the segments the flight recorder's events timed
    )
    return timeline.start()
