"""What the controller reads from the agents' heartbeats, turned into ``ControllerFSM`` events.

``HeartbeatIntake`` is the part of ``service.ControllerService`` that reads a ``Heartbeat``:
worker exits and error keywords become ``Evidence``, fed at once or held back (a peer's symptom
for ``secondary_hold_s``, an uncaught exception for ``error_hold_s`` to see whether every rank
died of it); the workers' step times teach the FSM's step timeout; compute times feed the
straggler model; the ranks' flight states name a stall's culprits. First, each message is checked
(``intake_checks``): a heartbeat the controller cannot believe is dropped and logged, a
registration of another config (or naming another node) is refused. It holds no state of its own:
``ControllerService.__init__`` creates the fields it uses, and ``_act`` executes what it decides.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megascale.controller.fsm import State
from megascale.controller.intake_checks import heartbeat_problem, registration_problem
from megascale.messages import Heartbeat, Reported
from megascale.probes.flight.culprits import analyse_stall
from megascale.probes.flight.format import RankState

logger = logging.getLogger("megascale.controller.service")


@dataclass(frozen=True)
class Evidence:
    """A worker exit or error keyword, as the heartbeats told it."""

    kind: str  # "worker_exit" | "error_keyword"
    node: str
    rank: int
    generation: int
    code: int | None = None
    text: str = ""
    secondary: bool = False
    fatal: str | None = None
    """A job-fatal exit's reason (``probes.fatal``), never held back as a symptom."""
    error: Mapping[str, str] | None = None
    """The uncaught exception of a failed exit (``{"text", "signature"}``)."""


