"""What ``megascale launch`` does while the job runs: ``Monitor`` polls the run directory and
etcd, logs the progress (``metrics.jsonl``) and the controller's decisions (``events.jsonl``, one
line each by ``describe_event``), fires the launcher-side injected faults (kill or pause the
leading controller, kill an agent, restart etcd, forge commands), brings back an agent whose node
was "repaired", and asks the ``Supervisor`` whether etcd and the controllers still stand.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megascale import runfiles
from megascale.launcher.outcome import current_step
from megascale.launcher.supervise import Supervisor
from megascale.messages import Event, read_metrics
from megascale.probes import inject

if TYPE_CHECKING:
    from megascale.launcher.cluster import LocalCluster

logger = logging.getLogger("megascale.launch")  # the launcher's one log name (cluster.py's too)


class Tail:
    """New complete lines of a growing file (a file rewritten shorter is read again)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, ""

    def lines(self) -> list[str]:
        try:
            size = self.path.stat().st_size
            if size < self.offset:
                self.offset, self.partial = 0, ""
            with open(self.path, encoding="utf-8", errors="replace") as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except OSError:
            return []
        parts = (self.partial + data).split("\n")
        self.partial = parts.pop()
        return [p for p in parts if p.strip()]


def _fault(d: dict) -> str:
    """A fault event's detail; a stall leads with whom it names (rank, coordinates, node, group,
    op) or why it names nobody, then what the ranks are blocked in."""
    rest = ", ".join(
        f"{k}={v}"
        for k, v in d.items()
        if k not in ("fault", "step", "where", "culprits", "undecided", "suspects")
    )
    if not ({"culprits", "undecided"} & set(d)):
        return rest
    named = [str(c.get("text")) for c in d.get("culprits") or ()]
    named += [str(u.get("text")) for u in d.get("undecided") or ()]
    return "; ".join(named or ["no rank named"]) + f" ({rest})"


def describe_event(event: Event) -> str | None:
    """One line for the launcher's log, or None for events not worth showing."""
    kind, d = event.kind, event.detail
    where = " ".join(
        f"{k} {v}" for k, v in (("node", event.node), ("rank", event.rank)) if v is not None
    )
    text = {
        "fault": lambda: f"FAULT {d.get('fault')} {where} at step {d.get('step')}: " + _fault(d),
        "evict": lambda: f"evicted {where}: {d.get('reason')}",
        "straggler": lambda: (
            f"straggler {where}: {d.get('score')}x the others' compute time ({d.get('action')})"
        ),
        "selfcheck": lambda: (
            f"self-check {where}: {'pass' if d.get('ok') else 'FAIL'} ({d.get('detail', '')[:120]})"
        ),
        "generation_start": lambda: (
            f"generation {event.generation} starts on "
            f"{d.get('nodes')}" + (f", replacing {d.get('replaced')}" if d.get("replaced") else "")
        ),
        "generation_running": lambda: f"generation {event.generation} running",
        "all_stopped": lambda: "all workers stopped",
        "finished": lambda: f"training finished at step {d.get('step')}",
        "failed": lambda: f"job FAILED: {d.get('reason')}",
        "elastic": lambda: str(d.get("text")),
        "checkpoint_fallback": lambda: f"checkpoint fallback {where}: {d.get('text', '')[-160:]}",
        "etcd_unavailable": lambda: "etcd unavailable",
        "etcd_recovered": lambda: f"etcd back after {d.get('down_s')} s",
        "controller_takeover": lambda: f"{d.get('controller')} took over as controller",
        "node_lost": lambda: f"node lost: {where} ({d.get('reason')})",
        "resumed": lambda: (
            f"generation {event.generation} resumed from "
            + d.get("text", "").rsplit("resumed from ", 1)[-1]
        ),
    }.get(kind)
    return text() if text else None


