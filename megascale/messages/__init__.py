"""Every message that crosses a process boundary, defined once: producer and consumers import it
from here.

* ``node``: the rules every message follows (``Message``: declared fields, a ``schema``
  version, one decoder) and what a node writes: ``RankProgress``, ``Heartbeat``, ``Ack``,
  ``StepMetrics``.
* ``job``: the job-level messages: ``Command``, the controller's ``ControllerStatus``,
  ``GenerationRecord``, ``BlockedNode``, ``ControllerState``, ``JobSummaryRecord``, ``Event`` and
  the launcher's ``FinalOutcome``.
"""

from __future__ import annotations

from megascale.messages.job import (
    BlockedNode,
    Command,
    ControllerState,
    ControllerStatus,
    Event,
    FinalOutcome,
    GenerationRecord,
    JobSummaryRecord,
)
from megascale.messages.node import (
    COMM_GROUPS,
    SCHEMA,
    SCHEMA_KEY,
    Ack,
    CheckpointFigures,
    DurableCheckpoint,
    Heartbeat,
    M,
    Message,
    MessageError,
    RankFigures,
    RankProgress,
    Reported,
    StepMetrics,
    WorkerStatus,
    declare,
    decoded,
    read_metrics,
)

__all__ = [
    "Ack",
    "BlockedNode",
    "COMM_GROUPS",
    "CheckpointFigures",
    "Command",
    "ControllerState",
    "ControllerStatus",
    "DurableCheckpoint",
    "Event",
    "FinalOutcome",
    "GenerationRecord",
    "Heartbeat",
    "JobSummaryRecord",
    "M",
    "Message",
    "MessageError",
    "RankFigures",
    "RankProgress",
    "Reported",
    "SCHEMA",
    "SCHEMA_KEY",
    "StepMetrics",
    "WorkerStatus",
    "declare",
    "decoded",
    "read_metrics",
]
