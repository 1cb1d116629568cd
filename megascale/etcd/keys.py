"""The etcd key schema of one job, and the command message agents act on.

Every key of a job lives under ``/megascale/<job_id>/``, so jobs sharing an etcd never see each
other's keys (a watch or a prefix read on ``JobKeys(job).prefix`` is the whole job). ``<node>`` is
the agent's node name, ``<seq>`` a zero-padded decimal so that key order is numeric order.

==============================  ========  ======================  ==================================
key (under /megascale/<job>/)   lease     written by              value (JSON)
==============================  ========  ======================  ==================================
``nodes/<node>``                agent's   agent, at registration  ``{"node", "host", "nproc",
                                          (created only while     "pid", "hardware": {...},
                                          absent: one agent per   "registered_at", "config_hash",
                                          name)                   "instance", ...}``
``heartbeats/<node>``           agent's   agent, every interval   ``messages.Heartbeat``
``commands/<node>``             --        controller (fenced)     ``messages.Command``
                                                                  (``make_command`` below)
``acks/<node>``                 --        agent                   ``messages.Ack``: the command
                                                                  ``id`` it finished
``blocklist/<node>``            --        controller (fenced)     ``messages.BlockedNode``:
                                                                  never used again
``controller/leader``           leader's  ``Election``            ``{"id", "host", "pid",
                                                                  "since"}``
``state``                       --        controller (fenced)     ``messages.ControllerState``
                                                                  (``ControllerFSM.snapshot()``):
                                                                  for a standby and the operator
``status``                      --        controller (fenced)     ``messages.ControllerStatus``:
                                                                  a few bytes, what agents watch
``summary``                     --        controller (fenced)     the job's figures for the
                                                                  operator and dashboards:
                                                                  ``messages.JobSummaryRecord``
                                                                  (``job_summary.py``)
``events/<seq>``                --        ``EventLog``            ``messages.Event``
``generation``                  --        controller (fenced)     ``messages.GenerationRecord``
==============================  ========  ======================  ==================================

``state`` is O(nodes) bytes and changes with every decision; agents watch ``status`` instead, so a
decision costs every agent a few bytes of watch traffic, not the whole snapshot.

"Leased" keys vanish when their writer stops renewing its lease: a node whose ``nodes/<node>``
key is deleted is lost. "Fenced" writes are transactions guarded by the leader key's create
revision (``Election.guard``), so a deposed controller cannot write.

Every value but ``nodes/<node>`` and ``controller/leader`` is a typed message of
``megascale.messages``: its fields are declared there once, and each value carries its schema
version; readers decode it (``X.decode(kv.json())``) and read attributes.

A command (controller -> agent) is acted on only if ``is_current(command, job_id, generation)``:
it is for this job and not for a generation older than the agent's. ``kind`` is ``"stop"`` (stop
the workers of ``generation``), ``"selfcheck"`` (run the node self-check, ack with its result) or
``"start"`` (start workers of ``generation`` with ``rank_assignment``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megascale.messages.job import COMMAND_KINDS, Command, NeighbourEntry, RankAssignment

ROOT = "/megascale"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # whole string: ``fullmatch``


def check_name(what: str, value: str) -> str:
    """``value`` if it is a valid job id or node name (no ``/``), else ValueError naming it."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        shown = (
            repr(value)
            if len(repr(value)) <= 80
            else f"{repr(value)[:60]}... ({len(value)} characters)"
        )
        raise ValueError(
            f"{what} = {shown}: must be 1-128 characters of letters, digits, '.', '_', '-', "
            "starting with a letter or digit"
        )
    return value


