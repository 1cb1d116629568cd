"""The robust-training controller's decisions: a pure state machine (no I/O, no clock, no sleeps).

The I/O shell (the ``megascale controller`` process) turns what it sees in etcd into events, calls
one ``on_*`` method per event with the current time, and executes the returned actions in order::

    fsm = ControllerFSM(ControllerPolicy(nodes=2, nproc_per_node=4, tp=2))
    for action in fsm.on_start(now=clock()):
        shell.execute(action)      # SendCommand -> commands/<node>, Evict -> blocklist/<node>,
                                   # StartGeneration -> generation, RecordEvent -> EventLog

Lifecycle (``TRANSITIONS`` is the table of every allowed (state, event) -> states; it lives in
``controller/states.py``; the actions in ``controller/actions.py``, the policy in
``controller/policy.py``, the stall analysis in ``stall_analysis.py``)::

    INIT -start-> WAITING_FOR_NODES -enough nodes-> STARTING -all started-> RUNNING
    RUNNING -fault-> STOPPING -all stopped-> DIAGNOSING -all checked-> STARTING (generation G+1)
                                                          \\-too few healthy nodes-> RESTARTING
    RESTARTING -replacement registered-> STARTING;  RUNNING -training done-> FINISHED
    STOPPING -restart budget spent, or a job-fatal exit-> FAILED
    DIAGNOSING -too few healthy nodes, policy "fail"-> FAILED
    WAITING/RESTARTING -node_wait_timeout_s-> FAILED

Faults: a worker exiting non-zero, an error keyword, an active node lost (lease expiry) or silent
(no heartbeat for ``heartbeat_timeout_s``), a generation not started within ``start_timeout_s``,
and a stall: the highest step reported stops advancing for longer than the current section's
timeout (``SectionTimeouts``: learned from observed gaps between progress x a safety factor, with
a floor). A stall names its suspects with ``stall_suspects`` over the ranks' flight records.
A worker exiting 0 is not a fault; when every rank has, training is finished.
A persistent straggler (``on_straggler``, when the policy is to evict them) is a fault too when a
spare can take its slot: the slow node is evicted once every node has stopped.

On a fault: stop every active node; self-check every live node; evict (blocklist) nodes that fail
it, do not answer in time, or were named culprit in ``evict_repeat_culprit`` faults; fill the
slots of missing nodes with spares (registered nodes beyond ``nodes``, in registration order),
keeping every other node in its slot so that each rank stays where it was; start generation G+1
from the latest checkpoint. Node i of a generation runs ranks ``i*K .. i*K+K-1`` (tensor-parallel
groups are adjacent ranks, so they stay within a node).

Too few healthy nodes and no spare (``policy.node_loss_policy``): ``wait`` for a node to register
(RESTARTING, up to ``node_wait_timeout_s``); ``shrink``: start at once on the healthy nodes, as
many as give whole model-parallel replicas and split the global batch (``shrink_nodes``); ``fail``.
A shrunk job takes spares up to its configured size at its next restart (no restart is forced
for it: a proactive one would throw away the steps since the last complete checkpoint). Each
decision is an ``elastic`` event whose ``text`` says what and why. Restarts are budgeted:
``max_restarts`` within any ``restart_window_s`` (``RestartBudget``). A worker exiting with
``EXIT_JOB_FATAL`` (``probes.fatal``) stops every node and fails the job with the rank's
reason, evicting and restarting nothing; so does an uncaught exception that would follow the job
to any node (its signature ended every rank, or came back after a restart). Only node-local
evidence (a lost lease, a failed self-check, a device error, a stall's culprit) evicts. A stall
held up only by mismatched collectives (``mismatch_signature``) is the program's bug: it blames
no node; the same mismatch after a restart fails the job as a repeated exception does.

Protocol events (``on_start``, ``on_all_stopped``, ``on_selfcheck_result``,
``on_generation_started``, ``on_training_finished``, ``on_stall_detected``) in a state that does
not expect them raise ``IllegalTransition``; observations (heartbeats, acks, node and worker
events, ticks) are accepted in every state and ignored where they do not matter. Acks whose
command id is not awaited are stale and ignored.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from megascale.controller import snapshot as controller_snapshot
from megascale.controller.actions import (  # noqa: F401  (every name re-exported)
    BLOCKED_PAUSE_WAIT_S,
    BLOCKING_FAULTS,
    Action,
    Evict,
    Fault,
    RecordEvent,
    SendCommand,
    StartGeneration,
)
from megascale.controller.elastic import RestartBudget
from megascale.controller.job_faults import storage_full_fault, worker_exit_fault
from megascale.controller.neighbours import NeighbourTest, plan_neighbour_tests
from megascale.controller.policy import ControllerPolicy
from megascale.controller.recovery import RecoveryProtocol
from megascale.controller.stall_analysis import (
    SectionTimeouts,
    flight_suspects,
    mismatch_signature,
    place_culprit,
)
from megascale.controller.states import (
    OBSERVATIONS,  # noqa: F401  (re-exported: controller/fsm.py offers every controller name)
    TRANSITIONS,
    Event,
    IllegalTransition,
    State,
)
from megascale.messages import Heartbeat
from megascale.parallel.layout import Layout

S, E = State, Event


# -- the state machine -------------------------------------------------------------------------


class ControllerFSM(RecoveryProtocol):
    """The controller's decisions (see the module docstring). Every ``on_*`` method takes the
    current time as ``now`` (seconds, any monotonic origin) and returns the actions to execute."""

    def __init__(self, policy: ControllerPolicy, now: float = 0.0) -> None:
        self.policy = policy
        self.state = State.INIT
        self.now = now
        self.generation = 0
        self.registered: dict[str, None] = {}  # live, not evicted, in registration order
        self.blocklist: dict[str, str] = {}  # node -> reason
        self.order = []  # the current generation's nodes; slot i runs ranks i*K..
        self.awaiting: dict[str, str] = {}  # node -> id of the command it has not acked
        self.awaiting_kind: str | None = None
        self.phase_since = now  # when the current state was entered
        self.fault: Fault | None = None
        self.faults: list[Fault] = []
        self.culprits: Counter[str] = Counter()
        self.suspected: dict[str, set[str]] = {}  # node -> neighbours its self-check suspects
        self.counted: dict[str, int] = {}  # node -> the generation it was last counted culprit in
        self.budget = RestartBudget(policy.max_restarts, policy.restart_window_s)
        self.failure: str | None = None  # why the job failed, once it has
        self.error_signatures: dict[str, int] = {}  # exception signature -> generation first seen
        self.timeouts = SectionTimeouts(
            {
                "init": policy.init_timeout_s,
                "step": policy.step_timeout_s,
                "checkpoint": policy.checkpoint_timeout_s,
            },
            policy.stall_floor_s,
            policy.stall_safety_factor,
            policy.stall_min_samples,
        )
        self._commands = 0
        self.topology: dict[str, str | None] = {}  # node -> its switch/rack label, if any
        # node -> its neighbour all-reduces in the self-check being awaited (not in the snapshot:
        # a successor re-sends pending self-checks without them rather than with a plan whose
        # partners may already have answered).
        self._neighbours: dict[str, list[NeighbourTest]] = {}
        self._reset_generation_tracking()

    @property
    def order(self) -> list[str]:
        """The current generation's nodes; slot i runs ranks i*K.. (assign, never mutate)."""
        return self._order

    @order.setter
    def order(self, nodes: Iterable[str]) -> None:
        self._order: list[str] = list(nodes)
        self._in_order: frozenset[str] = frozenset(self._order)  # O(1) membership
        p = self.policy
        size = len(self._order) or p.nodes  # fewer than p.nodes once shrunk
        self._layout = Layout.from_world(size * p.nproc_per_node, tp=p.tp, pp=p.pp)

    @property
    def layout(self) -> Layout:
        """The current generation's layout (the configured one before the first start)."""
        return self._layout

    @property
    def world_size(self) -> int:
        """Ranks of the current generation: fewer than ``policy.world_size`` once shrunk."""
        return self._layout.world_size

    def in_order(self, node: str) -> bool:
        """Whether ``node`` is in the current generation (O(1), unlike ``node in order``)."""
        return node in self._in_order

    def _reset_generation_tracking(self) -> None:
        self.step: int | None = None  # highest step reported in this generation
        self.step_at = self.now  # when it was first seen
        self.stepped = False  # whether the step advanced in this generation (init is over)
        self.sections: dict[str, str] = {}  # node -> section; only on_heartbeat changes it
        self._section_nodes: Counter[str] = Counter()  # section -> nodes in it (O(1) queries)
        self.checkpoint_since: float | None = None
        self.last_seen: dict[str, float] = {n: self.now for n in self.order}
        self.flight: dict[int, Mapping[str, Any]] = {}  # rank -> its last flight record, as sent
        self.clean_exits: set[int] = set()

    # -- queries -------------------------------------------------------------------------------

    @property
    def restarts(self) -> int:
        return max(self.generation - 1, 0)

    @property
    def spares(self) -> list[str]:
        return [n for n in self.registered if n not in self._in_order]

    @property
    def assignment(self) -> dict[str, tuple[int, ...]]:
        k = self.policy.nproc_per_node
        return {node: tuple(range(i * k, (i + 1) * k)) for i, node in enumerate(self.order)}

    def node_of(self, rank: int) -> str | None:
        i = rank // self.policy.nproc_per_node
        return self.order[i] if 0 <= rank < self.world_size and i < len(self.order) else None

    def section(self) -> str:
        """What the job is doing: "init" until its step first advances, "checkpoint" while any
        node says so, else "step"."""
        if not self.stepped or self._section_nodes["init"]:
            return "init"
        return "checkpoint" if self._section_nodes["checkpoint"] else "step"

    def stall_timeout(self) -> float:
        return self.timeouts.timeout(self.section())

    def snapshot(self) -> dict[str, Any]:
        """Everything a standby controller needs to continue, as JSON (mirrored to ``state``;
        the format is ``controller_snapshot.snapshot``)."""
        return controller_snapshot.snapshot(self)

    @classmethod
    def restore(
        cls, policy: ControllerPolicy, snapshot: Mapping[str, Any], now: float
    ) -> ControllerFSM:
        """A controller continuing from ``snapshot()`` (a standby taking over). Its timers start
        at ``now``: every node gets a fresh heartbeat allowance and the step a fresh timeout."""
        fsm = cls(policy, now)
        controller_snapshot.restore(fsm, snapshot, now)
        return fsm

    def extend_deadlines(self, seconds: float) -> None:
        """The controller itself was away ``seconds`` (starved of CPU, blocked on etcd): every
        deadline it keeps moves on by as much, so its own absence is never read as a node's
        silence, a stall, a late ack or a replacement that did not come. No state changes."""
        self.phase_since += seconds
        self.step_at += seconds
        self.last_seen = {n: t + seconds for n, t in self.last_seen.items()}
        if self.checkpoint_since is not None:
            self.checkpoint_since += seconds

    # -- transitions ---------------------------------------------------------------------------

    def _begin(self, event: Event, now: float | None) -> None:
        if (self.state, event) not in TRANSITIONS:
            allowed = sorted(e.value for (s, e) in TRANSITIONS if s is self.state)
            raise IllegalTransition(
                f"event {event.value!r} is not allowed in state {self.state.value!r} "
                f"(generation {self.generation}); allowed there: {', '.join(allowed)}"
            )
        self._event, self._origin = event, self.state
        if now is not None:
            self.now = now

    def _enter(self, state: State) -> None:
        allowed = TRANSITIONS[(self._origin, self._event)]
        if state not in allowed:
            raise IllegalTransition(
                f"{self._origin.value} -> {state.value} on event {self._event.value!r} is not in "
                f"the transition table (allowed: {sorted(s.value for s in allowed)})"
            )
        if state is not self.state:
            self.state, self.phase_since = state, self.now

    def _record(
        self, kind: str, node: str | None = None, rank: int | None = None, **detail: Any
    ) -> RecordEvent:
        return RecordEvent(kind, self.generation, node, rank, detail)

    def _fail(
        self, reason: str, node: str | None = None, rank: int | None = None, **detail: Any
    ) -> RecordEvent:
        """Enter FAILED for ``reason`` (kept in ``failure``, the snapshot's and the operator's
        status message); the ``failed`` event to record."""
        self._enter(S.FAILED)
        self.failure = reason
        return self._record("failed", node, rank, reason=reason, **detail)

    def _send(
        self, nodes: Iterable[str], kind: str, generation: int, pause_wait_s: float | None = None
    ) -> list[Action]:
        actions: list[Action] = []
        nodes = list(nodes)
        self._neighbours = {}
        if kind == "selfcheck" and len(nodes) > 1:
            # MegaScale's neighbour all-reduce: each node with two neighbours under its switch.
            self._neighbours = plan_neighbour_tests(nodes, self.topology)
            plan = {n: [t.node for t in tests] for n, tests in self._neighbours.items()}
            actions.append(self._record("neighbours", plan=plan, topology=dict(self.topology)))
        self.awaiting, self.awaiting_kind = {}, kind
        assignment = self.assignment
        for node in nodes:
            self._commands += 1
            command_id = f"g{generation}-{kind}-{self._commands}"
            self.awaiting[node] = command_id
            actions.append(
                self._command(node, kind, generation, command_id, assignment, pause_wait_s)
            )
        return actions

    def _command(
        self, node: str, kind: str, generation: int, command_id: str, assignment: Mapping, wait=None
    ) -> SendCommand:
        ranks = None
        if kind == "start":
            ranks = {
                "ranks": list(assignment[node]),
                "world_size": self.world_size,
                "master_node": self.order[0],
            }
        neighbours = tuple(self._neighbours.get(node, ())) if kind == "selfcheck" else ()
        return SendCommand(node, kind, generation, command_id, ranks, neighbours, wait)

    def pending_commands(self) -> list[Action]:
        """The commands still awaited, as sent (same ids): a controller taking over sends them
        again, since its predecessor may have died before writing all of them. Agents run a
        command id once, so a command that did arrive is not run twice."""
        kind = self.awaiting_kind
        if kind is None:
            return []
        assignment = self.assignment
        return [
            self._command(node, kind, self.generation, command_id, assignment)
            for node, command_id in self.awaiting.items()
        ]

    # -- events: nodes -------------------------------------------------------------------------

    def on_start(self, now: float | None = None) -> list[Action]:
        """The shell became leader and loaded the registered nodes: begin."""
        self._begin(E.START, now)
        self._enter(S.WAITING_FOR_NODES)
        actions: list[Action] = [
            self._record(
                "controller_start",
                nodes=self.policy.nodes,
                nproc_per_node=self.policy.nproc_per_node,
            )
        ]
        started = self._try_start()
        if not started:
            return actions + [
                self._record("waiting_for_nodes", need=self.policy.nodes, have=len(self.registered))
            ]
        return actions + started

    def on_node_registered(
        self, node: str, now: float | None = None, topology: str | None = None
    ) -> list[Action]:
        """``nodes/<node>`` appeared (an agent registered), under switch/rack label ``topology``."""
        self._begin(E.NODE_REGISTERED, now)
        self.topology[node] = topology
        if node in self.blocklist:
            return [self._record("node_rejected", node, reason=self.blocklist[node])]
        if node in self.registered:
            return []
        self.registered[node] = None
        actions: list[Action] = [self._record("node_registered", node)]
        if self.state in (S.WAITING_FOR_NODES, S.RESTARTING):
            actions += self._try_start()
        return actions

    def on_node_lost(
        self, node: str, reason: str = "lease expired", now: float | None = None
    ) -> list[Action]:
        """``nodes/<node>`` was deleted (its agent's lease expired) or the node went silent."""
        self._begin(E.NODE_LOST, now)
        if node not in self.registered:
            return []
        del self.registered[node]
        if self.state in (S.STARTING, S.RUNNING) and node in self._in_order:
            return self._on_fault(Fault("node_lost", node, detail={"reason": reason}))
        actions: list[Action] = [self._record("node_lost", node, reason=reason)]
        if node in self.awaiting:
            del self.awaiting[node]
            actions += self._maybe_phase_done()
        return actions

    def on_heartbeat(self, node: str, payload: Heartbeat, now: float) -> list[Action]:
        """``heartbeats/<node>`` changed (``messages.Heartbeat``)."""
        self._begin(E.HEARTBEAT, now)
        if node not in self._in_order or payload.generation != self.generation:
            return []
        self.last_seen[node] = now
        section = payload.section
        counts = self._section_nodes
        was_checkpointing = counts["checkpoint"] > 0
        previous = self.sections.get(node)
        if previous != section:
            if previous is not None:
                counts[previous] -= 1
            counts[section] += 1
            self.sections[node] = section
        if section == "checkpoint" and not was_checkpointing:
            self.checkpoint_since = now
        elif was_checkpointing and not counts["checkpoint"]:
            if self.checkpoint_since is not None:
                self.timeouts.observe("checkpoint", now - self.checkpoint_since)
            self.checkpoint_since = None
        for rank, record in payload.flight.items():
            self.flight[int(rank)] = record  # parsed only if a stall is declared
        step = payload.step
        if step is not None and (self.step is None or step > self.step):
            if self.step is not None:
                if self.stepped:  # the gap after init; the first one includes start-up
                    self.timeouts.observe("step", now - self.step_at)
                self.stepped = True
            self.step, self.step_at = int(step), now
        return []

    # -- events: faults ------------------------------------------------------------------------

    def on_worker_exit(
        self,
        node: str,
        rank: int,
        code: int,
        now: float | None = None,
        generation: int | None = None,
        fatal: str | None = None,
        error: Mapping[str, str] | None = None,
        everywhere: bool = False,
    ) -> list[Action]:
        """A worker process ended with ``code`` (negative: killed by signal -code).
        ``EXIT_JOB_FATAL`` (with the rank's ``fatal`` reason, see ``probes.fatal``) is a
        fault of the job itself: every node is stopped and the job fails, nobody is evicted.
        So is an uncaught exception (``error``: ``{"text", "signature"}``) that would follow the
        job to any node: the shell saw the same signature end every rank of the generation
        (``everywhere``), or it ended a rank of an earlier generation too."""
        self._begin(E.WORKER_EXIT, now)
        stale = generation is not None and generation != self.generation
        if stale or self.state not in (S.STARTING, S.RUNNING) or node not in self._in_order:
            return []
        if code != 0:
            fault = worker_exit_fault(
                node, rank, code, fatal=fatal, error=error, everywhere=everywhere,
                first_generation=self.error_signatures.get(error["signature"]) if error else None,
                generation=self.generation, world_size=self.world_size,
            )  # fmt: skip
            if fault.kind == "worker_exit" and error is not None:
                self.error_signatures.setdefault(error["signature"], self.generation)
            return self._on_fault(fault)
        self.clean_exits.add(rank)
        if len(self.clean_exits) < self.world_size:
            return [self._record("worker_exit_clean", node, rank)]
        self._enter(S.FINISHED)
        return [self._record("finished", step=self.step, reason="every rank exited 0")]

    def on_error_keyword(
        self, node: str, text: str, rank: int | None = None, now: float | None = None
    ) -> list[Action]:
        """The agent found an error keyword (CUDA error, NCCL error, segfault, OOM) in a worker's
        output."""
        self._begin(E.ERROR_KEYWORD, now)
        if self.state not in (S.STARTING, S.RUNNING) or node not in self._in_order:
            return []
        return self._on_fault(Fault("error_keyword", node, rank, {"text": text[:500]}))

    def on_storage_full(
        self, node: str, rank: int | None, text: str, now: float | None = None
    ) -> list[Action]:
        """A rank's storage is full (ENOSPC, a quota): the job's storage, not the node's fault
        (a spare writes to the same place). The job is stopped and fails with the cause; nobody
        is evicted."""
        self._begin(E.ERROR_KEYWORD, now)
        if self.state not in (S.STARTING, S.RUNNING) or node not in self._in_order:
            return []
        return self._on_fault(storage_full_fault(node, rank, text))

    def on_stall_detected(
        self,
        suspects: Iterable[int],
        now: float | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> list[Action]:
        """A stall found outside this machine (on_tick finds its own); ``suspects`` are ranks."""
        self._begin(E.STALL_DETECTED, now)
        if self.state not in (S.STARTING, S.RUNNING):
            return []
        return self._stall(tuple(sorted(suspects)), dict(detail or {}))

    def _stall_suspects(self) -> list[int]:
        return flight_suspects(self.flight, self.world_size)

    def _stall(self, suspects: tuple[int, ...], detail: dict[str, Any]) -> list[Action]:
        layout = self.layout
        nodes = sorted({n for r in suspects if (n := self.node_of(r)) is not None})
        detail.update(suspects=[layout.describe(r) for r in suspects], suspect_nodes=nodes)
        if detail.get("culprits"):
            detail["culprits"] = [
                place_culprit(c, self.layout, self.node_of) for c in detail["culprits"]
            ]
        node = nodes[0] if len(nodes) == 1 else None
        rank = suspects[0] if len(suspects) == 1 else None
        signature = mismatch_signature(detail.get("culprits") or (), detail.get("undecided") or ())
        if signature is None:
            return self._on_fault(Fault("stall", node, rank, detail, suspects))
        # A mismatched collective is the program's bug: no node is blamed. The first one may be a
        # one-off (a restart replays the steps from the checkpoint); the same again fails the job.
        first = self.error_signatures.setdefault(signature, self.generation)
        detail.update(classified="software: mismatched collective", signature=signature)
        if first < self.generation:
            why = f"the same collective mismatch after a restart (generations {first}, "
            why += f"{self.generation})"
            fatal = {**detail, "reason": f"{signature} ({why})", "classified": why}
            return self._on_fault(Fault("job_fatal", node, rank, fatal, suspects, False))
        return self._on_fault(Fault("stall", node, rank, detail, suspects, False))

    def _on_fault(self, fault: Fault) -> list[Action]:
        self.fault = fault
        self.faults.append(fault)
        self._count_culprits(fault)
        where = self.layout.describe(fault.rank) if fault.rank is not None else None
        detail = {**fault.detail, "fault": fault.kind, "where": where, "step": self.step}
        actions: list[Action] = [
            RecordEvent("fault", self.generation, fault.node, fault.rank, detail)
        ]
        self._enter(S.STOPPING)
        live = [n for n in self.order if n in self.registered]
        wait = BLOCKED_PAUSE_WAIT_S if fault.kind in BLOCKING_FAULTS else None
        actions += self._send(live, "stop", self.generation, wait)
        return actions + self._maybe_phase_done()

    def on_straggler(
        self, node: str, detail: Mapping[str, Any], now: float | None = None
    ) -> list[Action]:
        """``node`` is persistently slower than its peers and stragglers are to be evicted: with
        a spare to take its slot, stop the job, evict the node and restart on the spare from the
        last checkpoint (a fault of kind ``straggler``); without one, keep it and say so."""
        self._begin(E.STRAGGLER, now)
        if self.state is not S.RUNNING or node not in self._in_order:
            return []
        if not self.spares:
            return [self._record("straggler_kept", node, reason="no spare node", **detail)]
        return self._on_fault(Fault("straggler", node, None, dict(detail)))

    def on_training_finished(
        self, now: float | None = None, step: int | None = None
    ) -> list[Action]:
        """The training reached its last step (reported by rank 0's agent)."""
        self._begin(E.TRAINING_FINISHED, now)
        if self.state is S.FINISHED:
            return []
        self._enter(S.FINISHED)
        return [self._record("finished", step=step if step is not None else self.step)]

    # -- events: time --------------------------------------------------------------------------

    def on_tick(self, now: float) -> list[Action]:
        """Call every ~0.5 s: checks every timeout of the current state."""
        self._begin(E.TICK, now)
        waited = now - self.phase_since
        p = self.policy
        if self.state in (S.STARTING, S.RUNNING):
            for node in self.order:
                silent = now - self.last_seen.get(node, self.phase_since)
                if silent > p.heartbeat_timeout_s:
                    return self._on_fault(
                        Fault("heartbeat_timeout", node, detail={"silent_s": round(silent, 3)})
                    )
        if self.state is S.STARTING and waited > p.start_timeout_s:
            late = sorted(self.awaiting)
            return self._on_fault(
                Fault(
                    "start_timeout",
                    late[0] if len(late) == 1 else None,
                    detail={"nodes": late, "waited_s": round(waited, 3)},
                )
            )
        if self.state is S.RUNNING:
            stalled, timeout = now - self.step_at, self.stall_timeout()
            if stalled > timeout:
                return self._stall(
                    tuple(self._stall_suspects()),
                    {
                        "section": self.section(),
                        "stalled_s": round(stalled, 3),
                        "timeout_s": round(timeout, 3),
                    },
                )
        if self.state in (S.STOPPING, S.DIAGNOSING):
            limit = p.stop_timeout_s if self.state is S.STOPPING else p.selfcheck_timeout_s
            if waited > limit and self.awaiting:
                if self.state is S.STOPPING and self.fault and self.fault.kind == "job_fatal":
                    return self._after_stopped()  # the job fails anyway: evict nobody
                actions: list[Action] = []
                for node in sorted(self.awaiting):
                    actions += self._evict(node, f"no {self.awaiting_kind} ack in {limit} s")
                return actions + self._maybe_phase_done()
        if (
            self.state in (S.WAITING_FOR_NODES, S.RESTARTING)
            and p.node_wait_timeout_s is not None
            and waited > p.node_wait_timeout_s
        ):
            reason = f"fewer than {p.nodes} healthy nodes for {p.node_wait_timeout_s} s"
            if self.state is S.RESTARTING:
                reason = (
                    f"fault_tolerance.policy = {p.node_loss_policy}: no replacement node "
                    f"registered within node_wait_timeout_s = {p.node_wait_timeout_s:g} s "
                    f"({len(self.registered)} of {p.nodes} nodes healthy)"
                )
            return [self._fail(reason, have=len(self.registered))]
        return []
