"""``megascale timeline RUN_DIR``: merge every rank's segments into one Chrome-trace / Perfetto JSON
and write per-step, per-rank tables.

Reads ``RUN_DIR/timeline/rank_NNNNN.jsonl`` (written by ``megascale.probes.timers``), aligns
the ranks' clocks on the barrier each process passed at start (see that module), and writes:

* ``trace.json``: one process per rank, named ``rank N (dp=.., pp=.., tp=..) on NODE``; one thread
  per category (step, data, compute, optimizer, comm dp/pp/tp/other, checkpoint) with each segment
  as a complete event; asynchronous communication in flight as async slices; the run's faults and
  recoveries (``RUN_DIR/events.jsonl``) as global instant events; the loss as a counter. Open it in
  ``ui.perfetto.dev`` or ``chrome://tracing``.
* ``steps.csv``: one row per (rank, step): step time, compute time, time blocked in each kind of
  communication, data loading, forward, backward, optimizer, checkpoint (seconds).
* ``segments.csv``: one row per (rank, step, segment name): count and total seconds.

Contract: ``load_run`` tolerates a torn last line (a rank that crashed mid-write) and a rank file
with several process starts (a restart): each step record uses the clock of the process that wrote
it, and a step written twice (replayed after a restart) keeps its last record.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import stat
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megascale import runfiles
from megascale.controller.events import EVENTS_FILE, read_events
from megascale.messages import Event
from megascale.parallel.layout import Coord, Layout
from megascale.probes.timeline_segments import CATEGORIES
from megascale.probes.timers import TIMELINE_DIR

logger = logging.getLogger(__name__)

STEP_SPAN = "megascale::train::step"
COMM_GROUPS = ("dp", "pp", "tp", "other")


@dataclass
class StepRecord:
    """One rank's segments of one step, on the aligned clock (ns since the epoch, rank 0's wall
    clock at the barrier as reference)."""

    step: int
    spans: list[tuple[str, str, int, int]]
    """(name, category, start ns, duration ns)."""
    inflight: list[tuple[str, str, int, int]]
    """Asynchronous communication: (name, category, issue ns, issue-to-completion ns)."""

    def step_span(self) -> tuple[int, int] | None:
        """(start, end) of the step itself, or None when the step never finished."""
        for name, _cat, start, dur in self.spans:
            if name == STEP_SPAN:
                return start, start + dur
        return None


@dataclass
class RankTimeline:
    """Everything one rank recorded."""

    rank: int
    node: str
    coords: Coord
    layout: Layout
    device_name: str
    steps: dict[int, StepRecord] = field(default_factory=dict)

    def label(self) -> str:
        c = self.coords
        return f"rank {self.rank} (dp={c.dp}, pp={c.pp}, tp={c.tp}) on {self.node}"


@dataclass
class Breakdown:
    """Where one rank's step went, in seconds.

    ``period_s`` runs from this step's start to the next step's start (this step's end for the
    last step): it includes what the rank did between steps (a checkpoint, an injected sleep).
    ``comm_wait_s`` is the union of the intervals the rank was blocked in any communication within
    the period; ``compute_s`` is the period less the union of those intervals and checkpointing
    (whose collectives are both): the straggler measure. A slow rank computes longer while its
    peers wait for it in communication.
    ``device_compute_s`` is the straggler measure: the forward and backward compute spans (timed
    on the device on a GPU) less the communication the host was blocked in inside them (on CPU).
    """

    step_s: float
    period_s: float
    compute_s: float
    comm_wait_s: float
    data_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    checkpoint_s: float
    comm_dp_s: float
    comm_pp_s: float
    comm_tp_s: float
    comm_other_s: float
    device_compute_s: float = 0.0


BREAKDOWN_FIELDS = tuple(Breakdown.__dataclass_fields__)


class TimelineFileError(ValueError):
    """A file the timeline reads is not a regular file (a device, a FIFO, a directory; a symlink
    is followed and its target checked); the message names it in one line."""


MAX_LINE_BYTES = 64 << 20
"""A longer line (a step of a runaway span list, or garbage) is skipped, never held in memory."""


def _open_regular(path: Path) -> tuple[Any, int]:
    """``path`` opened for reading and its size at that moment; TimelineFileError unless it is a
    regular file. Opened non-blocking (a FIFO does not hang the open) and checked on the open
    descriptor, so the file checked is the file read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a device, FIFO or socket"
        raise TimelineFileError(
            f"{path}: not a regular file ({kind}); a timeline file is a JSON-lines file written "
            "by a rank: remove or replace it"
        )
    return os.fdopen(fd, "rb"), st.st_size


