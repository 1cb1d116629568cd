"""In-process recovery, the node agent's side (the worker's: ``megascale.train.resident``).

``stop`` pauses the node's workers instead of ending them: ``SIGUSR1`` to each, then a wait until
each has written ``paused_rank_NNNNN.json`` in the node's rejoin directory
(``RUN_DIR/rejoin/<node>/``) or exited. One that cannot pause (stopped by a signal, wedged: not
paused within ``fault_tolerance.pause_timeout_s``) is killed; its rank comes back as a new process.
A ``stop`` may bound the wait (``Command.pause_wait_s``): after a fault that leaves ranks blocked
in a collective that cannot complete (a node lost or silent, a stall), a blocked rank never returns
to Python to pause (gloo waits out its own timeout), while one between collectives pauses within
one operation.
``start`` lets the paused workers rejoin: it writes ``generation_G.json`` (the generation's
rendezvous environment) there and forks new workers for the node's other ranks only. When the
paused workers cannot rejoin as they are (the node got other ranks, or the world size changed:
a shrink or a grow), they are stopped and every rank starts afresh, from the last checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

from megascale import runfiles
from megascale.agent.workers import Worker, WorkerPool
from megascale.train.resident import PAUSE_SIGNAL, paused_path, rejoin_path

logger = logging.getLogger("megascale.agent.service")


def rejoin_dir(run_dir: Path, node: str) -> Path:
    return Path(run_dir) / "rejoin" / node


def _paused_record(directory: Path, worker: Worker) -> dict | None:
    try:
        record = json.loads(paused_path(directory, worker.rank).read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("pid") == worker.pid else None


def _cannot_pause(pid: int) -> bool:
    """Stopped (``SIGSTOP``) or traced: it runs no signal handler until continued."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def pause(pool: WorkerPool, directory: Path, timeout_s: float) -> tuple[list[int], list[int]]:
    """Pause every live worker of ``pool`` (see the module); (paused ranks, killed ranks)."""
    live = pool.running()
    for worker in live:
        try:
            os.kill(worker.pid, PAUSE_SIGNAL)
        except ProcessLookupError:
            pass
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    waiting = list(live)
    while waiting:
        still = []
        for worker in waiting:
            if not worker.alive or _paused_record(directory, worker) is not None:
                continue
            if _cannot_pause(worker.pid) or time.monotonic() > deadline:
                _kill(worker)
                killed.append(worker.rank)
                continue
            still.append(worker)
        waiting = still
        if waiting:
            time.sleep(0.005)
    if killed:
        pool.wait_exited([w.pid for w in live if w.rank in killed], 5.0)
        logger.warning("ranks %s could not pause in %.1f s: killed", killed, timeout_s)
    paused = [w.rank for w in live if w.alive and w.rank not in killed]
    return sorted(paused), sorted(killed)


def _kill(worker: Worker) -> None:
    try:
        os.kill(worker.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def paused_workers(pool: WorkerPool, directory: Path) -> dict[int, tuple[Worker, dict]]:
    """rank -> (worker, its paused record), of the live workers that are paused."""
    found = {}
    for worker in pool.running():
        record = _paused_record(directory, worker)
        if record is not None:
            found[worker.rank] = (worker, record)
    return found


def rejoin(
    pool: WorkerPool,
    directory: Path,
    generation: int,
    ranks: list[int],
    env: Mapping[str, str],
    argv: list[str],
    nice: int = 0,
) -> tuple[list[int], list[int]]:
    """Start ``generation`` on this node: its paused workers rejoin, the others are forked;
    (rejoined ranks, new ranks). Paused workers that cannot rejoin as they are are stopped."""
    paused = paused_workers(pool, directory)
    world = int(env["WORLD_SIZE"])
    usable = {
        rank: worker
        for rank, (worker, record) in paused.items()
        if rank in ranks and record.get("world") == world and worker.local_rank == ranks.index(rank)
    }
    if len(usable) != len(paused):
        reason = f"{sorted(set(paused) - set(usable))} cannot rejoin as they are"
        logger.warning("generation %d: paused ranks %s: stopping them", generation, reason)
        usable = {}
    pool.stop(keep=frozenset(usable))
    for old in directory.glob("generation_*.json"):
        old.unlink(missing_ok=True)
    if usable:
        runfiles.make_dir(directory)
        runfiles.write_text(
            rejoin_path(directory, generation), json.dumps({"generation": generation, "env": env})
        )
    pool.start(generation, ranks, env, argv, nice, keep=usable)
    return sorted(usable), sorted(r for r in ranks if r not in usable)
