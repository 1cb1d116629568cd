"""This node's worker processes: forked by the zygote (``megascale.agent.zygote``), watched,
stopped, their output scanned.

Process tree and lifetimes: agent -> zygote -> workers. The zygote dies with the agent
(``PR_SET_PDEATHSIG``) and kills its workers when its pipe to the agent closes; each worker dies
with the zygote. So a SIGKILLed agent (a lost node) takes its workers with it, as a lost machine
would, and nothing is left orphaned. A zygote killed on its own (the OOM killer) takes the workers
with it too: the pool reports their exits (SIGKILL) and a ``zygote_died`` error, this node's fault
and not a peer's, and later forks (the self-check) fail naming it.

Output: each worker's stdout and stderr go to ``RUN_DIR/logs/<node>/rank_NNNNN.out`` (appended,
one header line per generation). A ``LogScanner`` (``megascale.agent.logscan``) reads the new
bytes of those files for error keywords, a peer's failure and notices.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megascale import runfiles
from megascale.agent.logscan import LogMatch, LogScanner
from megascale.agent.zygote import Zygote
from megascale.launcher.local import free_port

logger = logging.getLogger(__name__)


# -- the pool -------------------------------------------------------------------------------------


@dataclass
class Worker:
    rank: int
    local_rank: int
    generation: int
    pid: int
    log: Path
    started: float
    exit_code: int | None = None
    scanner: LogScanner | None = field(default=None, repr=False)

    @property
    def alive(self) -> bool:
        return self.exit_code is None

    def status(self) -> dict[str, Any]:
        peer = bool(self.scanner and self.scanner.peer_failure)
        return {"pid": self.pid, "alive": self.alive, "exit_code": self.exit_code, "peer": peer}


class WorkerPool:
    """Starts, watches and stops one generation of this node's workers.

    ``on_change()`` is called (from the zygote reader thread) whenever a worker exits, so the
    agent can report it at once instead of at its next heartbeat.
    """

    def __init__(
        self, zygote: Zygote, run_dir: Path, node: str, on_change: Callable[[], None]
    ) -> None:
        self.zygote, self.run_dir, self.node = zygote, Path(run_dir), node
        self.own_paths = (str(run_dir), str(self.run_dir), str(self.run_dir.resolve()))
        """Paths of this job that worker output names: never read as error keywords."""
        self.on_change = on_change
        self.workers: dict[int, Worker] = {}  # global rank -> worker (current generation)
        self._by_pid: dict[int, Worker] = {}
        self._checks: dict[int, int | None] = {}  # self-check pid -> exit code
        self._unclaimed: dict[int, int] = {}  # exits reported before spawn() returned the pid
        self._lock = threading.Lock()
        self._exited = threading.Condition(self._lock)
        self._lost: list[tuple[Worker, LogMatch]] = []  # reported by the next scan
        zygote.on_exit = self._on_exit
        zygote.on_death = self._on_zygote_death

    def log_path(self, rank: int) -> Path:
        return self.run_dir / "logs" / self.node / f"rank_{rank:05d}.out"

    def start(
        self,
        generation: int,
        ranks: list[int],
        env: Mapping[str, str],
        argv: list[str],
        nice: int = 0,
        keep: Mapping[int, Worker] | None = None,
    ) -> list[Worker]:
        """Fork one worker per global rank in ``ranks`` (local rank = position in the list);
        ``env`` is the common torchrun-style environment (WORLD_SIZE, MASTER_ADDR, ...). The
        previous generation's workers must be stopped, but for those in ``keep`` (rank ->
        worker; in-process recovery), which join ``generation`` as they are."""
        keep = dict(keep or {})
        with self._lock:
            self.workers = {}
            for rank, worker in keep.items():
                worker.generation = generation
                if worker.scanner is not None:  # the last generation's peer failure is over
                    worker.scanner.peer_failure = False
                self.workers[rank] = worker
        started = []
        for local_rank, rank in enumerate(ranks):
            log = self.log_path(rank)
            runfiles.make_dir(log.parent)
            with runfiles.open_append(log) as f:
                kept = f" (rejoins, pid {keep[rank].pid})" if rank in keep else ""
                f.write(
                    f"==== megascale generation {generation} rank {rank}{kept} {time.ctime()}\n"
                )
            if rank in keep:
                continue
            scanner = LogScanner(log, paths=self.own_paths)
            worker_env = {
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(len(ranks)),
            }
            pid = self._spawn("train", {"argv": argv}, worker_env, log, nice)
            worker = Worker(rank, local_rank, generation, pid, log, time.time(), None, scanner)
            with self._lock:
                self.workers[rank] = worker
                if pid in self._unclaimed:
                    worker.exit_code = self._unclaimed.pop(pid)
                else:
                    self._by_pid[pid] = worker
            started.append(worker)
        logger.info(
            "generation %d: started ranks %s (pids %s)",
            generation,
            ranks,
            [w.pid for w in started],
        )
        return started

    def _spawn(self, target: str, kwargs: dict, env: Mapping[str, str], log: Path, nice: int = 0):
        """Fork through the zygote (never under ``_lock``: its reader thread takes the lock to
        report exits, and must be free to deliver the reply)."""
        return self.zygote.spawn(target, kwargs, env, log, nice)

    def _on_exit(self, pid: int, code: int) -> None:
        with self._lock:
            worker = self._by_pid.pop(pid, None)
            if pid in self._checks:
                self._checks[pid] = code
            elif worker is not None:
                worker.exit_code = code
            else:
                self._unclaimed[pid] = code
            self._exited.notify_all()
        if worker is not None:
            level = logging.INFO if code == 0 else logging.WARNING
            logger.log(level, "rank %d (pid %d) exited with code %d", worker.rank, pid, code)
            self.on_change()

    def _on_zygote_death(self, detail: str) -> None:
        """The zygote died: every worker and self-check process it had forked was SIGKILLed
        with it. Their exits, and one ``zygote_died`` error per worker, are this node's."""
        with self._lock:
            lost = list(self._by_pid.values())
            self._by_pid.clear()
            for worker in lost:
                worker.exit_code = -signal.SIGKILL
                self._lost.append((worker, LogMatch("zygote_died", detail)))
            for pid, code in self._checks.items():
                if code is None:
                    self._checks[pid] = -signal.SIGKILL
            self._exited.notify_all()
        if lost:
            self.on_change()

    def wait_exited(self, pids: list[int], timeout_s: float) -> bool:
        with self._exited:
            return self._exited.wait_for(
                lambda: not any(p in self._by_pid for p in pids), timeout_s
            )

    def running(self) -> list[Worker]:
        with self._lock:
            return [w for w in self.workers.values() if w.alive]

    def stop(
        self, grace_s: float = 3.0, keep: frozenset[int] = frozenset()
    ) -> dict[int, int | None]:
        """Stop every live worker but those of the ranks in ``keep``: SIGCONT (a stopped one),
        SIGTERM, SIGKILL after ``grace_s``. Returns rank -> exit code."""
        live = [w for w in self.running() if w.rank not in keep]
        for sig, wait in ((signal.SIGCONT, 0.0), (signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            for worker in live:
                if worker.alive:
                    try:
                        os.kill(worker.pid, sig)
                    except ProcessLookupError:
                        pass
            if wait and self.wait_exited([w.pid for w in live], wait):
                break
        return {w.rank: w.exit_code for w in self.workers.values()}

    def selfcheck(
        self,
        nproc: int,
        full: bool = False,
        timeout_s: float = 120.0,
        thresholds: str | None = None,
        neighbours: dict[str, Any] | None = None,
        tests: list[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> tuple[bool, str, list[str]]:
        """Run the node self-check: the built-in one (``selfcheck.builtin.selfcheck_rank``) as ``nproc`` processes,
        with ``full`` the diagnostics one (``run_selfcheck_full``, held to the ``thresholds``
        file when given, of the checks ``tests`` selects), and with ``neighbours``
        (``run_selfcheck_neighbours``'s arguments but ``out``) the neighbour all-reduces, all
        beside each other; (ok, detail, the neighbours the node suspects: ``neighbours.suspected``).
        ``env``: set in every check process on top of the
        agent's environment; the node's ``CUDA_VISIBLE_DEVICES``, so that the check runs on the
        GPUs the node's workers get (without it, on every GPU of the machine)."""
        port, out_dir = free_port(), self.run_dir / "selfcheck"
        runfiles.make_dir(out_dir)
        log = self.run_dir / "logs" / self.node / "selfcheck.out"
        common = {"world_size": nproc, "port": port, "run_dir": str(self.run_dir)}
        jobs = [("selfcheck", {"rank": rank, **common}) for rank in range(nproc)]
        if full:
            full_args = {"node": self.node, "run_dir": str(self.run_dir), "thresholds": thresholds}
            jobs.append(("selfcheck_full", {**full_args, "tests": list(tests or [])}))
        if neighbours:
            jobs.append(("selfcheck_neighbours", neighbours))
        outs = {}
        for i, (target, kwargs) in enumerate(jobs):
            out = out_dir / f"{self.node}_{i}.json"
            out.unlink(missing_ok=True)
            pid = self._spawn(target, {**kwargs, "out": str(out)}, dict(env or {}), log)
            with self._lock:
                self._checks[pid] = self._unclaimed.pop(pid, None)
            outs[pid] = out
        with self._exited:
            done = self._exited.wait_for(
                lambda: all(self._checks[p] is not None for p in outs), timeout_s
            )
            codes = {p: self._checks.pop(p) for p in outs}
        for pid, code in codes.items():
            if code is None:
                os.kill(pid, signal.SIGKILL)
        details, suspects = [], []
        for pid, out in outs.items():
            try:
                result = json.loads(out.read_text())
                details.append(f"{result['detail']} in {result['seconds']} s")
                suspects += [str(n) for n in result.get("suspects", ())]
            except (OSError, ValueError, KeyError):
                details.append(f"process {pid} exited with {codes[pid]} and no result")
        ok = done and all(code == 0 for code in codes.values())
        detail = "; ".join(sorted(set(details)))
        return ok, detail if done else f"timed out after {timeout_s} s: {detail}", suspects

    def status(self, generation: int) -> dict[str, dict[str, Any]]:
        """rank -> pid, alive, exit code, peer failure; of ``generation``'s workers only."""
        with self._lock:
            workers = sorted(self.workers.items())
        return {str(r): w.status() for r, w in workers if w.generation == generation}

    def scan(self) -> list[tuple[Worker, LogMatch]]:
        """New error keywords and notices in the current workers' output (and the workers lost
        with the zygote)."""
        with self._lock:
            found, self._lost = self._lost, []
        for worker in list(self.workers.values()):
            if worker.scanner is None:
                continue
            matches = worker.scanner.scan() if worker.alive else worker.scanner.flush()
            found += [(worker, m) for m in matches]
        return found
