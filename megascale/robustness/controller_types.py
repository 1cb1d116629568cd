"""The controller's vocabulary: what ``ControllerFSM`` (in ``controller.py``) reads and returns.

Its states and events, ``TRANSITIONS`` (the table of every allowed (state, event) -> states), the
actions the I/O shell executes (``SendCommand``, ``Evict``, ``StartGeneration``, ``RecordEvent``),
``ControllerPolicy``, ``Fault``, the learned stall timeouts (``SectionTimeouts``) and the stall
analysis over the ranks' flight records (``FlightRecord``, ``stall_suspects``). Pure values and
functions, no I/O; ``controller.py`` re-exports every public name, so imports from there still work.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megascale.config import FaultToleranceConfig
from megascale.config_validate import fault_tolerance_problems
from megascale.parallel.layout import Layout
from megascale.robustness.keys import make_command
from megascale.robustness.neighbours import NeighbourTest

if TYPE_CHECKING:
    from megascale.messages_job import Command


class State(enum.Enum):
    INIT = "init"
    WAITING_FOR_NODES = "waiting_for_nodes"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    DIAGNOSING = "diagnosing"
    RESTARTING = "restarting"
    FINISHED = "finished"
    FAILED = "failed"


class Event(enum.Enum):
    START = "start"
    NODE_REGISTERED = "node_registered"
    NODE_LOST = "node_lost"
    HEARTBEAT = "heartbeat"
    WORKER_EXIT = "worker_exit"
    ERROR_KEYWORD = "error_keyword"
    STALL_DETECTED = "stall_detected"
    ACK = "ack"
    ALL_STOPPED = "all_stopped"
    SELFCHECK_RESULT = "selfcheck_result"
    GENERATION_STARTED = "generation_started"
    TRAINING_FINISHED = "training_finished"
    STRAGGLER = "straggler"
    TICK = "tick"


S, E = State, Event
# After a fault the stop / self-check / restart protocol may run through several states within one
# event (e.g. the last stop ack, with no node left to self-check, restarts at once).
_FAULT = frozenset({S.STOPPING, S.DIAGNOSING, S.STARTING, S.RESTARTING, S.FAILED})
_CHECKED = frozenset({S.DIAGNOSING, S.STARTING, S.RESTARTING, S.FAILED})
# (state, event) -> every state the machine may be in once the event is handled. A pair that is
# missing is an illegal transition; observations (below) default to "stay" in every state.
TRANSITIONS: dict[tuple[State, Event], frozenset[State]] = {
    (S.INIT, E.START): frozenset({S.WAITING_FOR_NODES, S.STARTING}),
    (S.WAITING_FOR_NODES, E.NODE_REGISTERED): frozenset({S.WAITING_FOR_NODES, S.STARTING}),
    (S.WAITING_FOR_NODES, E.TICK): frozenset({S.WAITING_FOR_NODES, S.FAILED}),
    (S.STARTING, E.GENERATION_STARTED): frozenset({S.RUNNING}),
    (S.STARTING, E.ACK): _FAULT | {S.RUNNING},
    (S.STARTING, E.TRAINING_FINISHED): frozenset({S.FINISHED}),
    (S.RUNNING, E.TRAINING_FINISHED): frozenset({S.FINISHED}),
    (S.RUNNING, E.STRAGGLER): _FAULT | {S.RUNNING},
    **{
        (state, event): _FAULT | {state, S.FINISHED}
        for state in (S.STARTING, S.RUNNING)
        for event in (E.NODE_LOST, E.WORKER_EXIT, E.ERROR_KEYWORD, E.STALL_DETECTED, E.TICK)
    },
    **{(S.STOPPING, event): _FAULT for event in (E.ACK, E.NODE_LOST, E.TICK)},
    (S.STOPPING, E.ALL_STOPPED): _FAULT - {S.STOPPING},
    **{(S.DIAGNOSING, event): _CHECKED for event in (E.ACK, E.NODE_LOST, E.TICK)},
    (S.DIAGNOSING, E.SELFCHECK_RESULT): _CHECKED,
    (S.RESTARTING, E.NODE_REGISTERED): frozenset({S.RESTARTING, S.STARTING}),
    (S.RESTARTING, E.TICK): frozenset({S.RESTARTING, S.FAILED}),
    (S.FINISHED, E.TRAINING_FINISHED): frozenset({S.FINISHED}),
    **{
        (state, E.STALL_DETECTED): frozenset({state})
        for state in (S.STOPPING, S.DIAGNOSING, S.RESTARTING)
    },
}
OBSERVATIONS = (
    E.NODE_REGISTERED,
    E.NODE_LOST,
    E.HEARTBEAT,
    E.WORKER_EXIT,
    E.ERROR_KEYWORD,
    E.ACK,
    E.STRAGGLER,
    E.TICK,
)
for _state in State:
    for _event in OBSERVATIONS:
        TRANSITIONS.setdefault((_state, _event), frozenset({_state}))


class IllegalTransition(RuntimeError):
    """An event arrived in a state that does not allow it (a bug in the caller or the table)."""


# -- actions (what the shell executes, in order) ------------------------------------------------


@dataclass(frozen=True)
class SendCommand:
    """Write ``commands/<node>``; the agent acks ``id`` under ``acks/<node>``."""

    node: str
    kind: str  # "stop" | "selfcheck" | "start"
    generation: int
    id: str
    rank_assignment: Mapping[str, Any] | None = None
    neighbours: tuple[NeighbourTest, ...] = ()
    """``selfcheck``: the neighbour all-reduces the node runs (``robustness.neighbours``)."""

    def message(self, job_id: str) -> Command:
        """The ``commands/<node>`` message (see ``keys.make_command``)."""
        neighbours = [n.to_json() for n in self.neighbours]
        return make_command(
            job_id, self.generation, self.kind, self.id, self.rank_assignment, neighbours
        )


@dataclass(frozen=True)
class Evict:
    """Put the node on the blocklist (``blocklist/<node>``); it is never used again."""

    node: str
    reason: str


@dataclass(frozen=True)
class StartGeneration:
    """Record generation ``generation`` and its assignment (node -> global ranks) under
    ``generation``, before its start commands."""

    generation: int
    assignment: Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class RecordEvent:
    """Append to the event log (``EventLog.record``)."""

    kind: str
    generation: int
    node: str | None = None
    rank: int | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)


Action = SendCommand | Evict | StartGeneration | RecordEvent


# -- policy -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ControllerPolicy:
    """What the controller aims for and how patient it is."""

    nodes: int
    """Nodes per generation (M); registered nodes beyond M are spares."""
    nproc_per_node: int
    """Worker processes (ranks) per node (K)."""
    tp: int = 1
    """Tensor-parallel size, to name ranks as (dp, pp, tp)."""
    pp: int = 1
    """Pipeline-parallel size."""
    max_restarts: int = FaultToleranceConfig.max_restarts
    """Generations started after a fault within any ``restart_window_s``, at most; the fault that
    would exceed it fails the job."""
    restart_window_s: float | None = FaultToleranceConfig.restart_window_s
    """The sliding window ``max_restarts`` counts in (seconds); None: the whole run."""
    node_loss_policy: str = FaultToleranceConfig.policy
    """A node lost or evicted with no spare to take its slot: ``"wait"`` for one to register (up
    to ``node_wait_timeout_s``), ``"shrink"`` to the largest data-parallel size the nodes left
    allow (``controller_elastic.shrink_nodes``), or ``"fail"`` the job."""
    global_batch_size: int | None = None
    """``train.global_batch_size``: a shrink keeps it, so the data-parallel size must split it
    into whole micro-batches; None: any data-parallel size is accepted."""
    micro_batch_size: int = 1
    """``train.micro_batch_size``."""
    vpp: int = 1
    """``parallel.vpp`` (interleaving needs the micro-batches per rank divisible by pp)."""
    heartbeat_timeout_s: float = 10.0
    """An active node silent this long is faulty (its lease may still be alive)."""
    init_timeout_s: float = 600.0
    """Longest a generation may take to make its first step of progress (start-up, restore)."""
    step_timeout_s: float = 300.0
    """Stall timeout between steps until ``stall_min_samples`` gaps have been observed."""
    checkpoint_timeout_s: float = 600.0
    """Stall timeout in a checkpoint section until enough checkpoints have been observed."""
    stall_floor_s: float = 10.0
    """Learned timeouts are never below this (progress is seen at heartbeat granularity)."""
    stall_safety_factor: float = 4.0
    """Learned timeout = factor x the longest recent observed duration."""
    stall_min_samples: int = 3
    """Observations needed before a section's timeout is learned rather than the default."""
    start_timeout_s: float = 120.0
    """Every node must ack a start command within this."""
    stop_timeout_s: float = 30.0
    """Every node must ack a stop command within this, or it is evicted."""
    selfcheck_timeout_s: float = FaultToleranceConfig.selfcheck_timeout_s
    """Every node must report its self-check within this, or it is evicted."""
    node_wait_timeout_s: float | None = FaultToleranceConfig.node_wait_timeout_s
    """Longest to wait for enough (replacement) nodes before failing; None waits forever."""
    evict_repeat_culprit: int = FaultToleranceConfig.evict_repeat_culprit
    """A node named culprit in this many faults is evicted even if its self-check passes."""

    def __post_init__(self) -> None:
        for name in (
            "nodes",
            "nproc_per_node",
            "tp",
            "pp",
            "stall_min_samples",
            "evict_repeat_culprit",
            "micro_batch_size",
            "vpp",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ControllerPolicy.{name} = {value!r}: must be an integer >= 1")
        problems = fault_tolerance_problems(
            self.node_loss_policy,
            self.max_restarts,
            self.restart_window_s,
            self.node_wait_timeout_s,
            "ControllerPolicy.",
            "node_loss_policy",
        )
        if problems:
            raise ValueError("; ".join(problems))
        self.layout  # noqa: B018  (validates that tp * pp divides the world size)

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def layout(self) -> Layout:
        return Layout.from_world(self.world_size, tp=self.tp, pp=self.pp)


# -- stall analysis -------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlightRecord:
    """A rank's flight-recorder state: the last collective it entered and whether it left it."""

    seq: int
    """Sequence number of that collective within ``group`` (every member counts the same calls)."""
    kind: str
    """e.g. "all_reduce", "reduce_scatter", "send"."""
    left: bool
    """Whether the rank has left (completed) it."""
    group: tuple[int, ...] | None = None
    """Global ranks of the process group; None when one sequence spans all ranks."""

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FlightRecord:
        group = d.get("group")
        return cls(
            int(d["seq"]),
            str(d.get("kind", "")),
            bool(d.get("left", False)),
            tuple(int(r) for r in group) if group is not None else None,
        )


def stall_suspects(records: Mapping[int, FlightRecord], *, ranks: Iterable[int] = ()) -> list[int]:
    """The ranks that never entered the collective the others wait in.

    The awaited collective is the (group, seq) in which most ranks wait (have entered, not left),
    ties going to the higher seq. Its participants are ``group`` (or, for group None, every rank in
    ``records`` and ``ranks``); a participant is a suspect if its last record is an older seq,
    another group, or missing (its recorder could not be read). [] when no rank waits.
    """
    waiting = Counter((rec.group, rec.seq) for rec in records.values() if not rec.left)
    if not waiting:
        return []
    (group, seq), _ = max(waiting.items(), key=lambda item: (item[1], item[0][1]))
    participants = set(group) if group is not None else set(records) | set(ranks)
    return sorted(
        r
        for r in participants
        if (rec := records.get(r)) is None or rec.group != group or rec.seq < seq
    )


class SectionTimeouts:
    """Per-section stall timeouts learned from observed durations (STYLE.md #9): ``factor`` x the
    longest of the last ``window`` observations, at least ``floor``; the section's default until
    ``min_samples`` observations exist."""

    def __init__(
        self,
        defaults: Mapping[str, float],
        floor: float,
        factor: float,
        min_samples: int,
        window: int = 32,
    ) -> None:
        self.defaults, self.floor, self.factor = dict(defaults), floor, factor
        self.min_samples, self.window = min_samples, window
        self.samples: dict[str, deque[float]] = {s: deque(maxlen=window) for s in defaults}

    def observe(self, section: str, seconds: float) -> None:
        self.samples[section].append(seconds)

    def timeout(self, section: str) -> float:
        samples = self.samples[section]
        if len(samples) < self.min_samples:
            return self.defaults[section]
        return max(self.floor, self.factor * max(samples))


@dataclass(frozen=True)
class Fault:
    """A detected fault: its kind, where, and the ranks suspected (stalls)."""

    kind: str
    node: str | None = None
    rank: int | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)
    suspects: tuple[int, ...] = ()
    blames_nodes: bool = True
    """Whether its node and suspects' nodes count as culprits (``evict_repeat_culprit``); False
    for a fault of the program (a mismatched collective), which would follow it to any node."""


def mismatch_signature(culprits: Iterable[Mapping[str, Any]]) -> str | None:
    """The signature of a stall whose culprits (a ``stall`` event's ``culprits``) are all
    mismatched collectives: what each odd rank issued, where; None for any other stall."""
    culprits = list(culprits)
    if not culprits or any(c.get("reason") != "mismatch" for c in culprits):
        return None
    odd = "; ".join(
        sorted(f"rank {c.get('rank')} issued {c.get('op')} on {c.get('group')}" for c in culprits)
    )
    return f"mismatched collective: {odd} while its group's other members issued another"