@dataclass(frozen=True)
class JobKeys:
    """The keys of one job (see the module docstring for what each holds)."""

    job_id: str

    def __post_init__(self) -> None:
        check_name("job_id", self.job_id)

    @property
    def prefix(self) -> str:
        return f"{ROOT}/{self.job_id}/"

    # prefixes, for get_prefix / watch_prefix
    @property
    def nodes_prefix(self) -> str:
        return self.prefix + "nodes/"

    @property
    def heartbeats_prefix(self) -> str:
        return self.prefix + "heartbeats/"

    @property
    def commands_prefix(self) -> str:
        return self.prefix + "commands/"

    @property
    def acks_prefix(self) -> str:
        return self.prefix + "acks/"

    @property
    def blocklist_prefix(self) -> str:
        return self.prefix + "blocklist/"

    @property
    def events_prefix(self) -> str:
        return self.prefix + "events/"

    # single keys
    def node(self, node: str) -> str:
        return self.nodes_prefix + check_name("node", node)

    def heartbeat(self, node: str) -> str:
        return self.heartbeats_prefix + check_name("node", node)

    def command(self, node: str) -> str:
        return self.commands_prefix + check_name("node", node)

    def ack(self, node: str) -> str:
        return self.acks_prefix + check_name("node", node)

    def blocked(self, node: str) -> str:
        return self.blocklist_prefix + check_name("node", node)

    def event(self, seq: int) -> str:
        if seq < 0:
            raise ValueError(f"event seq = {seq}: must be >= 0")
        return f"{self.events_prefix}{seq:012d}"

    @property
    def controller_leader(self) -> str:
        return self.prefix + "controller/leader"

    @property
    def state(self) -> str:
        return self.prefix + "state"

    @property
    def status(self) -> str:
        return self.prefix + "status"

    @property
    def generation(self) -> str:
        return self.prefix + "generation"

    @property
    def summary(self) -> str:
        return self.prefix + "summary"

    def name_of(self, key: str) -> str:
        """The last component of ``key`` (the node of ``nodes/<node>``, ``acks/<node>``, ...);
        ValueError for a key outside this job."""
        if not key.startswith(self.prefix):
            raise ValueError(f"key {key!r} is not under job prefix {self.prefix!r}")
        return key.rsplit("/", 1)[-1]

    def seq_of(self, key: str) -> int:
        """The sequence number of an ``events/<seq>`` key."""
        if not key.startswith(self.events_prefix):
            raise ValueError(f"key {key!r} is not an event key of job {self.job_id!r}")
        return int(key[len(self.events_prefix) :])


def make_command(
    job_id: str,
    generation: int,
    kind: str,
    command_id: str,
    rank_assignment: Mapping[str, Any] | None = None,
    neighbours: Sequence[Mapping[str, Any]] = (),
    pause_wait_s: float | None = None,
) -> Command:
    """The ``commands/<node>`` message (``messages.Command``).

    ``neighbours`` (``selfcheck`` only, may be absent): ``[{"node": N, "channel": C}, ...]``, the
    nodes to all-reduce with and on which port offset (``megascale.controller.neighbours``).

    ``rank_assignment`` (``start`` only): ``{"ranks": [global rank of local rank 0, 1, ...],
    "world_size": W, "master_node": node of rank 0}`` (each node gets only its own ranks, so
    a generation start writes O(N) bytes, not O(N^2)).
    """
    if kind not in COMMAND_KINDS:
        raise ValueError(f"command kind = {kind!r}: must be one of {COMMAND_KINDS}")
    if kind == "start" and not rank_assignment:
        raise ValueError("a 'start' command needs a rank_assignment")
    return Command(
        job=check_name("job_id", job_id),
        generation=int(generation),
        kind=kind,
        id=command_id,
        rank_assignment=None
        if rank_assignment is None
        else RankAssignment(
            ranks=[int(r) for r in rank_assignment["ranks"]],
            world_size=int(rank_assignment["world_size"]),
            master_node=str(rank_assignment["master_node"]),
        ),
        neighbours=[NeighbourEntry(str(n["node"]), int(n["channel"])) for n in neighbours],
        pause_wait_s=None if pause_wait_s is None else float(pause_wait_s),
    )


def is_current(command: Command, job_id: str, generation: int) -> bool:
    """Whether an agent of ``job_id`` at ``generation`` must act on ``command``: it is for this
    job, of a known kind, and not for an older generation."""
    return (
        command.job == job_id and command.kind in COMMAND_KINDS and command.generation >= generation
    )
