"""Real stalls for the stall analysis's matrix: one short training run per cell (a layout, a rank,
a way that rank stops), read from outside as the node agent reads the flight files.

A cell forks its ranks from the test process (megatron-core imported once, as in ``harness``),
trains the tiny preset in the NCCL-like mode (or blocking gloo), lets the fault fire on one rank
before step 2 and waits until every flight file stops changing with some rank blocked or stopped:
the stall as the agent would see it at its timeout. The states are then kept (as the agents'
heartbeats carry them, JSON) and every rank is killed. Ways a rank stops:

* ``hang-comm``: the real injection; its communication stops while its host goes on issuing;
* ``hang-worker``: the real injection; SIGSTOP (the whole process stops);
* ``mismatch-comm``: the real injection; its first collective of the step has twice the size;
* ``hang-host``: its host stops before the step (a loop that never returns) and never enters the
  step's collectives; its communication threads stay alive and finish what was issued.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import megatron.core  # noqa: F401  (import once, before forking)
from harness import with_changes

from megascale.config import load, validate
from megascale.data.corpus import default_token_file
from megascale.launcher.local import run_local
from megascale.probes import inject
from megascale.probes.flight.format import RankState, flight_path, last_state
from megascale.train.run import run_rank

KINDS = ("hang-comm", "hang-worker", "mismatch-comm", "hang-host")
STEP = 2  # the step before which the fault fires (step 1 warms every path up)
QUIET_S = 1.0  # no flight file changed for this long, some rank blocked or stopped: stalled


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    sp: bool = False
    distributed_optimizer: bool = True
    overlap_dp: bool = True
    world: int = 4
    """Ranks; what tp x pp leaves is data parallel."""

    def job(self, data_dir: Path, nccl_like: bool = True):
        job = with_changes(
            load("tiny"),
            parallel={
                "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "sequence_parallel": self.sp,
                "distributed_optimizer": self.distributed_optimizer,
                "async_collectives": nccl_like,
            },
            overlap={"dp": self.overlap_dp},
            data={"path": str(default_token_file(data_dir))},
            optim={"warmup_steps": 1},
            train={"steps": STEP + 1, "log_interval": 1},
            checkpoint={"interval": 0},
        )  # fmt: skip
        return validate(job, self.world, "gloo")


def _stuck_host(rank: int) -> None:
    """``hang-host``: this rank's host never returns from before_step(STEP)."""
    original = inject.WorkerFaults.before_step

    def before_step(self, step: int) -> None:
        if step == STEP and self.rank == rank:
            (self.run_dir / "stuck").touch()
            while True:
                time.sleep(1)
        original(self, step)

    inject.WorkerFaults.before_step = before_step


def _rank(job, run_dir: Path, kind: str, rank: int, spec: str):
    os.environ[inject.ENV] = spec  # this forked rank's faults (cells may run side by side)
    if kind == "hang-host":
        _stuck_host(rank)
    return run_rank(job, run_dir)


def stall(layout: Layout, rank: int, kind: str, data_dir: Path, run_dir: Path,
          nccl_like: bool = True, timeout_s: float = 60.0) -> dict[int, RankState]:  # fmt: skip
    """Run one cell for real; the ranks' states once stalled (as heartbeats carry them)."""
    job = layout.job(data_dir, nccl_like)
    world = layout.world
    spec = "" if kind == "hang-host" else f"{kind}:rank={rank},step={STEP}"
    outcome: dict = {}

    def ranks() -> None:
        try:
            outcome["results"] = run_local(
                _rank, world, (job, run_dir, kind, rank, spec), timeout_s=timeout_s + 60
            )
        except BaseException as e:  # noqa: BLE001 - the ranks are killed once read
            outcome["error"] = e

    thread = threading.Thread(target=ranks, daemon=True)
    thread.start()
    paths = [flight_path(run_dir, r) for r in range(world)]
    states: dict[int, RankState] = {}
    try:
        deadline, previous, quiet_since = time.monotonic() + timeout_s, None, 0.0
        while time.monotonic() < deadline and not outcome:
            time.sleep(0.1)
            if not all(p.exists() for p in paths):
                continue
            try:
                states = {r: last_state(p) for r, p in enumerate(paths)}
            except ValueError:
                continue  # a file being created
            snapshot = json.dumps({r: s.to_json() for r, s in states.items()}, sort_keys=True)
            now = time.monotonic()
            if snapshot != previous:
                previous, quiet_since = snapshot, now
                continue
            fired = (run_dir / "stuck").exists() or inject.fired(run_dir)
            stuck = any(s.blocked or s.stopped for s in states.values())
            if fired and stuck and any(s.step >= STEP for s in states.values()):
                if now - quiet_since >= QUIET_S:
                    break
        else:
            raise AssertionError(f"{layout.name} {kind} rank {rank}: no stall seen ({outcome})")
    finally:
        for state in states.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(state.pid, signal.SIGKILL)
        thread.join(timeout=30)
    return {r: RankState.from_json(json.loads(json.dumps(s.to_json()))) for r, s in states.items()}
