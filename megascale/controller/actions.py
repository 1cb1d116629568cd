"""What the controller decides: the actions ``ControllerFSM`` returns for its I/O shell to
execute in order (``SendCommand``, ``Evict``, ``StartGeneration``, ``RecordEvent``), and the
``Fault`` it acts on. Pure values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megascale.controller.neighbours import NeighbourTest
from megascale.etcd.keys import make_command

if TYPE_CHECKING:
    from megascale.messages.job import Command


BLOCKING_FAULTS = ("node_lost", "heartbeat_timeout", "stall")
"""Faults after which ranks are likely blocked in a collective that cannot complete: a peer
is gone or silent, or no rank has progressed for the section's timeout."""
BLOCKED_PAUSE_WAIT_S = 1.0
"""The pause wait after one of them (``SendCommand.pause_wait_s``): a rank between collectives
pauses within one operation; a blocked one never does."""


@dataclass(frozen=True)
class SendCommand:
    """Write ``commands/<node>``; the agent acks ``id`` under ``acks/<node>``."""

    node: str
    kind: str  # "stop" | "selfcheck" | "start"
    generation: int
    id: str
    rank_assignment: Mapping[str, Any] | None = None
    neighbours: tuple[NeighbourTest, ...] = ()
    """``selfcheck``: the neighbour all-reduces the node runs (``controller.neighbours``)."""
    pause_wait_s: float | None = None
    """``stop``: the pause wait's bound (``messages.Command.pause_wait_s``)."""

    def message(self, job_id: str) -> Command:
        """The ``commands/<node>`` message (see ``keys.make_command``)."""
        neighbours = [n.to_json() for n in self.neighbours]
        return make_command(
            job_id,
            self.generation,
            self.kind,
            self.id,
            self.rank_assignment,
            neighbours,
            self.pause_wait_s,
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
