"""The job's figures as the controller publishes them in etcd's ``summary`` key, for readers
that are not the controller (the Kubernetes operator's ``.status``, ``kubectl``).

The controller's ``state`` snapshot holds what a standby needs to continue and is written when
the controller decides something; the figures of a healthy job change with every step, when the
controller decides nothing. ``JobSummary`` collects them from the heartbeats (``observe``: rank 0's
node carries the job-wide figures, ``messages.Heartbeat``), and the controller
writes ``to_json`` at most every ``ServiceOptions.snapshot_s`` while they change. One small key:
O(1) bytes whatever the number of nodes. The value is a ``messages.JobSummaryRecord``::

    {"schema": "1.0", "time": <wall>, "state": str, "generation": int,
     "step": int | None            the job's highest completed step (the controller's view),
     "tokens_per_s": float | None  job-wide, as the job's lowest rank computed it at
     "figures_step": int | None    this step (rank 0's line of metrics.jsonl has the same),
     "mfu": float | None, "mfu_peak": str | None   job-wide MFU and its peak in words,
     "last_checkpoint": {"step", "time" (wall), "url"} | None   newest durable checkpoint,
     "faults": int, "restarts": int,
     "effective": {"productive_s", "wall_s", "ratio"}   effective training time (effective.py)}

Figures are job-wide as one rank computed them (global batch over its step time): they are taken
from one rank, the lowest reporting (rank 0, which writes ``metrics.jsonl``), never summed over
ranks or nodes. A new generation's figures replace the previous one's from its first reported step.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from megascale.messages import DurableCheckpoint, JobSummaryRecord
from megascale.messages.job import EffectiveFigures

if TYPE_CHECKING:
    from megascale.controller.effective import EffectiveTime
    from megascale.controller.fsm import ControllerFSM
    from megascale.messages import Heartbeat


class JobSummary:
    """The figures seen so far; ``changed`` is set when an observation changed one."""

    def __init__(self) -> None:
        self.tokens_per_s: float | None = None
        self.mfu: float | None = None
        self.mfu_peak: str | None = None
        self.checkpoint: DurableCheckpoint | None = None
        self.changed = False
        self.figures_step: int | None = None  # the step the figures are of
        self._written_at = -math.inf

    def new_generation(self) -> None:
        """A generation starts: its first reported step's figures replace the old ones."""
        self.figures_step = None

    def observe(self, heartbeat: Heartbeat) -> None:
        """A heartbeat of the current generation. Its job-wide figures are rank 0's and only the
        node running rank 0 carries them (``messages.Heartbeat``); a newer step's replace them.
        Its newest durable checkpoint replaces the one kept when it completed later."""
        rank0 = heartbeat.ranks.get("0")
        step = rank0.step if rank0 is not None else None
        if heartbeat.tokens_per_s and step is not None and step > (self.figures_step or 0):
            self.figures_step = int(step)
            self.tokens_per_s = float(heartbeat.tokens_per_s)
            self.mfu = heartbeat.mfu
            self.mfu_peak = heartbeat.mfu_peak
            self.changed = True
        mark = heartbeat.durable
        if mark is not None and (self.checkpoint is None or mark.time > self.checkpoint.time):
            self.checkpoint = mark
            self.changed = True

    def due(self, now: float, interval_s: float, force: bool = False) -> bool:
        """Whether to write now: something changed, and ``interval_s`` has passed since the last
        write or ``force`` (the controller forces it when it writes a decision, so that the
        summary is never older than the ``state`` snapshot). ``now``: its monotonic clock."""
        return self.changed and (force or now - self._written_at >= interval_s)

    def to_json(self, fsm: ControllerFSM, effective: EffectiveTime, now: float) -> dict[str, Any]:
        """``take``'s record, encoded."""
        return self.take(fsm, effective, now).encode()

    def take(self, fsm: ControllerFSM, effective: EffectiveTime, now: float) -> JobSummaryRecord:
        """The ``summary`` value (module docstring) at ``now`` (the clock ``effective`` uses),
        to be written now: clears ``changed``."""
        self.changed, self._written_at = False, now
        wall_s = now - effective.start
        return JobSummaryRecord(
            time=time.time(),
            state=fsm.state.value,
            generation=fsm.generation,
            step=fsm.step,
            tokens_per_s=self.tokens_per_s,
            figures_step=self.figures_step,
            mfu=self.mfu,
            mfu_peak=self.mfu_peak,
            last_checkpoint=self.checkpoint,
            faults=len(fsm.faults),
            restarts=fsm.restarts,
            effective=EffectiveFigures(
                productive_s=effective.productive_s,
                wall_s=wall_s,
                ratio=effective.productive_s / wall_s if wall_s > 0 else 0.0,
            ),
        )
