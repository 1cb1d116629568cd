"""The controller's recovery protocol: what ``ControllerFSM`` does between a fault and the next
generation running. Stop every active node, wait for their acks; self-check every live node and
evict those that fail, do not answer, or were named culprit too often; plan the next generation
(each slot keeps its healthy node, else a spare; a shrink or a wait when too few are healthy,
by ``node_loss_policy``); start it, and mark it running once every node has acked.

``RecoveryProtocol`` is a part of ``ControllerFSM`` (in ``controller/fsm.py``), holding no state of its
own: the FSM's fields and its ``_begin``/``_enter``/``_record``/``_send``/``_fail`` helpers are
what it reads and uses. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from megascale.controller.actions import Action, Evict, Fault, StartGeneration
from megascale.controller.elastic import resize_detail, shrink_nodes
from megascale.controller.states import Event, State

S, E = State, Event


class RecoveryProtocol:
    """The stop / self-check / start protocol of ``ControllerFSM`` (see the module)."""

    policy: Any
    state: State

    # -- events: the stop / self-check / start protocol ---------------------------------------

    def on_ack(
        self,
        node: str,
        command_id: str,
        ok: bool = True,
        detail: str = "",
        now: float | None = None,
        suspects: Sequence[str] = (),
    ) -> list[Action]:
        """``acks/<node>`` changed: the node finished command ``command_id`` (a self-check's
        ``ok``/``detail``/``suspects`` are its result). Acks of commands not awaited are ignored."""
        self._begin(E.ACK, now)
        if self.awaiting.get(node) != command_id:
            return []
        if self.awaiting_kind == "selfcheck":
            return self._selfcheck_result(node, ok, detail, suspects)
        del self.awaiting[node]
        if self.awaiting_kind == "start" and not ok:
            return self._on_fault(Fault("start_failed", node, detail={"detail": detail}))
        return self._maybe_phase_done()

    def _maybe_phase_done(self) -> list[Action]:
        if self.awaiting:
            return []
        if self.state is S.STOPPING:
            return self._after_stopped()
        if self.state is S.DIAGNOSING:
            return self._after_diagnosis()
        if self.state is S.STARTING:
            return self._generation_running()
        return []

    def on_all_stopped(self, now: float | None = None) -> list[Action]:
        """Every active node's workers are stopped (``on_ack`` calls this by itself)."""
        self._begin(E.ALL_STOPPED, now)
        return self._after_stopped()

    def _after_stopped(self) -> list[Action]:
        self.awaiting = {}
        actions: list[Action] = [self._record("all_stopped")]
        fault = self.fault
        if fault is not None and fault.kind == "job_fatal":
            reason = f"job-fatal error on rank {fault.rank}: {fault.detail['reason']}"
            return actions + [self._fail(reason, fault.node, fault.rank)]
        if not self.budget.allows(self.now):
            return actions + [self._fail(self.budget.describe(), fault=fault and fault.kind)]
        if fault is not None and fault.kind == "straggler" and fault.node in self.registered:
            score = fault.detail.get("score")
            actions += self._evict(fault.node, f"straggler at {score}x its peers' compute time")
        self._enter(S.DIAGNOSING)
        self.suspected = {}
        actions += self._send(self._to_selfcheck(fault), "selfcheck", self.generation)
        return actions + self._maybe_phase_done()

    def _to_selfcheck(self, fault: Fault | None) -> list[str]:
        """Every live node; under in-process recovery only the fault's culprits (the other
        nodes' workers paused, keeping their state, and rejoin as they are), and the spares when
        a node of the job is lost (one of them takes its slot). A fault that blames nodes but
        names none (a stall every rank is blocked in) checks every node: any may be at fault."""
        if self.policy.recovery != "in-process" or fault is None:
            return list(self.registered)
        culprits = self._fault_culprits(fault)
        if not culprits and fault.blames_nodes and fault.kind != "job_fatal":
            return list(self.registered)
        lost = any(n not in self.registered for n in self.order)
        return [n for n in self.registered if n in culprits or (lost and n not in self._in_order)]

    def on_selfcheck_result(
        self,
        node: str,
        ok: bool,
        detail: str = "",
        now: float | None = None,
        suspects: Sequence[str] = (),
    ) -> list[Action]:
        """A node's self-check result (``on_ack`` calls this for self-check acks)."""
        self._begin(E.SELFCHECK_RESULT, now)
        if node not in self.awaiting:
            return []
        return self._selfcheck_result(node, ok, detail, suspects)

    def _selfcheck_result(
        self, node: str, ok: bool, detail: str, suspects: Sequence[str] = ()
    ) -> list[Action]:
        del self.awaiting[node]
        named = sorted({str(n) for n in suspects} & (set(self.registered) - {node}))
        actions: list[Action] = [self._record("selfcheck", node, ok=ok, detail=detail)]
        if named:  # only nodes of the job: a peer's message is evidence within its bounds
            self.suspected[node] = set(named)
        if not ok:
            actions += self._evict(node, f"self-check failed: {detail}")
        return actions + self._maybe_phase_done()

    def _unreachable_pairs(self) -> list[Action]:
        """Two nodes that each passed their neighbour all-reduce with another node but failed it
        with each other cannot reach each other (a cut link, a switch that drops one path): they
        must not train in one generation, or its first collective hangs again. Of each such
        pair, the node later in slot order (a spare after every slot) is evicted; a spare then
        takes its place, or the policy for a lost node applies."""
        place = {n: i for i, n in enumerate(dict.fromkeys([*self.order, *self.registered]))}
        actions: list[Action] = []
        for a, named in sorted(self.suspected.items()):
            for b in sorted(named):
                pair = (a, b)
                if a not in self.suspected.get(b, ()) or not set(pair) <= set(self.registered):
                    continue
                drop = max(pair, key=lambda n: place.get(n, len(place)))
                keep = a if drop == b else b
                why = f"cannot reach {keep}: their neighbour all-reduce failed both ways, while "
                actions += self._evict(drop, why + "each passed with another node")
        self.suspected = {}
        return actions

    def _fault_culprits(self, fault: Fault) -> set[str]:
        """The nodes ``fault`` names culprit: its node (unless job-fatal) and its suspects'."""
        if not fault.blames_nodes:
            return set()
        nodes = {fault.node} if fault.node and fault.kind != "job_fatal" else set()
        return nodes | {n for r in fault.suspects if (n := self.node_of(r)) is not None}

    def _count_culprits(self, fault: Fault) -> None:
        """Count ``fault``'s culprits (``evict_repeat_culprit``) once per node and generation: a
        generation ends at its first fault, so the same fault seen again (heartbeats replayed
        after an etcd outage or a takeover) is one recorded fault, never two."""
        fresh = {n for n in self._fault_culprits(fault) if self.counted.get(n) != self.generation}
        self.counted.update(dict.fromkeys(fresh, self.generation))
        self.culprits.update(fresh)

    def _evict(self, node: str, reason: str) -> list[Action]:
        self.blocklist[node] = reason
        self.registered.pop(node, None)
        self.awaiting.pop(node, None)
        return [Evict(node, reason), self._record("evict", node, reason=reason)]

    def _after_diagnosis(self) -> list[Action]:
        actions: list[Action] = self._unreachable_pairs()
        for node, count in sorted(self.culprits.items()):
            if count >= self.policy.evict_repeat_culprit and node not in self.blocklist:
                actions += self._evict(node, f"named culprit in {count} faults")
        return actions + self._try_start()

    def _plan(self) -> list[str] | None:
        """The next generation's nodes: each slot keeps its node while healthy, else takes the
        first spare, and a shrunk job takes spares up to its configured size again; None when
        there are too few healthy nodes. Short of nodes after a fault under ``shrink``: the
        healthy nodes in slot order, as many as ``shrink_nodes`` allows."""
        spares = deque(n for n in self.registered if n not in self._in_order)
        order = [
            n if n in self.registered else (spares.popleft() if spares else "") for n in self.order
        ]
        while len(order) < self.policy.nodes and spares:
            order.append(spares.popleft())
        if "" not in order and len(order) == self.policy.nodes:
            return order
        if self.generation == 0 or self.policy.node_loss_policy != "shrink":
            return None
        healthy = [n for n in order if n]
        size = shrink_nodes(len(healthy), self.policy)
        return healthy[:size] if size else None

    def _try_start(self) -> list[Action]:
        """Start the next generation if there are enough healthy nodes, else apply the policy
        for a lost node (``_short_of_nodes``)."""
        order = self._plan()
        if order is None:
            return self._short_of_nodes() if self.state in (S.DIAGNOSING, S.RESTARTING) else []
        previous, self.order = self.order, order
        self.generation += 1
        if self.generation > 1:
            self.budget.record(self.now)
        self._reset_generation_tracking()
        replaced = {old: new for old, new in zip(previous, order, strict=False) if old != new}
        self._enter(S.STARTING)
        resized: list[Action] = []
        if previous and len(order) != len(previous):
            decision = "shrink" if len(order) < len(previous) else "grow"
            lost = [n for n in previous if n not in self.registered]
            detail = resize_detail(decision, self.policy, len(previous), len(order), lost)
            resized.append(self._record("elastic", **detail))
        return [
            *resized,
            StartGeneration(self.generation, self.assignment),
            self._record(
                "generation_start",
                nodes=list(order),
                replaced=replaced,
                restarts=self.restarts,
                spares=self.spares,
            ),
            *self._send(order, "start", self.generation),
        ]

    def _short_of_nodes(self) -> list[Action]:
        """Too few healthy nodes after a fault and no shrink possible: fail (policy ``fail``) or
        wait for a replacement to register (``wait``, or a ``shrink`` no smaller size allows),
        saying which and why in an ``elastic`` event when the decision is first taken."""
        p, first = self.policy, self.state is S.DIAGNOSING
        lost = [n for n in self.order if n not in self.registered]
        have = f"{len(self.registered)} of {p.nodes} nodes healthy"
        why = f"{', '.join(lost) or 'a node'} lost, no spare ({have})"
        if p.node_loss_policy == "fail" and first:
            text = f"fail: {why}"
            return [
                self._record("elastic", decision="fail", policy="fail", lost=lost, text=text),
                self._fail(f"fault_tolerance.policy = fail: {why}"),
            ]
        self._enter(S.RESTARTING)
        actions: list[Action] = []
        if first:
            limit = p.node_wait_timeout_s
            text = f"wait: {why}; waiting " + (f"up to {limit:g} s " if limit else "")
            text += "for a replacement node to register"
            if p.node_loss_policy == "shrink":
                text += " (no smaller size splits the global batch into whole micro-batches)"
            detail = {"decision": "wait", "policy": p.node_loss_policy, "lost": lost, "text": text}
            actions.append(self._record("elastic", **detail))
        return actions + [
            self._record("waiting_for_nodes", need=p.nodes, have=len(self.registered))
        ]

    def on_generation_started(self, generation: int, now: float | None = None) -> list[Action]:
        """Every node acked the start of ``generation`` (``on_ack`` calls this by itself)."""
        self._begin(E.GENERATION_STARTED, now)
        if generation != self.generation:
            return []
        return self._generation_running()

    def _generation_running(self) -> list[Action]:
        self.awaiting, self.awaiting_kind = {}, None
        self._enter(S.RUNNING)
        self.step_at = self.now
        self.last_seen = {n: self.now for n in self.order}
        return [self._record("generation_running", nodes=list(self.order))]