class Monitor:
    """The launcher's loop: progress and decisions to the log, launcher-side faults fired."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.run_dir = cluster.run_dir
        self.events = Tail(self.run_dir / "events.jsonl")
        self.metrics = Tail(self.run_dir / "metrics.jsonl")
        self.restart_after_loss: set[str] = set()
        self.steps = cluster.job.train.steps
        self.log_interval = max(1, cluster.job.train.log_interval)
        self.shown = 0.0  # time of the last metrics line shown
        self.supervisor = Supervisor(cluster)
        self.reason: str | None = None  # why the job was stopped, when the launcher stopped it
        self.paused: list[tuple[float, int]] = []  # (when to SIGCONT, pid): pause-controller

    def run(self, deadline: float | None) -> str:
        """Poll until the job is finished or failed; returns its state ("timeout" if not)."""
        try:
            return self._poll(deadline)
        finally:
            self._resume_paused(force=True)

    def _poll(self, deadline: float | None) -> str:
        polls = 0
        while deadline is None or time.monotonic() < deadline:
            self._show()
            self._fire(current_step(self.run_dir / "metrics.jsonl"))
            self._resume_paused()
            self._restart_lost_agents()
            polls += 1
            if polls % 5 == 0:
                state = self.cluster.job_state()
                if state in ("finished", "failed"):
                    self._show()
                    return state
                # first: a moved run directory is also why a controller that wrote there died
                moved = runfiles.run_dir_moved(self.run_dir)
                if moved:  # the job stops; nothing more is written at the path
                    logger.error("stopping the job: %s", moved)
                    self.reason = moved
                    return "failed"
                self.reason = self.supervisor.check()  # etcd or controller restarted, or why not
                if self.reason:  # logged by the supervisor
                    return "failed"
            time.sleep(0.05)
        logger.error("timed out")
        return "timeout"

    def _show(self) -> None:
        for m in read_metrics(self.metrics.lines()):
            if (m.time or 0.0) <= self.shown:
                continue  # kept lines of a metrics.jsonl rewritten by a restart
            self.shown = m.time or 0.0
            if m.step % self.log_interval == 0 or m.step == self.steps:
                logger.info(
                    "step %d/%d loss %.4f %.0f tok/s", m.step, self.steps, m.loss, m.tokens_per_s
                )
        for line in self.events.lines():
            try:
                text = describe_event(Event.from_json(line))
            except ValueError:  # a torn line (MessageError is one too)
                continue
            if text:
                logger.info("%s", text)

    def _fire(self, step: int) -> None:
        for spec in self.cluster.opts.faults:
            if spec.side != "launcher" or step < spec.get("step"):
                continue
            if spec.kind in ("kill-controller", "pause-controller"):
                pid = self._leader_pid()
                if pid is None or not inject.claim(self.run_dir, spec, step=step, pid=pid):
                    continue
                if spec.kind == "kill-controller":
                    os.kill(pid, signal.SIGKILL)
                else:  # frozen past its lease: a standby leads when it wakes up
                    os.kill(pid, signal.SIGSTOP)
                    self.paused.append((time.monotonic() + float(spec.get("seconds")), pid))
            elif not inject.claim(self.run_dir, spec, step=step):
                continue
            elif spec.kind == "kill-agent":
                node = f"node-{spec.get('node')}"
                proc = self.cluster.agents[node]
                os.kill(proc.pid, signal.SIGKILL)
                if (
                    not self.cluster.opts.spares
                    and self.cluster.job.fault_tolerance.policy == "wait"
                ):
                    self.restart_after_loss.add(node)  # repaired: comes back while it is awaited
            elif spec.kind == "etcd-restart":
                self.cluster.etcd.restart(downtime_s=float(spec.get("downtime", 1.0)))
            elif spec.kind == "forge-command":
                self._forge_stop()

    def _forge_stop(self) -> None:
        """The ``forge-command`` fault: a ``stop`` of a generation far beyond the controller's,
        written with the job's own credentials to every node's command key."""
        from megascale.etcd.keys import make_command

        for node in self.cluster.agents:
            forged = make_command(self.cluster.opts.job_id, 999999, "stop", f"forged-{node}")
            self.cluster.store.put(self.cluster.keys.command(node), forged)
        logger.warning("forged stop commands of generation 999999 written")

    def _resume_paused(self, force: bool = False) -> None:
        """SIGCONT the processes ``pause-controller`` stopped, once due (all with ``force``)."""
        now = time.monotonic()
        due = [pid for at, pid in self.paused if force or at <= now]
        self.paused = [(at, pid) for at, pid in self.paused if pid not in due]
        for pid in due:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def _leader_pid(self) -> int | None:
        from megascale.etcd.store import StoreError

        try:
            kv = self.cluster.store.get(self.cluster.keys.controller_leader)
        except StoreError:
            return None
        pid = kv.json().get("pid") if kv is not None else None
        ours = {p.pid for p in self.cluster.controllers.values()}
        return pid if pid in ours else None

    def _restart_lost_agents(self) -> None:
        from megascale.etcd.store import StoreError

        for node in sorted(self.restart_after_loss):
            try:
                gone = self.cluster.store.get(self.cluster.keys.node(node)) is None
            except StoreError:
                continue
            if gone and self.cluster.job_state() == "restarting":  # the controller waits for it
                self.restart_after_loss.discard(node)
                self.cluster.agents[node].join()
                logger.info("%s is back (its agent restarted after the node was lost)", node)
                self.cluster.start_agent(node)
