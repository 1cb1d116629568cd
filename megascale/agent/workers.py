"""This node's worker processes: forked by a zygote, watched, stopped, their output scanned.

Why a zygote: ``import megatron.core`` costs ~8 s per process on 2 cores, and a restart starts
every worker again. The agent forks one small single-threaded process, the zygote, before it starts
any thread; the zygote imports torch and megatron-core once (or inherits them, when the launcher
imported them before forking the agent) and then forks each worker on request, so a generation
starts in well under a second, in fresh processes (nothing leaks from a failed generation). A
worker is ``megascale train`` (``megascale.train.command.main``) under the torchrun-style
environment of its rank assignment; it is exactly what ``python -m megascale.cli train CONFIG``
runs, minus the import.

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

import gc
import importlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe
from multiprocessing.connection import wait as wait_ready
from pathlib import Path
from typing import Any

from megascale import gpus, runfiles
from megascale.agent.logscan import LogMatch, LogScanner
from megascale.launcher.lifetime import die_with_parent
from megascale.probes.fatal import RUN_DIR_ENV, write_exit_error

logger = logging.getLogger(__name__)

PRELOAD = (
    "megascale.train.command",
    "megascale.train.run",
    "megascale.launcher.job_store",
    "megatron.core.datasets.blended_megatron_dataset_builder",  # the data splits' (~20 ms)
    "megatron.core.datasets.gpt_dataset",
)
"""Modules the zygote imports once so that forked workers start without importing them (what
``train.run`` imports only when a rank builds its trainer included: a replacement rank's build
is on the recovery's path)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- what a forked child runs --------------------------------------------------------------------


def run_train(argv: list[str]) -> int:
    """A worker: ``megascale train ARGV`` under the rank environment the agent set."""
    from megascale.train.command import main

    return main(argv)


def run_selfcheck(rank: int, world_size: int, port: int, run_dir: str, out: str) -> int:
    """One process of the node self-check; writes its result as JSON to ``out``; exit 0 = pass."""
    from megascale.agent.selfcheck.builtin import selfcheck_rank

    result = selfcheck_rank(rank, world_size, port, Path(run_dir))
    runfiles.write_text(out, json.dumps(result))
    return 0 if result["ok"] else 1


def run_selfcheck_full(
    node: str, run_dir: str, out: str, thresholds: str | None = None, tests: list | None = None
) -> int:
    """The full node self-check (``megascale.agent.selfcheck``, quick profile), of the
    checks ``tests`` selects (``fault_tolerance.selfcheck_tests``; empty: all). Without a
    GPU its intra-node all-to-all is left out: it starts fresh interpreters (seconds of imports
    per node, all nodes at once on a local cluster), and the built-in check run beside it
    already all-reduces among the node's processes."""
    import torch

    from megascale.agent.selfcheck import SelfCheckOptions, run_selfcheck, selected_checks

    cuda = torch.cuda.is_available()
    only = [n for n in selected_checks(tests or []) if cuda or n != "net.intranode_alltoall"]
    start = time.perf_counter()
    options = SelfCheckOptions(
        quick=True, directory=run_dir, node=node, only=only, thresholds_file=thresholds
    )
    report = run_selfcheck(options)
    result = {
        "ok": report.ok,
        "detail": report.summary(),
        "seconds": round(time.perf_counter() - start, 3),
    }
    runfiles.write_text(out, json.dumps(result))
    return 0 if report.ok else 1


def run_selfcheck_neighbours(**kwargs: Any) -> int:
    """The neighbour all-reduces (``megascale.agent.neighbour_check``)."""
    from megascale.agent.neighbour_check import run_selfcheck_neighbours as run

    return run(**kwargs)


TARGETS: dict[str, Callable[..., int]] = {
    "train": run_train,
    "selfcheck": run_selfcheck,
    "selfcheck_full": run_selfcheck_full,
    "selfcheck_neighbours": run_selfcheck_neighbours,
}


# -- the zygote --------------------------------------------------------------------------------


def _child_exit_alarm() -> int:
    """A pipe's read end that becomes readable when a child of this process exits: SIGCHLD
    wakes the zygote's loop at once (it reaps, and the agent hears of a killed worker or a
    finished self-check without a polling interval's delay)."""
    read, write = os.pipe()
    for fd in (read, write):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)  # the wakeup fd needs a handler
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    return read


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _child(
    conn: Connection, zygote: int, target: str, kwargs: dict, env: dict, log: str, nice: int
) -> None:
    """In a freshly forked child of the zygote (pid ``zygote``): set up, run ``target``, exit
    (never returns). A zygote that died while forking takes the child with it all the same."""
    code: Any = 1
    try:
        die_with_parent(parent=zygote)
        conn.close()
        signal.set_wakeup_fd(-1)  # the zygote's child-exit alarm is not this process's
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent stops workers; Ctrl-C is its
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a pause before it can pause: ignored
        runfiles.make_dir(Path(log).parent)
        with runfiles.open_append(log) as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        os.environ.update(env)
        if nice:
            os.nice(nice)
        code = TARGETS[target](**kwargs)
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        traceback.print_exc()
        code = 1
        _record_exit_error(target, e)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def _record_exit_error(target: str, error: BaseException) -> None:
    """A training worker's uncaught exception, for the agent to report (``fatal.ExitError``)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if target != "train" or not run_dir:
        return
    try:
        write_exit_error(run_dir, int(os.environ.get("RANK", "0")), error)
    except (OSError, ValueError) as e:
        print(f"could not record the exit error: {e}", file=sys.stderr)


def _zygote_main(conn: Connection, preload: tuple[str, ...]) -> None:
    """The zygote's loop: fork on request, report every child's exit; exit when the agent goes."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gpus.prefer_nvml_checks()  # megatron-core / TE probe CUDA at import; the workers fork later
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as e:  # a worker will report the real error when it imports it
            conn.send(("log", f"preloading {name} failed: {e}"))
    if gpus.cuda_initialised():
        conn.send(("log", f"CUDA was initialised while preloading {preload}: workers forked "
                          "from the zygote cannot use their GPUs"))  # fmt: skip
    # What the imports made goes to the permanent generation: no collection in a worker walks
    # it again (a full one over torch's and megatron-core's ~440k objects takes ~0.6 s, and a
    # pausing rank runs one on the recovery's path), and the workers' pages stay shared.
    gc.collect()
    gc.freeze()
    children: set[int] = set()
    exits = _child_exit_alarm()
    try:
        while True:
            ready = wait_ready([conn, exits], 1.0)  # a request, or a child's exit (SIGCHLD)
            if exits in ready:
                _drain(exits)
            if conn in ready:
                op, *args = conn.recv()
                if op == "quit":
                    break
                if op == "spawn":
                    token, target, kwargs, env, log, nice = args
                    zygote, pid = os.getpid(), os.fork()
                    if pid == 0:
                        _child(conn, zygote, target, kwargs, env, log, nice)
                    children.add(pid)
                    conn.send(("spawned", token, pid))
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                children.discard(pid)
                conn.send(("exit", pid, os.waitstatus_to_exitcode(status)))
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # the agent is gone: so are its workers
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(0)