class HeartbeatIntake:
    """Heartbeats in, FSM events out (a part of ``ControllerService``; see the module)."""

    fsm: Any

    def _heartbeat(self, node: str, payload: Heartbeat, now: float) -> None:
        assert self.fsm is not None
        world = self.fsm.policy.world_size
        problem = heartbeat_problem(payload, node, self.opts.train_steps, world, self._steps)
        if problem is not None:
            self._drop(node, "Heartbeat", payload.generation, problem)
            return
        self._steps.remember(payload)
        before = self.fsm.step
        if self.metrics is not None:
            self.metrics.observe_heartbeat(node, payload)
        self._act(self.fsm.on_heartbeat(node, payload, now))
        if self.fsm.step is not None and self.fsm.step != before:
            self.effective.observe(self.fsm.step, now)
            self.summary.changed = True
        generation = payload.generation
        if generation != self.fsm.generation or not self.fsm.in_order(node):
            return
        self.summary.observe(payload)
        self._learn_step_time(payload, before)
        self._observe_straggler(node, payload, now)
        if self._flight_generation != generation:
            self._flight, self._flight_generation = {}, generation
        for rank, state in payload.flight.items():
            try:
                self._flight[int(rank)] = RankState.from_json(state)
            except (KeyError, TypeError, ValueError):
                continue
        for rank, worker in payload.workers.items():
            code = worker.exit_code
            if code is None or (generation, int(rank)) in self._fed_exits:
                continue
            self._fed_exits[(generation, int(rank))] = code
            fatal = worker.fatal
            secondary = code > 0 and worker.peer and fatal is None
            error = None if secondary else worker.error  # a symptom is never the job's
            ev = Evidence(
                "worker_exit", node, int(rank), generation, code, "", secondary, fatal, error
            )
            self._evidence(ev, now)
        for error in self._new(payload.error_events, "error", node, generation):
            if error.kind == "storage_full":  # the job's storage: never the node's evidence
                self._act(self.fsm.on_storage_full(node, error.rank, error.text, now))
                continue
            if error.kind == "traceback" and (generation, error.rank) in self._errors:
                continue  # the exception its exit reported, with its signature
            text = f"{error.kind}: {error.text}"
            ev = Evidence(
                "error_keyword", node, error.rank, generation, None, text, error.secondary
            )
            self._evidence(ev, now)
        for notice in self._new(payload.notices, "notice", node, generation):
            self.events.append(
                notice.kind,
                generation=generation,
                node=node,
                rank=notice.rank,
                detail={"text": notice.text},
            )

    def _refuse(self, kv: Any) -> bool:
        """True when the ``nodes/<node>`` value ``kv`` must not be counted (another config's
        agent, a value naming another node): logged in one line and recorded as a
        ``node_refused`` event once per node, its heartbeats and acks ignored."""
        assert self.fsm is not None
        node = self.keys.name_of(kv.key)
        try:
            value = kv.json()
        except ValueError:
            value = None
        problem = registration_problem(value, node, self.opts.config_hash)
        if problem is None:
            self._refused.discard(node)
            return False
        if node not in self._refused:
            self._refused.add(node)
            logger.error("node %s refused: %s", node, problem)
            self.events.append(
                "node_refused", generation=self.fsm.generation, node=node, detail={"text": problem}
            )
        return True

    def _drop(self, node: str, kind: str, generation: Any, problem: str) -> None:
        """Log a message the controller does not believe (each problem once per node and
        generation); the message is dropped whole."""
        key = (kind, node, str(generation), problem)
        if key not in self._unreadable:
            self._unreadable.add(key)
            logger.error("node %s: dropping its %s: %s", node, kind, problem)

    def _learn_step_time(self, payload: Heartbeat, before: int | None) -> None:
        """Teach the FSM's step timeout the workers' own step times (the slowest rank's, from
        its progress file), one sample per step done since the last report (at most 4): the
        FSM alone sees progress only at heartbeat granularity, and with fast steps it would need
        many heartbeats before its timeout is learned rather than the default."""
        step, seconds = payload.step, payload.step_time_s
        if before is None or step is None or not seconds or int(step) <= before:
            return
        for _ in range(min(int(step) - before, 4)):
            self.fsm.timeouts.observe("step", float(seconds))

    def _observe_straggler(self, node: str, payload: Heartbeat, now: float) -> None:
        """Feed each rank's new compute time (once per step it was measured in; its pipeline
        stage with it) to the straggler model; publish the per-rank scores; record a
        ``straggler`` event naming the node (and its slowest rank) slow in
        ``straggler_consecutive`` windows in a row, and under ``straggler_action="evict"`` hand
        it to the FSM to be replaced."""
        assert self.fsm is not None
        if payload.section != "step":
            return
        flagged: list[str] = []
        for key, info in payload.ranks.items():
            rank, step = int(key), info.compute_step
            if step is None or int(step) <= self._straggler_steps.get(rank, -1):
                continue
            self._straggler_steps[rank] = int(step)
            flagged += self.stragglers.observe(rank, node, info.stage, info.compute_time_s)
        if self.metrics is not None and self.stragglers.rank_scores:
            nodes = self.stragglers.rank_nodes()
            self.metrics.set_straggler_scores(
                {(nodes[r], r): score for r, score in self.stragglers.rank_scores.items()}
            )
        for slow in flagged:
            score, rank = self.stragglers.scores.get(slow, 0.0), self.stragglers.slowest.get(slow)
            logger.warning(
                "straggler: %s (rank %s) at %.2fx its pipeline stage's compute time",
                slow, rank, score,
            )  # fmt: skip
            detail = {
                "score": round(score, 3),
                "rank": rank,
                "threshold": self.opts.straggler_threshold,
                "windows": self.opts.straggler_consecutive,
                "step": self._straggler_steps.get(rank),
            }
            action = self.opts.straggler_action
            self.events.append(
                "straggler",
                generation=self.fsm.generation,
                node=slow,
                rank=rank,
                detail={**detail, "action": action},
            )
            if action == "evict":
                self._act(self.fsm.on_straggler(slow, detail, now))

    def _new(self, items: list[Reported], what: str, node: str, generation: int) -> list[Reported]:
        """Items of a heartbeat list not seen before (by their ``seq``)."""
        key = (what, node, generation)
        seen = self._seen.get(key, -1)
        fresh = [i for i in items if i.seq > seen]
        if fresh:
            self._seen[key] = max(i.seq for i in fresh)
        return fresh

    def _evidence(self, ev: Evidence, now: float) -> None:
        if ev.kind == "worker_exit" and ev.code == 0:
            self._feed(ev, now)  # a clean exit is never a fault: no reason to wait
        elif ev.secondary:
            logger.info("holding a symptom for %.1f s: %s", self.opts.secondary_hold_s, ev)
            self._held.append((now + self.opts.secondary_hold_s, ev))
        elif ev.error is not None:
            self._errors[(ev.generation, ev.rank)] = ev.error["signature"]
            self._held.append((now + self.opts.error_hold_s, ev))
            self._feed_if_everywhere(ev, now)
        else:
            self._feed(ev, now)

    def _feed_if_everywhere(self, ev: Evidence, now: float) -> None:
        """Feed ``ev`` as the job's error at once (its held peers dropped) when the same
        exception signature ended every rank of its generation."""
        assert self.fsm is not None
        ranks = {r for (g, r), sig in self._errors.items() if g == ev.generation}
        same = {sig for (g, _), sig in self._errors.items() if g == ev.generation}
        if len(ranks) < self.fsm.world_size or len(same) != 1:
            return
        self._held = [(at, e) for at, e in self._held if e.error is None]
        self._act(
            self.fsm.on_worker_exit(
                ev.node, ev.rank, int(ev.code or 1), now, ev.generation, None, ev.error, True
            )
        )

    def _feed(self, ev: Evidence, now: float) -> None:
        assert self.fsm is not None
        if ev.generation != self.fsm.generation:
            return
        if ev.kind == "worker_exit":
            assert ev.code is not None
            self._act(
                self.fsm.on_worker_exit(
                    ev.node, ev.rank, ev.code, now, ev.generation, ev.fatal, ev.error
                )
            )
        else:
            self._act(self.fsm.on_error_keyword(ev.node, ev.text, ev.rank, now))

    def _stall(self, now: float) -> bool:
        """Declare a stall the FSM's ``on_tick`` would declare now, with the suspects of the
        flight recorders' wait-for graph (``flight.culprits.stall_culprits``: follows waits across
        groups, knows stopped processes); each culprit's reason, group and op go into the event's
        ``culprits`` and the ``megascale_stall_culprit_total`` metric. False: no stall yet, or no
        flight data to analyse."""
        fsm = self.fsm
        assert fsm is not None
        if fsm.state is not State.RUNNING or not self._flight:
            return False
        stalled, timeout = now - fsm.step_at, fsm.stall_timeout()
        quiet = self.opts.policy.heartbeat_timeout_s / 2
        silent = [n for n in fsm.order if now - fsm.last_seen.get(n, now) > quiet]
        if stalled <= timeout or silent:
            return False  # a silent node is the FSM's heartbeat fault, not a stall
        analysis = analyse_stall(self._flight)
        culprits = analysis.culprits
        waiting = sorted(
            {
                f"{op.kind.name.lower()} #{op.seq} on {list(st.groups[op.group].ranks)}"
                for st in self._flight.values()
                for op in st.blocked
                if op.group in st.groups
            }
        )
        detail = {
            "section": fsm.section(),
            "stalled_s": round(stalled, 3),
            "timeout_s": round(timeout, 3),
            "blocked_in": waiting[:8],
            "stopped": sorted(r for r, st in self._flight.items() if st.stopped),
            "culprits": [c.to_json() | {"text": c.describe()} for c in culprits],
        }
        if analysis.undecided:  # nobody named: why not, with the evidence
            detail["undecided"] = [u.to_json() for u in analysis.undecided]
        if self.metrics is not None:
            for culprit in culprits:
                self.metrics.record_stall_culprit(culprit.rank, culprit.reason)
        self._act(fsm.on_stall_detected({c.rank for c in culprits}, now, detail))
        return True

    # -- outputs -------------------------------------------------------------------------------
