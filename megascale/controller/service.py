"""The controller process (``megascale controller``): the I/O shell around ``ControllerFSM``.

One loop, one thread of decisions::

    campaign for controller/leader (Election) -> lead:
        state snapshot in etcd?  restore the FSM (a standby taking over) : new FSM + on_start
        list nodes/, heartbeats/, acks/ and watch them from the listed revision + 1
        loop: watch event or tick -> FSM on_* -> actions -> execute -> snapshot

Executing actions: ``RecordEvent`` goes to the ``EventLog`` (RUN_DIR/events.jsonl + etcd);
``SendCommand``, ``Evict`` and ``StartGeneration`` become puts of ``commands/<node>``,
``blocklist/<node>`` and ``generation``, written together with the FSM's ``state`` snapshot in one
transaction fenced by the leader key (``Election.guard``): a deposed controller writes nothing,
and a standby never restores a state older than the commands the agents have seen. The event log
is fenced the same way (``EventLog``'s ``fence``; its events carry the leader's term), and the
events a controller queued when it finds it lost the lead are dropped.

What the shell adds to the FSM's view:

* Worker exits and error keywords come from the heartbeats (each exit once per generation and
  rank, each error once by its sequence number). A fault's *symptoms* on other ranks -- a worker
  that exited or printed a traceback because a peer's connection closed (the agent marks these
  ``secondary``) -- are held back for ``secondary_hold_s`` (a bit more than the agents' lease
  TTL): if the cause shows up meanwhile (a worker killed by a signal, a node whose lease expired),
  the FSM hears of the cause first and names the right node; while a node's registration is
  pending (``_missing``: it may yet be lost) no symptom is released. Otherwise the symptom is the
  fault.
* A worker's exit with an uncaught exception (its signature, see ``probes.fatal``) is held
  for ``error_hold_s``: if the same signature ends every rank of the generation meanwhile, it is
  fed as the job's error (the FSM fails the job, evicting nobody); else it is an ordinary fault.
  The traceback keyword of such a rank is that same exception and is not fed again.
* Notices (a checkpoint that failed verification and was skipped) are recorded as events.
* etcd outages: when a store call fails the shell records ``etcd_unavailable``, stops ticking the
  FSM (silence is then etcd's fault, not the nodes'), keeps unwritten puts in an outbox, and on
  recovery records ``etcd_recovered`` and gives every node a fresh heartbeat allowance
  (``ControllerFSM.restore`` of its own snapshot). A registration that disappears during an
  outage, or within ``secondary_hold_s`` of its end or of a starved loop turn (agents re-grant
  leases that ran out while etcd, or every process of the machine, was away), is a lost node
  only if it has not registered again by then.

Its options are ``ServiceOptions``; what it reads from heartbeats is ``service_heartbeats``; the
process entry (``megascale controller``: ``add_arguments``, ``main``, ``serve``) is in
``controller_command``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from queue import Empty, Queue
from typing import Any

from megascale.controller.effective import EffectiveTime
from megascale.controller.election import Election
from megascale.controller.events import EventLog
from megascale.controller.fsm import (
    Action,
    ControllerFSM,
    Evict,
    RecordEvent,
    SendCommand,
    StartGeneration,
    State,
)
from megascale.controller.intake_checks import StepMemory
from megascale.controller.job_summary import JobSummary
from megascale.controller.policy import (  # noqa: F401  (policy_for: re-exported)
    ControllerPolicy,
    lease_ttl,
    policy_for,
)
from megascale.controller.service_heartbeats import Evidence, HeartbeatIntake  # noqa: F401
from megascale.controller.service_options import ServiceOptions  # noqa: F401  (re-exported)
from megascale.controller.stragglers import StragglerTracker
from megascale.etcd.keys import JobKeys
from megascale.etcd.store import TXN_MAX_OPS, Put, Store, StoreError, WatchEvent
from megascale.messages import (
    Ack,
    BlockedNode,
    ControllerStatus,
    GenerationRecord,
    Heartbeat,
    MessageError,
)
from megascale.probes.flight.format import RankState
from megascale.process import write_metrics_url

logger = logging.getLogger(__name__)

TERMINAL = (State.FINISHED, State.FAILED)
_INVALID_ARGUMENT = 3  # gRPC status etcd gives a request it will never accept (not an outage)


def _is_request_bug(error: StoreError) -> bool:
    """Whether etcd refused the request itself (too many operations, too large): a bug to fix,
    which a retry cannot, unlike an outage."""
    return error.code == _INVALID_ARGUMENT or "too many operations" in str(error)


# -- the service ------------------------------------------------------------------------------


class LostLeadership(RuntimeError):
    """A fenced write failed or the election lease expired: stop acting as the controller."""


class ControllerService(HeartbeatIntake):
    """Leader-elected controller; ``run`` returns 0 when the job finished, 1 when it failed."""

    def __init__(
        self, store: Store, opts: ServiceOptions, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.store, self.opts, self.clock = store, opts, clock
        self.keys = JobKeys(opts.job_id)
        self.election = Election(
            store,
            self.keys.controller_leader,
            opts.candidate_id,
            ttl=opts.election_ttl,
            info={"run_dir": str(opts.run_dir)},
        )
        # Fenced like the outbox: a controller that lost its lease records nothing.
        self.events = EventLog(
            opts.run_dir, store, self.keys, buffered=True, fence=lambda: [self.election.guard()]
        )
        self.stopping = threading.Event()
        self.fsm: ControllerFSM | None = None
        self._inbox: Queue[tuple[str, WatchEvent]] = Queue()
        self._watches: list[Any] = []
        self._outbox: dict[str, Any] = {}
        self._dirty = False  # the FSM changed since the last ``state`` write
        self._snapshot_at = -math.inf
        self._fed_exits: dict[tuple[int, int], int] = {}  # (generation, rank) -> code
        self._seen: dict[tuple[str, str, int], int] = {}  # (what, node, generation) -> last seq
        self._unreadable: set[tuple[str, ...]] = set()  # (message, node, ...) logged once
        self._refused: set[str] = set()  # registered nodes that are never counted
        self._missing: dict[str, float] = {}  # node not registered -> when it is lost
        self._own_absence_until = -math.inf  # till then a lost registration may be our own doing
        self._steps = StepMemory()  # the steps heartbeats reported (progress never goes back)
        self._held: list[tuple[float, Evidence]] = []
        self._errors: dict[tuple[int, int], str] = {}  # (generation, rank) -> exit's signature
        self._outage_since: float | None = None
        self._flight: dict[int, RankState] = {}  # rank -> flight state, this generation
        self._flight_generation = -1
        self.stragglers = StragglerTracker(
            opts.straggler_threshold, opts.straggler_window, opts.straggler_consecutive
        )
        self._straggler_steps: dict[int, int] = {}  # rank -> step of its last sample
        self.effective = EffectiveTime(self.clock())
        self.summary = JobSummary()  # the job's figures, for the ``summary`` key
        self.metrics: Any = None
        self.metrics_server: Any = None

    def _serve_metrics(self) -> None:
        if self.opts.metrics_port < 0 or self.metrics_server is not None:
            return
        from megascale.agent.metrics import ControllerMetrics

        self.metrics = self.metrics or ControllerMetrics(self.opts.job_id)
        self.metrics_server = self.metrics.serve(self.opts.metrics_port, self.opts.metrics_addr)
        logger.info("controller metrics at %s", self.metrics_server.url)
        write_metrics_url(self.opts.run_dir, self.opts.candidate_id, self.metrics_server.url)

    # -- lifecycle -----------------------------------------------------------------------------

    def run(self) -> int:
        self._serve_metrics()
        try:
            while not self.stopping.is_set():
                try:
                    if not self.election.campaign(timeout_s=1.0):
                        continue
                    state = self._lead()
                except LostLeadership as e:
                    dropped = self.events.discard()  # decisions of a deposed leader
                    logger.warning(
                        "%s: no longer the leader (%s); events dropped: %s",
                        self.opts.candidate_id, e, dropped,
                    )  # fmt: skip
                    self._drop_watches()
                    continue
                except StoreError as e:
                    logger.warning("etcd unavailable while campaigning: %s", e)
                    self._drop_watches()
                    time.sleep(0.5)
                    continue
                if state is not None:
                    return 0 if state is State.FINISHED else 1
            return 1
        finally:
            self._drop_watches()
            self.events.flush(mirror=self._outage_since is None)
            try:
                self.election.resign()
            except StoreError as e:
                logger.warning("could not resign: %s", e)
            if self.metrics_server is not None:
                self.metrics_server.close()
                self.metrics_server = None

    def stop(self) -> None:
        """Ask ``run`` to return (from a signal handler or another thread)."""
        self.stopping.set()
        self.election.close()

    def _lead(self) -> State | None:
        now = self.clock()
        self.events.term = self.election.term
        self.effective = EffectiveTime(now)
        fresh = self._begin(now)
        assert self.fsm is not None
        if self.metrics is not None:
            self.metrics.set_generation(self.fsm.generation)
        if self.fsm.state in TERMINAL:  # the job ended under the previous leader
            return self.fsm.state
        nodes = self._watch("node", self.keys.nodes_prefix)
        heartbeats = self._watch("hb", self.keys.heartbeats_prefix)
        acks = self._watch("ack", self.keys.acks_prefix)
        self._sync_nodes(nodes, now)
        if fresh:
            self._act(self.fsm.on_start(now))
        for kv in heartbeats:
            self._dispatch("hb", WatchEvent("put", kv.key, kv.value, kv.mod_revision, kv.lease))
        for kv in acks:
            self._dispatch("ack", WatchEvent("put", kv.key, kv.value, kv.mod_revision, kv.lease))
        if not fresh:  # the predecessor may have died before all of them were written
            self._act(self.fsm.pending_commands())
        self._act([], snapshot=True)
        self._flush(force=True)
        return self._loop()

    def _begin(self, now: float) -> bool:
        """Restore the FSM from the ``state`` snapshot (True: there was none, start afresh)."""
        self._flight.clear()
        self._fed_exits.clear()
        self._seen.clear()
        self._steps.clear()
        self._refused.clear()
        self._held.clear()
        self._missing.clear()
        self._errors.clear()
        self._outbox.clear()  # an earlier term's writes: the snapshot below is the truth
        while not self._inbox.empty():  # events of an earlier term's watches
            self._inbox.get_nowait()
        snapshot = self.store.get(self.keys.state)
        if snapshot is None:
            self.fsm = ControllerFSM(self.opts.policy, now)
            return True
        state = snapshot.json()
        self.fsm = ControllerFSM.restore(self.opts.policy, state, now)
        if self.fsm.state in TERMINAL:
            return False
        self.events.resync()
        self.events.append(
            "controller_takeover",
            generation=self.fsm.generation,
            detail={"controller": self.opts.candidate_id, "state": self.fsm.state.value},
        )
        return False

    def _watch(self, what: str, prefix: str) -> list[Any]:
        """List ``prefix`` and watch it from the listed revision + 1 (nothing missed)."""
        snap = self.store.snapshot(prefix)
        watch = self.store.watch_prefix(
            prefix,
            start_revision=snap.revision + 1,
            callback=lambda event: self._inbox.put((what, event)),
        )
        self._watches.append(watch)
        return snap.items

    def _drop_watches(self) -> None:
        for watch in self._watches:
            watch.cancel()
        self._watches = []

    def _sync_nodes(self, listed: list[Any], now: float) -> None:
        """Registered nodes in registration order. A node the FSM knew that is not listed is
        lost only if it has not registered again within ``secondary_hold_s`` (a lease TTL and
        its delivery): after an etcd outage or a takeover its agent may be re-registering, and
        the controller's own absence is no evidence against it (``_missing``, ``_tick``)."""
        assert self.fsm is not None
        present = [
            self.keys.name_of(kv.key) for kv in sorted(listed, key=lambda k: k.create_revision)
        ]
        present_set = set(present)
        for node in list(self.fsm.registered):
            if node not in present_set:
                self._missing[node] = now + self.opts.secondary_hold_s
        labels = {self.keys.name_of(kv.key): _topology(kv) for kv in listed}
        refused = {self.keys.name_of(kv.key) for kv in listed if self._refuse(kv)}
        for node in present:
            if node not in refused:
                self._act(self.fsm.on_node_registered(node, now, labels.get(node)))

    def _loop(self) -> State | None:
        assert self.fsm is not None
        next_tick = next_check = turn = self.clock()
        while not self.stopping.is_set():
            try:
                item = self._inbox.get(timeout=max(0.0, next_tick - self.clock()))
            except Empty:
                item = None
            turn = self._own_gap(turn)
            if item is not None:
                self._dispatch(*item)
                for _ in range(self.opts.drain - 1):  # the burst that came with it
                    try:
                        self._dispatch(*self._inbox.get_nowait())
                    except Empty:
                        break
            now = self.clock()
            if now >= next_tick:
                self._tick(now)
                next_tick = now + self.opts.tick_s
            if now >= next_check:
                self._check_leadership(now)
                next_check = now + self.opts.check_s
            terminal = self.fsm.state in TERMINAL
            self._flush(force=terminal)
            if terminal and not self._outbox and not self._dirty:
                return self.fsm.state
        return None

    def _own_gap(self, turn: float) -> float:
        """Deadlines measured against the controller's own progress: a turn of the loop that
        came over ``starved_s`` late (this process starved of CPU, or blocked on an etcd that
        did not answer) extends every deadline of the FSM by the delay, so the time the
        controller was away is never blamed on a node. Returns this turn's time."""
        assert self.fsm is not None
        now = self.clock()
        late = now - turn - self.opts.tick_s
        if late > self.opts.starved_s:
            self.fsm.extend_deadlines(late)
            self._own_absence_until = now + self.opts.secondary_hold_s
            logger.warning("controller was away %.1f s: its deadlines are extended", late)
            if late > self.opts.policy.heartbeat_timeout_s / 2:
                self.events.append(
                    "controller_starved",
                    generation=self.fsm.generation,
                    detail={"late_s": round(late, 3)},
                )
        return now

    # -- inputs --------------------------------------------------------------------------------

    def _dispatch(self, what: str, event: WatchEvent) -> None:
        assert self.fsm is not None
        now = self.clock()
        node = self.keys.name_of(event.key)
        if what == "node":
            if event.kind == "put":
                self._missing.pop(node, None)
                if not self._refuse(event):
                    self._act(self.fsm.on_node_registered(node, now, _topology(event)))
            else:
                self._refused.discard(node)
                if self._outage_since is not None or now < self._own_absence_until:
                    # in the wake of etcd's or this controller's own absence (an etcd restart, a
                    # starved loop) an agent's lease may run out while its node is fine: lost
                    # only if it has not registered again within ``secondary_hold_s`` (``_tick``)
                    self._missing[node] = now + self.opts.secondary_hold_s
                else:
                    self._missing.pop(node, None)
                    self._act(self.fsm.on_node_lost(node, "lease expired", now))
        elif node in self._refused:
            return  # a refused node's heartbeats and acks are never read
        elif what == "hb" and event.kind == "put":
            heartbeat = self._decode(Heartbeat, node, event)
            if heartbeat is not None:
                self._heartbeat(node, heartbeat, now)
        elif what == "ack" and event.kind == "put":
            ack = self._decode(Ack, node, event)
            if ack is not None:
                self._act(self.fsm.on_ack(node, ack.id, ack.ok, ack.detail, now, ack.suspects))

    def _decode(self, kind: type, node: str, event: WatchEvent):
        """``event``'s value as message ``kind``; None (logged once per node and kind) when this
        controller cannot read it, e.g. an agent of another major version."""
        try:
            return kind.from_json(event.value)
        except MessageError as e:
            if (kind.__name__, node) not in self._unreadable:
                self._unreadable.add((kind.__name__, node))
                logger.error("node %s: ignoring its %s: %s", node, kind.__name__, e)
            return None

    def _tick(self, now: float) -> None:
        assert self.fsm is not None
        for node, at in list(self._missing.items()):
            if at <= now and self._outage_since is None:  # not registered again: lost
                del self._missing[node]
                self._act(self.fsm.on_node_lost(node, "not registered again", now))
        if not self._missing:  # symptoms wait for a node that may yet be lost: their cause
            due = [ev for at, ev in self._held if at <= now]
            self._held = [(at, ev) for at, ev in self._held if at > now]
            for ev in due:
                self._feed(ev, now)
        if self._outage_since is None and not self._stall(now):  # etcd down: silence is its fault
            self._act(self.fsm.on_tick(now))
        if self.metrics is not None:
            self.metrics.set_effective_training_time(
                self.effective.productive_s, now - self.effective.start
            )

    def _act(self, actions: list[Action], snapshot: bool = False) -> None:
        """Execute ``actions`` in order: events and puts into their queues, for ``_flush``."""
        assert self.fsm is not None
        for action in actions:
            if isinstance(action, RecordEvent):
                self.events.record(action)
                if self.metrics is not None and action.kind == "fault":
                    self.metrics.record_fault(str(action.detail.get("fault", "unknown")))
            elif isinstance(action, SendCommand):
                self._outbox[self.keys.command(action.node)] = action.message(self.opts.job_id)
            elif isinstance(action, Evict):
                self._outbox[self.keys.blocked(action.node)] = BlockedNode(
                    reason=action.reason, generation=self.fsm.generation, time=time.time()
                )
            elif isinstance(action, StartGeneration):
                self.effective.new_generation()
                self.summary.new_generation()
                self.stragglers.reset()
                self._straggler_steps.clear()
                if self.metrics is not None:
                    self.metrics.set_straggler_scores({})
                    if action.generation > 1:
                        self.metrics.record_restart(action.generation)
                    else:
                        self.metrics.set_generation(action.generation)
                self._outbox[self.keys.generation] = GenerationRecord(
                    generation=action.generation,
                    assignment={n: list(r) for n, r in action.assignment.items()},
                )
        if actions or snapshot:
            self._dirty = self.summary.changed = True

    def _flush(self, force: bool = False) -> None:
        """Write the outbox, then the queued events.

        The outbox goes in fenced transactions of at most ``TXN_MAX_OPS`` puts each (etcd refuses
        more than ``--max-txn-ops``, default 128, so one transaction would fail from ~126 nodes
        on), the ``state`` snapshot and the agents' ``status`` in the first; what is not written
        yet stays for a retry if etcd is down. The snapshot is the FSM as it is now, so one write
        covers every decision since the last: it goes with any command, or alone once
        ``snapshot_s`` has passed (or ``force``)."""
        assert self.fsm is not None
        now = self.clock()
        # the job's figures (small): with any decision's writes, like the snapshot, else rate-limited
        if self.summary.due(now, self.opts.snapshot_s, force or bool(self._outbox)):
            record = self.summary.take(self.fsm, self.effective, now)
            self._outbox[self.keys.summary] = record
            if self.metrics is not None:
                self.metrics.set_job_summary(record)
        if self._dirty and (
            force or self._outbox or now - self._snapshot_at >= self.opts.snapshot_s
        ):
            self._outbox[self.keys.state] = self.fsm.snapshot()
            self._outbox[self.keys.status] = ControllerStatus(
                state=self.fsm.state.value, generation=self.fsm.generation
            )
            self._dirty, self._snapshot_at = False, now
        if self._outbox:
            self._write_outbox()
        self.events.flush(mirror=self._outage_since is None)

    def _write_outbox(self) -> None:
        keys = list(self._outbox)
        # state, status, then generation, which agents read to accept a new generation's
        # commands: written with or before them even when they span several transactions.
        for first in (self.keys.generation, self.keys.status, self.keys.state):
            if first in self._outbox:
                keys.remove(first)
                keys.insert(0, first)
        for start in range(0, len(keys), TXN_MAX_OPS):
            chunk = keys[start : start + TXN_MAX_OPS]
            ops = [Put(key, self._outbox[key]) for key in chunk]
            try:
                result = self.store.txn([self.election.guard()], ops)
            except StoreError as e:
                if _is_request_bug(e):  # retrying cannot help: not an outage, a bug
                    logger.error("etcd refused a %d-op controller write: %s", len(ops), e)
                    raise RuntimeError(
                        f"etcd refused a fenced write of {len(ops)} ops (a bug, not an outage): {e}"
                    ) from e
                self._store_failed(e)
                return
            except ValueError as e:  # guard(): not leading any more
                raise LostLeadership(str(e)) from e
            if not result.succeeded:
                raise LostLeadership("a fenced write failed: another controller leads")
            for key in chunk:
                del self._outbox[key]
        self._store_ok()

    def _check_leadership(self, now: float) -> None:
        if self.election.lost.is_set():
            raise LostLeadership("the election lease expired")
        try:
            leading = self.election.check()
        except StoreError as e:
            self._store_failed(e)
            return
        self._store_ok()
        if not leading:
            raise LostLeadership("the leader key is not ours")

    def _store_failed(self, error: Exception) -> None:
        if self._outage_since is not None:
            return
        assert self.fsm is not None
        self._outage_since = self.clock()
        logger.warning("etcd unavailable: %s", error)
        self.events.append(
            "etcd_unavailable", generation=self.fsm.generation, detail={"error": str(error)[:300]}
        )

    def _store_ok(self) -> None:
        if self._outage_since is None:
            return
        assert self.fsm is not None
        now = self.clock()
        down, self._outage_since = now - self._outage_since, None
        self._missing = dict.fromkeys(self._missing, now + self.opts.secondary_hold_s)
        self._own_absence_until = now + self.opts.secondary_hold_s
        clean = [r for (g, r), c in self._fed_exits.items() if g == self.fsm.generation and c == 0]
        # Fresh heartbeat and stall allowances for every node (the FSM's restore contract).
        self.fsm = ControllerFSM.restore(self.opts.policy, self.fsm.snapshot(), now)
        for rank in clean:
            node = self.fsm.node_of(rank)
            if node is not None:
                self._act(self.fsm.on_worker_exit(node, rank, 0, now, self.fsm.generation))
        self.events.append(
            "etcd_recovered", generation=self.fsm.generation, detail={"down_s": round(down, 3)}
        )


def _topology(kv: Any) -> str | None:
    """The switch/rack label in a ``nodes/<node>`` registration (None: none, or unreadable)."""
    try:
        label = kv.json().get("topology")
    except (ValueError, AttributeError):
        return None
    return str(label) if label else None
