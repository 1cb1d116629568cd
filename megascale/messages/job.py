"""The job-level messages: what the controller writes for agents and for the job's readers, and
what a ``megascale launch`` run leaves behind. ``megascale.messages`` re-exports them; they follow
its rules (``Message``: declared fields, ``schema`` version, one decoder that refuses another
major or an undeclared field in one line).

===================  ==========================================  ===============================
message              producer -> consumers                       where it travels
===================  ==========================================  ===============================
``Command``          controller -> agent                         etcd ``commands/<node>``
``ControllerStatus`` controller -> agents                        etcd ``status``
``GenerationRecord`` controller -> agents                        etcd ``generation``
``BlockedNode``      controller -> operator                      etcd ``blocklist/<node>``
``ControllerState``  controller -> standby controller, operator  etcd ``state``
``JobSummaryRecord`` controller -> operator, ``kubectl``         etcd ``summary``
``Event``            controller, agents -> report, outcome,      ``events.jsonl``, etcd
                     operator, tests                             ``events/<seq>``
``FinalOutcome``     launcher -> users, tests                    ``RUN_DIR/final.json``
===================  ==========================================  ===============================
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, ClassVar

from megascale.messages.node import DurableCheckpoint, Message, declare

COMMAND_KINDS = ("stop", "selfcheck", "start")


# -- controller -> agents ------------------------------------------------------------------------


@declare
class RankAssignment(Message):
    """A ``start`` command's ranks for one node: the global rank of each local rank, the world
    size and the node that runs rank 0 (it publishes the rendezvous address)."""

    ranks: list[int]
    world_size: int
    master_node: str


@declare
class NeighbourEntry(Message):
    """A ``selfcheck`` command's all-reduce with ``node`` on port offset ``channel``
    (``controller.neighbours``)."""

    node: str
    channel: int


@declare
class Command(Message):
    """``commands/<node>``: ``kind`` is ``stop`` (stop the workers of ``generation``),
    ``selfcheck`` (run the node self-check, ack with its result; ``neighbours`` may name
    all-reduce partners) or ``start`` (start the workers of ``generation`` with
    ``rank_assignment``). The agent acks ``id`` (``messages.Ack``)."""

    job: str
    generation: int
    kind: str
    id: str
    rank_assignment: RankAssignment | None = None
    neighbours: list[NeighbourEntry] = field(default_factory=list)
    pause_wait_s: float | None = None
    """``stop`` under in-process recovery: how long at most the agent waits for its ranks to
    pause before it kills them (None: ``fault_tolerance.pause_timeout_s``). Set after a fault
    that leaves ranks blocked in a collective that cannot complete (``BLOCKING_FAULTS``): such a
    rank never returns to Python to pause."""
    NESTED: ClassVar = {
        "rank_assignment": (RankAssignment, "one"),
        "neighbours": (NeighbourEntry, "list"),
    }


@declare
class ControllerStatus(Message):
    """``status``: the controller's state and generation, the few bytes agents watch."""

    state: str
    generation: int


@declare
class GenerationRecord(Message):
    """``generation``: the newest generation and its assignment (node -> global ranks), written
    with or before its start commands; an agent accepts no command of a later generation."""

    generation: int
    assignment: dict[str, list[int]] = field(default_factory=dict)


@declare
class BlockedNode(Message):
    """``blocklist/<node>``: a node evicted for ``reason`` at ``generation``; never used again."""

    reason: str
    generation: int
    time: float


# -- the controller's state and summary --------------------------------------------------------


@declare
class FaultRecord(Message):
    """The fault being handled: its kind, where (None: the job as a whole), what was seen, which
    nodes are suspected and whether it counts against them (``blames_nodes``: false for a
    software fault such as a mismatched collective)."""

    kind: str
    node: str | None = None
    rank: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    suspects: list[str] = field(default_factory=list)
    blames_nodes: bool = True