def _read_lines(path: Path) -> Iterable[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, torn or invalid lines skipped. Reads at most the
    file's size when opened (a file that keeps growing is not followed) and at most
    ``MAX_LINE_BYTES`` of one line."""
    f, left = _open_regular(path)
    with f:
        number = 0
        while left > 0:
            line = f.readline(min(left, MAX_LINE_BYTES + 1))
            if not line:
                break
            left -= len(line)
            number += 1
            if len(line) > MAX_LINE_BYTES:
                while left > 0 and not line.endswith(b"\n"):  # skip the rest of the line
                    line = f.readline(min(left, 1 << 20))
                    left -= len(line)
                    if not line:
                        break
                logger.warning("%s:%d: skipping a line over %d bytes", path, number, MAX_LINE_BYTES)
                continue
            try:
                yield json.loads(line)
            except ValueError:
                logger.warning("%s:%d: skipping a torn or invalid line", path, number)


def load_rank(path: Path) -> RankTimeline | None:
    """One rank's file, clocks aligned; None when it holds no meta record."""
    timeline: RankTimeline | None = None
    offset = 0
    for record in _read_lines(path):
        kind = record.get("type")
        if kind == "meta":
            lay = record["layout"]
            layout = Layout(
                world_size=record["world_size"], tp=lay["tp"], pp=lay["pp"], dp=lay["dp"]
            )
            c = record["coords"]
            if timeline is None:
                timeline = RankTimeline(
                    rank=record["rank"],
                    node=record.get("node") or "?",
                    coords=Coord(dp=c["dp"], pp=c["pp"], tp=c["tp"]),
                    layout=layout,
                    device_name=record.get("device_name") or record.get("device") or "?",
                )
            else:  # a restarted process: the newest layout and node win
                timeline.node = record.get("node") or timeline.node
                timeline.coords = Coord(dp=c["dp"], pp=c["pp"], tp=c["tp"])
                timeline.layout = layout
        elif kind == "clock":
            offset = record["ref_wall_ns"] - record["mono_ns"]
        elif kind == "step" and timeline is not None:
            timeline.steps[record["step"]] = StepRecord(
                step=record["step"],
                spans=[(n, c, s + offset, d) for n, c, s, d in record["spans"]],
                inflight=[(n, c, s + offset, d) for n, c, s, d in record.get("inflight", [])],
            )
    return timeline


def load_run(run_dir: str | Path) -> list[RankTimeline]:
    """Every rank's timeline in ``RUN_DIR/timeline``, by rank. FileNotFoundError when none."""
    directory = Path(run_dir) / TIMELINE_DIR
    files = sorted(directory.glob("rank_*.jsonl"))
    if not files:
        raise FileNotFoundError(
            f"no timeline in {directory}: train with diagnostics.timeline = true (the default)"
        )
    ranks = [t for t in (load_rank(f) for f in files) if t is not None]
    return sorted(ranks, key=lambda t: t.rank)


# --------------------------------------------------------------------------------------------------
# Per-step breakdown
# --------------------------------------------------------------------------------------------------


def union_ns(intervals: Iterable[tuple[int, int]], lo: int, hi: int) -> int:
    """Total length of the union of (start, end) intervals, clipped to [lo, hi]."""
    total, reach = 0, lo
    for start, end in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def breakdown(record: StepRecord, next_start: int | None) -> Breakdown | None:
    """Where ``record``'s step went; None when the step has no step span (it never finished).
    ``next_start``: when this rank's next step began (None for the last step)."""
    span = record.step_span()
    if span is None:
        return None
    start, end = span
    period_end = next_start if next_start is not None and next_start > start else end
    by_cat: dict[str, list[tuple[int, int]]] = defaultdict(list)
    by_name: dict[str, int] = defaultdict(int)
    for name, cat, s, d in record.spans:
        by_cat[cat].append((s, s + d))
        by_name[name] += d
    comm = [iv for group in COMM_GROUPS for iv in by_cat[f"comm.{group}"]]
    comm_ns = union_ns(comm, start, period_end)
    checkpoint_ns = union_ns(by_cat["checkpoint"], start, period_end)
    not_compute_ns = union_ns(comm + by_cat["checkpoint"], start, period_end)  # may overlap
    device_ns = sum(e - b - union_ns(comm, b, e) for b, e in by_cat["compute"])

    def s(ns: int) -> float:
        return ns / 1e9

    period = period_end - start
    return Breakdown(
        step_s=s(end - start),
        period_s=s(period),
        compute_s=s(max(0, period - not_compute_ns)),
        comm_wait_s=s(comm_ns),
        data_s=s(by_name["megascale::data::wait"] + by_name["megascale::data::load"]),
        forward_s=s(by_name["megascale::model::forward"]),
        backward_s=s(by_name["megascale::model::backward"]),
        optimizer_s=s(by_name["megascale::optim::step"]),
        checkpoint_s=s(checkpoint_ns),
        **{f"comm_{g}_s": s(union_ns(by_cat[f"comm.{g}"], start, period_end)) for g in COMM_GROUPS},
        device_compute_s=s(device_ns),
    )


def breakdowns(rank: RankTimeline) -> dict[int, Breakdown]:
    """Step -> breakdown for every finished step of ``rank``."""
    steps = sorted(rank.steps)
    out = {}
    for i, step in enumerate(steps):
        nxt = None
        if i + 1 < len(steps) and steps[i + 1] == step + 1:
            nxt_span = rank.steps[step + 1].step_span()
            nxt = nxt_span[0] if nxt_span else None
        b = breakdown(rank.steps[step], nxt)
        if b is not None:
            out[step] = b
    return out


# --------------------------------------------------------------------------------------------------
# Chrome trace
# --------------------------------------------------------------------------------------------------

_TID = {cat: i + 1 for i, cat in enumerate(CATEGORIES)}
_THREAD_NAMES = {cat: cat.replace("comm.", "comm ") for cat in CATEGORIES}


def chrome_trace(
    ranks: list[RankTimeline],
    events: list[Event] = (),
    metrics: list[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The merged trace (Chrome trace event format, which Perfetto reads).

    Timestamps are microseconds since the earliest segment; ``otherData.origin_wall_ns`` gives that
    origin as wall-clock ns, so events with a wall time (faults, metrics) land where they happened.
    """
    starts = [s for r in ranks for rec in r.steps.values() for _n, _c, s, _d in rec.spans]
    origin = min(starts) if starts else 0

    def us(ns: int) -> float:
        return round((ns - origin) / 1e3, 3)

    out: list[dict[str, Any]] = []
    async_id = 0
    for r in ranks:
        out.append(_meta("process_name", r.rank, 0, {"name": r.label()}))
        out.append(_meta("process_sort_index", r.rank, 0, {"sort_index": r.rank}))
        for cat in CATEGORIES:
            out.append(_meta("thread_name", r.rank, _TID[cat], {"name": _THREAD_NAMES[cat]}))
            out.append(_meta("thread_sort_index", r.rank, _TID[cat], {"sort_index": _TID[cat]}))
        for step in sorted(r.steps):
            rec = r.steps[step]
            for name, cat, start, dur in rec.spans:
                out.append(
                    {
                        "name": name,
                        "cat": cat,
                        "ph": "X",
                        "ts": us(start),
                        "dur": round(dur / 1e3, 3),
                        "pid": r.rank,
                        "tid": _TID.get(cat, _TID["other"]),
                        "args": {"step": step},
                    }
                )
            for name, cat, start, dur in rec.inflight:
                async_id += 1
                common = {"name": name, "cat": f"{cat} in flight", "pid": r.rank, "id": async_id}
                out.append({**common, "ph": "b", "ts": us(start), "args": {"step": step}})
                out.append({**common, "ph": "e", "ts": us(start + dur)})
    for ev in events:
        where = {"node": ev.node, "rank": ev.rank, "generation": ev.generation}
        who = ", ".join(f"{k} {v}" for k, v in where.items() if v is not None)
        out.append(
            {
                "name": ev.kind + (f" ({who})" if who else ""),
                "cat": "fault",
                "ph": "i",
                "s": "g",
                "ts": us(int(ev.time * 1e9)),
                "pid": 0,
                "tid": 0,
                "args": {k: v for k, v in ev.encode().items() if k != "time"},
            }
        )
    for m in metrics:
        if "time" in m and "loss" in m:
            out.append(
                {
                    "name": "loss",
                    "ph": "C",
                    "ts": us(int(m["time"] * 1e9)),
                    "pid": 0,
                    "args": {"loss": m["loss"]},
                }
            )
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {"origin_wall_ns": origin, "ranks": len(ranks)},
    }


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------


def write_tables(ranks: list[RankTimeline], directory: Path) -> tuple[Path, Path]:
    """``steps.csv`` (one row per rank and step) and ``segments.csv`` (per rank, step, segment)."""
    runfiles.make_dir(directory)
    steps_path, segments_path = directory / "steps.csv", directory / "segments.csv"
    steps, w = _csv()
    w.writerow(["rank", "node", "dp", "pp", "tp", "step", *BREAKDOWN_FIELDS])
    for r in ranks:
        for step, b in sorted(breakdowns(r).items()):
            values = [f"{getattr(b, k):.6f}" for k in BREAKDOWN_FIELDS]
            w.writerow([r.rank, r.node, *r.coords, step, *values])
    runfiles.write_text(steps_path, steps.getvalue())
    segments, w = _csv()
    w.writerow(["rank", "step", "segment", "category", "count", "total_s"])
    for r in ranks:
        for step in sorted(r.steps):
            totals: dict[tuple[str, str], list[int]] = {}
            for name, cat, _s, d in r.steps[step].spans:
                entry = totals.setdefault((name, cat), [0, 0])
                entry[0] += 1
                entry[1] += d
            for (name, cat), (count, ns) in sorted(totals.items()):
                w.writerow([r.rank, step, name, cat, count, f"{ns / 1e9:.6f}"])
    runfiles.write_text(segments_path, segments.getvalue())
    return steps_path, segments_path


def _csv() -> tuple[io.StringIO, Any]:
    buffer = io.StringIO(newline="")
    return buffer, csv.writer(buffer)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file's objects (none when the file is absent; torn lines skipped)."""
    return list(_read_lines(path)) if path.is_file() else []


def write_trace(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, Path, Path]:
    """Merge ``run_dir``'s timeline: (trace.json, steps.csv, segments.csv). The tables go next to
    the trace (default ``RUN_DIR/timeline/trace.json``)."""
    run_dir = Path(run_dir)
    ranks = load_run(run_dir)
    trace = chrome_trace(
        ranks,
        read_events(run_dir) if (run_dir / EVENTS_FILE).is_file() else [],
        read_jsonl(run_dir / "metrics.jsonl"),
    )
    out = Path(out) if out is not None else run_dir / TIMELINE_DIR / "trace.json"
    runfiles.make_dir(out.parent)
    runfiles.write_text(out, json.dumps(trace))
    steps_csv, segments_csv = write_tables(ranks, out.parent)
    return out, steps_csv, segments_csv
