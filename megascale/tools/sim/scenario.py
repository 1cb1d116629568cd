"""Control plane at scale, simulated on one machine: N node agents against a real etcd and the real
controller process.

What is real and what is simulated:

* etcd: a real etcd 3.5 (``EmbeddedEtcd``), talked to over its v3 JSON gateway by ``Store``.
* controller: the real ``megascale controller`` process (``ControllerService`` around the FSM),
  with its production timeouts for the given heartbeat interval (``service.policy_for``).
* agents: the real ``Agent`` class -- registration under a lease, keep-alive, heartbeat payload
  and loop, command watch, command execution and acks, job-status watch -- many per process,
  either as the agent's own threads (``agents="threads"``: ``agents_main``, five threads a node)
  or driven by coroutines on one event loop (``agents="asyncio"``: ``AsyncSimAgent`` in
  ``tools.sim.agents_async``, the same etcd requests; hundreds of nodes per process). Only the workers
  are simulated (``SimPool``: no processes; a self-check passes at once), so a "node" costs the
  control plane what a real one does.
* a node killed at a random moment (``SimAgent.kill``): it stops heartbeating and its lease is no
  longer kept alive -- a machine that vanished, not an agent that shut down politely.

``run_scenario`` measures, for one N: the etcd write rate (revisions per second) and the
controller's and etcd's CPU (process CPU time / wall) in steady state, then per kill the
kill-to-decision latency (the controller's ``fault`` event), the time to stop all nodes
(``all_stopped``) and to get generation G+1 running (``generation_running``).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megascale.controller.events import EVENTS_FILE, read_events
from megascale.etcd.keys import JobKeys
from megascale.etcd.store import Store, StoreConfig
from megascale.messages import ControllerState, Event
from megascale.tools.sim.agents import agents_main
from megascale.tools.sim.agents_async import async_agents_main

logger = logging.getLogger(__name__)

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class ScenarioResult:
    """What ``run_scenario`` measured for one N (times in seconds)."""

    nodes: int
    heartbeat_s: float
    writes_per_s: float = 0.0
    controller_cpu: float = 0.0
    etcd_cpu: float = 0.0
    agents_cpu: float = 0.0
    first_start_s: float = 0.0
    detect_s: list[float] = field(default_factory=list)
    stop_s: list[float] = field(default_factory=list)
    restart_s: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _wait_event(
    run_dir: Path, kind: str, generation: int, timeout_s: float, node: str | None = None
) -> Event | None:
    """The first ``kind`` event of ``generation`` or later (about ``node``, when given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ev in read_events(run_dir) if (run_dir / EVENTS_FILE).exists() else ():
            if ev.kind == kind and ev.generation >= generation:
                if node is None or ev.node == node:
                    return ev
        time.sleep(0.1)
    return None


def _recv(pipe: Any, timeout_s: float, what: str) -> Any:
    """The next message on ``pipe``; ``RuntimeError`` naming ``what`` when a simulator process
    died or said nothing for ``timeout_s`` (instead of waiting for ever)."""
    try:
        if pipe.poll(timeout_s):
            return pipe.recv()
    except (EOFError, OSError):
        pass
    raise RuntimeError(f"simulator process gave no {what} within {timeout_s:.0f} s")


AGENT_KINDS = ("asyncio", "threads")
"""How ``run_scenario`` runs its simulated agents (see the module docstring)."""


def _agents_main(agents: str) -> Any:
    """The function a simulator process runs for ``agents`` (one of ``AGENT_KINDS``)."""
    if agents == "threads":
        return agents_main
    if agents == "asyncio":
        return async_agents_main
    raise ValueError(f"agents = {agents!r}: expected one of {', '.join(AGENT_KINDS)}")


def run_scenario(
    endpoint: str,
    etcd_pid: int,
    run_dir: Path,
    nodes: int,
    *,
    heartbeat_s: float = 1.0,
    kills: int = 3,
    processes: int = 4,
    steady_s: float = 10.0,
    nproc_per_node: int = 8,
    seed: int = 0,
    agents: str = "threads",
) -> ScenarioResult:
    """Start the controller and ``nodes + kills`` agents (the extra are spares) in ``processes``
    processes, as ``agents`` (``AGENT_KINDS``), measure steady state for ``steady_s``, then kill
    ``kills`` nodes one at a time at random moments. Each call is a job of its own in etcd."""
    target = _agents_main(agents)
    job = f"sim-{nodes}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir(parents=True, exist_ok=True)
    result = ScenarioResult(nodes, heartbeat_s)
    rng = random.Random(seed)
    ctl = subprocess.Popen(
        [sys.executable, "-m", "megascale.cli", "controller", "--job", job, "--run-dir",
         str(run_dir), "--nodes", str(nodes), "--nproc-per-node", str(nproc_per_node),
         "--tp", str(nproc_per_node), "--heartbeat-interval", str(heartbeat_s),
         "--max-restarts", str(kills + 5), "--endpoints", endpoint],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    names = [f"node-{i:05d}" for i in range(nodes + kills)]
    ctx = mp.get_context("fork")
    procs, pipes, where = [], [], {}
    t0 = time.time()
    try:
        for p in range(processes):
            mine = names[p::processes]
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=target,
                args=(endpoint, job, mine, heartbeat_s, str(run_dir), child),
            )
            proc.start()
            child.close()  # the child's end lives in the child only: its death reads as EOF
            procs.append(proc)
            pipes.append(parent)
            where.update({n: p for n in mine})
        for pipe in pipes:
            _recv(pipe, 120, "ready")
        running = _wait_event(run_dir, "generation_running", 1, 60 + nodes / 10)
        if running is None:
            result.notes.append("generation 1 never ran")
            return result
        result.first_start_s = running.time - t0
        _steady(result, ctl.pid, etcd_pid, [p.pid for p in procs], endpoint, steady_s)
        _kill_nodes(result, endpoint, job, run_dir, kills, rng, pipes, where)
    finally:
        try:
            for pipe in pipes:
                with suppress(OSError):  # that process has died already
                    pipe.send(("exit",))
            for proc in procs:
                proc.join(15)
                if proc.is_alive():
                    proc.kill()
        finally:
            ctl.send_signal(signal.SIGTERM)
            try:
                ctl.wait(10)
            except subprocess.TimeoutExpired:
                ctl.kill()
    return result


def _kill_nodes(
    result: ScenarioResult,
    endpoint: str,
    job: str,
    run_dir: Path,
    kills: int,
    rng: random.Random,
    pipes: list,
    where: dict[str, int],
) -> None:
    """Kill ``kills`` nodes of the running generation one at a time, each at a random moment,
    and record how long detection, stopping and restarting took (a note when one never
    recovered, which ends the series)."""
    heartbeat_s = result.heartbeat_s
    store = Store(StoreConfig.parse(endpoint))
    for k in range(kills):
        time.sleep(rng.uniform(2.0, 2.0 + heartbeat_s))
        state = ControllerState.decode(store.get(JobKeys(job).state).json())
        generation = state.generation
        victim = rng.choice(state.order)
        pipes[where[victim]].send(("kill", victim))
        killed_at = _recv(pipes[where[victim]], 30, "kill time")[1]
        fault = _wait_event(run_dir, "fault", generation, 60, node=victim)
        stopped = _wait_event(run_dir, "all_stopped", generation, 120)
        back = _wait_event(run_dir, "generation_running", generation + 1, 180)
        if fault is None or stopped is None or back is None:
            result.notes.append(f"kill {k}: no recovery (fault={fault is not None})")
            break
        result.detect_s.append(fault.time - killed_at)
        result.stop_s.append(stopped.time - fault.time)
        result.restart_s.append(back.time - stopped.time)
        logger.info("N=%d kill %d: %s", result.nodes, k, fault.detail)
    store.close()


def _steady(
    result: ScenarioResult, ctl: int, etcd: int, agents: list[int], endpoint: str, seconds: float
) -> None:
    store = Store(StoreConfig.parse(endpoint))
    pids = [ctl, etcd, *agents]
    cpu0, rev0, t0 = [cpu_seconds(p) for p in pids], store.snapshot("/").revision, time.time()
    time.sleep(seconds)
    cpu1, rev1, t1 = [cpu_seconds(p) for p in pids], store.snapshot("/").revision, time.time()
    store.close()
    wall = t1 - t0
    used = [(b - a) / wall for a, b in zip(cpu0, cpu1, strict=True)]
    result.controller_cpu, result.etcd_cpu, result.agents_cpu = used[0], used[1], sum(used[2:])
    result.writes_per_s = (rev1 - rev0) / wall


def decision_bytes(nodes: int, nproc_per_node: int = 8) -> dict[str, int]:
    """What the controller writes when generation 1 starts on ``nodes`` nodes, in JSON bytes
    (before the gateway's base64): the FSM ``state`` snapshot, the ``status`` agents watch, one
    ``start`` command, and all of them."""
    from megascale.controller.fsm import ControllerFSM, SendCommand
    from megascale.controller.policy import policy_for

    fsm = ControllerFSM(policy_for(nodes, nproc_per_node, tp=nproc_per_node), 0.0)
    fsm.on_start(0.0)
    actions = []
    for i in range(nodes):
        actions += fsm.on_node_registered(f"node-{i:05d}", 0.0)
    sizes = [
        len(json.dumps(a.message("job").encode())) for a in actions if isinstance(a, SendCommand)
    ]
    status = {"state": fsm.state.value, "generation": fsm.generation}
    return {
        "snapshot": len(json.dumps(fsm.snapshot())),
        "status": len(json.dumps(status)),
        "start_command": sizes[0],
        "start_txn": sum(sizes),
        "commands": len(sizes),
    }


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def as_row(r: ScenarioResult) -> dict[str, Any]:
    """One table row of ``r``."""
    return {
        "nodes": r.nodes,
        "gpus": r.nodes * 8,
        "writes/s": round(r.writes_per_s, 1),
        "ctl cpu": round(r.controller_cpu, 3),
        "etcd cpu": round(r.etcd_cpu, 3),
        "agents cpu": round(r.agents_cpu, 2),
        "detect p50": round(percentile(r.detect_s, 0.5), 2),
        "detect max": round(max(r.detect_s, default=float("nan")), 2),
        "stop all": round(percentile(r.stop_s, 0.5), 2),
        "restart G+1": round(percentile(r.restart_s, 0.5), 2),
        "kills": len(r.detect_s),
        "notes": "; ".join(r.notes),
    }


__all__ = [
    "AGENT_KINDS",
    "ScenarioResult",
    "as_row",
    "cpu_seconds",
    "decision_bytes",
    "percentile",
    "run_scenario",
]
