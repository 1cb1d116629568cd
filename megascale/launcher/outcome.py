"""What a ``megascale launch`` run produced: ``RUN_DIR/final.json`` (``summarize``; the record is
``messages.FinalOutcome``, read back with ``read_final``)::

    {"schema": "1.0", "finished": true, "state": "finished", "reason": null, "final_step": 50, "steps": 50,
     "param_digest": "<sha256>", "digest_step": 50,
     "faults_injected": ["kill-worker:rank=1,step=25"],
     "faults_detected": {"worker_exit": 1},          # controller faults + notices, by kind
     "recoveries": 1, "generations": 2, "evicted": [],
     "fault_timings": [{"fault", "fired_at", "step", "decision", "detected_as", "node",
                        "rank", "detection_s", "resumed_s"}],
     "wall_time_s": 23.4, "nodes": 2, "nproc_per_node": 1, "spares": 1, ...,
     "failure": "<the controller's reason>" | null,      # why a failed job failed
     "fatal": {"node", "rank", "reason"} | null}          # a rank's job-fatal error (fatal.py)

Everything is read back from the run directory (events.jsonl, metrics.jsonl, faults/, the
checkpoints), so a run can be summarised again after the fact.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from megascale.controller.events import Event, read_events
from megascale.messages import FinalOutcome, read_metrics
from megascale.messages.job import FatalError, FaultTiming
from megascale.probes import inject

logger = logging.getLogger(__name__)

FINAL_FILE = "final.json"

NOTICES = ("checkpoint_fallback", "etcd_unavailable", "controller_takeover")
"""Events counted in ``faults_detected`` besides the controller's faults."""
DECISIONS = {
    "etcd-restart": ("etcd_unavailable",),
    "kill-controller": ("controller_takeover",),
    "corrupt-checkpoint": ("checkpoint_fallback",),
    "fail-selfcheck": ("evict",),
    "slow-rank": (),
}
"""Per injected kind, the events that count as the controller noticing it (default: a fault)."""


def current_step(metrics: Path) -> int:
    """The last step in ``metrics.jsonl`` (rank 0 writes one line per step), 0 if none."""
    try:
        with open(metrics, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def parameter_digest(run_dir: Path, job: Any) -> tuple[str | None, int | None]:
    """sha256 over the model weights in the newest complete checkpoint, and that checkpoint's step
    (``checkpoint.load.model_digest``): equal for equal weights whatever layout saved them."""
    from megascale.train.checkpoint.load import model_digest
    from megascale.train.checkpoint.storage import location

    try:
        return model_digest(location(job.checkpoint, run_dir))
    except Exception as e:  # a corrupt or half-written checkpoint: final.json is written anyway
        logger.warning("no parameter digest (%s: %s)", type(e).__name__, str(e)[:300])
        return None, None


def fault_timings(run_dir: Path, events: list[Event]) -> list[FaultTiming]:
    """Per fired fault: how long until the controller decided (the next event that counts, see
    ``DECISIONS``) and until training next completed a step in a generation started after it
    (``metrics.jsonl``; without a controller's events, the next step after it)."""
    metrics = []
    try:
        metrics = read_metrics((run_dir / "metrics.jsonl").read_text().splitlines())
    except (OSError, ValueError):
        pass
    out = []
    for fault in inject.fired(run_dir):
        kinds, t0 = DECISIONS.get(fault["kind"], ("fault",)), fault["time"]
        found = [e for e in events if e.kind in kinds and e.time >= t0]
        decided = found[0] if found else None
        # The rank that names the cause: every rank reports a checkpoint it skipped, one says why.
        named = next((e for e in found if "another rank" not in str(e.detail)), decided)
        # Training resumed: the first step completed in a generation started after the fault
        # (a step a healthy rank 0 finished a moment after the kill is not a recovery).
        began = next((e.time for e in events if e.kind == "generation_start" and e.time >= t0), t0)
        resumed = next((m.time for m in metrics if (m.time or 0) > began), None)
        row = FaultTiming(fault=fault["spec"], fired_at=t0, step=fault.get("step"))
        if decided is not None and named is not None:
            row.decision = decided.kind
            row.detected_as = decided.detail.get("fault", decided.kind)
            row.node, row.rank = named.node, named.rank
            row.detection_s = round(decided.time - t0, 3)
        if resumed is not None:
            row.resumed_s = round(resumed - t0, 3)
        out.append(row)
    return out


def faults_detected(events: list[Event]) -> dict[str, int]:
    """The controller's faults by kind, and the notices; a checkpoint fallback (every rank
    reports the checkpoint it skipped) counts once per generation."""
    detected: dict[str, int] = {}
    fallbacks = set()
    for e in events:
        kind = e.detail.get("fault") if e.kind == "fault" else e.kind
        if kind == "checkpoint_fallback":
            if e.generation in fallbacks:
                continue
            fallbacks.add(e.generation)
        if e.kind == "fault" or kind in NOTICES:
            detected[str(kind)] = detected.get(str(kind), 0) + 1
    return detected


def failure(events: list[Event]) -> tuple[str | None, FatalError | None]:
    """The reason of the controller's ``failed`` event (None when it did not fail the job),
    and the job-fatal error a rank ended the job with (``probes.fatal``)."""
    failed = [e for e in events if e.kind == "failed"]
    fatal = [e for e in events if e.kind == "fault" and e.detail.get("fault") == "job_fatal"]
    return (
        failed[-1].detail.get("reason") if failed else None,
        FatalError(fatal[0].node, fatal[0].rank, fatal[0].detail.get("reason")) if fatal else None,
    )


def summarize(
    run_dir: Path, job: Any, state: str, wall_s: float, opts: Any, reason: str | None = None
) -> FinalOutcome:
    """The content of ``final.json`` (see the module docstring); ``reason``: why the launcher
    stopped the job (a signal, a timeout, etcd or the controller lost for good), else None."""
    events = read_events(run_dir) if (run_dir / "events.jsonl").exists() else []
    digest, digest_step = parameter_digest(run_dir, job)
    failed, fatal = failure(events)
    return FinalOutcome(
        finished=state == "finished",
        state=state,
        reason=reason,
        final_step=current_step(run_dir / "metrics.jsonl"),
        steps=job.train.steps,
        param_digest=digest,
        digest_step=digest_step,
        faults_injected=[f["spec"] for f in inject.fired(run_dir)],
        faults_detected=faults_detected(events),
        recoveries=sum(1 for e in events if e.kind == "generation_running" and e.generation > 1),
        generations=max((e.generation for e in events), default=0),
        evicted=[e.node for e in events if e.kind == "evict" and e.node is not None],
        fault_timings=fault_timings(run_dir, events),
        failure=failed,
        fatal=fatal,
        wall_time_s=round(wall_s, 3),
        nodes=opts.nodes,
        nproc_per_node=opts.nproc_per_node,
        spares=opts.spares,
        heartbeat_interval_s=opts.heartbeat_interval,
        job_id=opts.job_id,
        run_dir=str(run_dir),
    )


def read_final(run_dir: Path) -> FinalOutcome:
    """``RUN_DIR/final.json``, decoded (``MessageError`` for another major's file)."""
    return FinalOutcome.from_json((Path(run_dir) / FINAL_FILE).read_bytes())