class Zygote:
    """The agent's handle on its zygote process (see the module docstring).

    Create it before the agent starts any thread (it forks). ``spawn`` returns the new child's
    pid; ``on_exit(pid, code)`` is called from a reader thread when a child ends (``code`` as
    ``Popen.returncode``: negative for a signal). ``on_death(detail)`` is called from that thread
    when the zygote itself dies unasked (killed: its children died with it); ``spawn`` then
    raises ``RuntimeError`` naming it.
    """

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        parent, child = Pipe()
        pid = os.fork()
        if pid == 0:
            parent.close()
            _zygote_main(child, preload)  # never returns
        child.close()
        self.pid, self.conn = pid, parent
        self.on_exit: Callable[[int, int], None] = lambda pid, code: None
        self.on_death: Callable[[str], None] = lambda detail: None
        self.died: str | None = None
        """Why the zygote is gone, when it died unasked; None while it lives."""
        self._closing = False
        self._send_lock = threading.Lock()
        self._replies: dict[int, int] = {}
        self._cond = threading.Condition()
        self._token = 0
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def spawn(
        self,
        target: str,
        kwargs: Mapping[str, Any],
        env: Mapping[str, str],
        log: Path,
        nice: int = 0,
        timeout_s: float = 30.0,
    ) -> int:
        """Fork a child running ``TARGETS[target](**kwargs)``; returns its pid."""
        with self._cond:
            if self.died is not None:
                raise RuntimeError(self.died)
            self._token += 1
            token = self._token
        try:
            with self._send_lock:
                self.conn.send(("spawn", token, target, dict(kwargs), dict(env), str(log), nice))
        except OSError as e:
            raise RuntimeError(self.died or f"the zygote (pid {self.pid}) is gone: {e}") from e
        with self._cond:
            if not self._cond.wait_for(
                lambda: token in self._replies or self.died is not None, timeout_s
            ):
                raise RuntimeError(f"the zygote (pid {self.pid}) did not fork in {timeout_s} s")
            if token not in self._replies:
                raise RuntimeError(self.died)
            return self._replies.pop(token)

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                if not self._closing:
                    self._died()
                return
            if message[0] == "spawned":
                with self._cond:
                    self._replies[message[1]] = message[2]
                    self._cond.notify_all()
            elif message[0] == "exit":
                self.on_exit(message[1], message[2])
            elif message[0] == "log":
                logger.warning("zygote: %s", message[1])

    def _died(self) -> None:
        """The pipe closed unasked: the zygote died (its children with it, ``PR_SET_PDEATHSIG``)."""
        code: int | str = "unknown"
        try:
            for _ in range(50):  # it has closed its end: it is exiting
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    code = os.waitstatus_to_exitcode(status)
                    break
                time.sleep(0.02)
        except ChildProcessError:
            pass
        with self._cond:
            self.died = f"the zygote (pid {self.pid}) died (exit code {code}), its workers with it"
            self._cond.notify_all()
        logger.error("%s", self.died)
        self.on_death(self.died)

    def close(self, timeout_s: float = 5.0) -> None:
        """End the zygote (it kills its children). A message, not just closing the pipe: the
        reader thread blocked in ``recv`` keeps the socket open."""
        self._closing = True
        try:
            with self._send_lock:
                self.conn.send(("quit",))
        except OSError:
            pass
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if os.waitpid(self.pid, os.WNOHANG)[0]:
                    return
                time.sleep(0.02)
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


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