@declare
class ControllerState(Message):
    """``state``: everything a standby controller needs to continue (``controller_snapshot``);
    the operator reads ``state``, ``generation``, ``restarts``, ``order``, ``spares``, ``step``,
    ``fault`` and ``failure``. ``restart_ages_s`` are ages (a standby's clock has another
    origin); ``samples``: observed section durations by section."""

    state: str
    generation: int
    restarts: int = 0
    restart_ages_s: list[float] = field(default_factory=list)
    failure: str | None = None
    order: list[str] = field(default_factory=list)
    assignment: dict[str, list[int]] = field(default_factory=dict)
    registered: list[str] = field(default_factory=list)
    spares: list[str] = field(default_factory=list)
    blocklist: dict[str, str] = field(default_factory=dict)
    awaiting: dict[str, str] = field(default_factory=dict)
    awaiting_kind: str | None = None
    step: int | None = None
    section: str = "init"
    stall_timeout_s: float | None = None
    fault: FaultRecord | None = None
    faults: int = 0
    culprits: dict[str, int] = field(default_factory=dict)
    error_signatures: dict[str, int] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    commands: int = 0
    topology: dict[str, str] = field(default_factory=dict)
    NESTED: ClassVar = {"fault": (FaultRecord, "one")}


@declare
class EffectiveFigures(Message):
    """Effective training time (``controller.effective``): productive seconds of ``wall_s``."""

    productive_s: float
    wall_s: float
    ratio: float


@declare
class JobSummaryRecord(Message):
    """``summary``: the job's figures (``controller.job_summary`` documents each); job-wide
    figures are rank 0's, never summed over ranks or nodes."""

    time: float
    state: str
    generation: int
    step: int | None = None
    tokens_per_s: float | None = None
    figures_step: int | None = None
    mfu: float | None = None
    mfu_peak: str | None = None
    last_checkpoint: DurableCheckpoint | None = None
    faults: int = 0
    restarts: int = 0
    effective: EffectiveFigures | None = None
    NESTED: ClassVar = {
        "last_checkpoint": (DurableCheckpoint, "one"),
        "effective": (EffectiveFigures, "one"),
    }


# -- events and the run's outcome ------------------------------------------------------------


@declare
class Event(Message):
    """One decision of the controller (``controller.events``): ``kind`` (``EVENT_KINDS``),
    ``node``/``rank`` None when it is about the job; ``term``: the writing leader's term (None
    for a writer without one)."""

    seq: int
    time: float
    generation: int
    kind: str
    node: str | None = None
    rank: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    term: int | None = None
    OMIT_NONE: ClassVar = ("term",)


@declare
class FaultTiming(Message):
    """A fired fault: when, the decision that counted as noticing it and how long until it and
    until training next completed a step (``launcher.outcome.fault_timings``)."""

    OMIT_NONE: ClassVar = (
        "decision",
        "detected_as",
        "node",
        "rank",
        "detection_s",
        "resumed_s",
    )

    fault: str
    fired_at: float
    step: int | None = None
    decision: str | None = None
    detected_as: str | None = None
    node: str | None = None
    rank: int | None = None
    detection_s: float | None = None
    resumed_s: float | None = None


@declare
class FatalError(Message):
    """The job-fatal error a rank ended the job with (``probes.fatal``)."""

    node: str | None
    rank: int | None
    reason: str | None


@declare
class FinalOutcome(Message):
    """``RUN_DIR/final.json`` (``launcher.outcome`` documents each field)."""

    finished: bool
    state: str
    final_step: int
    steps: int
    job_id: str
    run_dir: str
    reason: str | None = None
    param_digest: str | None = None
    digest_step: int | None = None
    faults_injected: list[str] = field(default_factory=list)
    faults_detected: dict[str, int] = field(default_factory=dict)
    recoveries: int = 0
    generations: int = 0
    evicted: list[str] = field(default_factory=list)
    fault_timings: list[FaultTiming] = field(default_factory=list)
    failure: str | None = None
    fatal: FatalError | None = None
    wall_time_s: float = 0.0
    nodes: int = 0
    nproc_per_node: int = 0
    spares: int = 0
    heartbeat_interval_s: float = 0.0
    NESTED: ClassVar = {
        "fault_timings": (FaultTiming, "list"),
        "fatal": (FatalError, "one"),
    }
