"""The agent's zygote: the process that forks this node's workers and self-check processes.

Why a zygote: ``import megatron.core`` costs ~8 s per process on 2 cores, and a restart starts
every worker again. The agent forks one small single-threaded process, the zygote, before it starts
any thread; the zygote imports torch and megatron-core once (or inherits them, when the launcher
imported them before forking the agent) and then forks each worker on request, so a generation
starts in well under a second, in fresh processes (nothing leaks from a failed generation). A
worker is ``megascale train`` (``megascale.train.command.main``) under the torchrun-style
environment of its rank assignment; it is exactly what ``python -m megascale.cli train CONFIG``
runs, minus the import. The zygote reaps its children as they exit (woken by ``SIGCHLD``) and
reports each exit to the agent at once.

Lifetimes: the zygote dies with the agent (``PR_SET_PDEATHSIG``) and kills its children when its
pipe to the agent closes; each child dies with the zygote. The worker pool that uses it is
``megascale.agent.workers``.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, Pipe
from multiprocessing.connection import wait as wait_ready
from pathlib import Path
from typing import Any

from megascale import gpus, runfiles
from megascale.launcher.lifetime import die_with_parent
from megascale.probes.fatal import RUN_DIR_ENV, write_exit_error

logger = logging.getLogger(__name__)

PRELOAD = (
    "megascale.train.command",
    "megascale.train.run",
    "megascale.train.resident",
    "megascale.launcher.job_store",
    "megascale.launcher.runlock",
    "megascale.config.rules",  # the config's check at a worker's start, with the self-check's
    "megascale.agent.selfcheck",  # names it checks against (~30 ms of imports in all)
    "megatron.core.datasets.blended_megatron_dataset_builder",  # the data splits' (~20 ms)
    "megatron.core.datasets.gpt_dataset",
    "megatron.core.datasets.helpers",  # the sample index's compiled helpers
    "torch.utils.serialization",  # a checkpoint's first save
    "fsspec.implementations.chained",
)
"""Modules the zygote imports once so that forked workers start without importing them (what
``train.run`` imports only when a rank builds its trainer included: a replacement rank's build
is on the recovery's path)."""


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


def _child_exit_alarm() -> tuple[int, int]:
    """A pipe (read end, write end) whose read end becomes readable when a child of this process
    exits: SIGCHLD wakes the zygote's loop at once (it reaps, and the agent hears of a killed
    worker or a finished self-check without a polling interval's delay)."""
    read, write = os.pipe()
    for fd in (read, write):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)  # the wakeup fd needs a handler
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    return read, write


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _child(
    conn: Connection,
    exits: tuple[int, int],
    zygote: int,
    target: str,
    kwargs: dict,
    env: dict,
    log: str,
    nice: int,
) -> None:
    """In a freshly forked child of the zygote (pid ``zygote``): set up, run ``target``, exit
    (never returns). A zygote that died while forking takes the child with it all the same."""
    code: Any = 1
    try:
        die_with_parent(parent=zygote)
        conn.close()
        # The zygote's child-exit alarm is not this process's: neither end of its pipe stays
        # open here. Both ends are named, not asked of the signal module: with torch imported
        # under Python 3.12 (2.11 and 2.14, +cu130, as in an NGC container) a forked child
        # reports no wakeup fd, and the write end stayed open in every worker.
        signal.set_wakeup_fd(-1)
        for fd in exits:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent stops workers; Ctrl-C is its
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
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
    # Ignored here, so a child is born ignoring it: a pause sent before a worker can pause (its
    # trainer sets the handler) is no signal that kills it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
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
            ready = wait_ready([conn, exits[0]], 1.0)  # a request, or a child's exit (SIGCHLD)
            if exits[0] in ready:
                _drain(exits[0])
            if conn in ready:
                op, *args = conn.recv()
                if op == "quit":
                    break
                if op == "spawn":
                    token, target, kwargs, env, log, nice = args
                    zygote, pid = os.getpid(), os.fork()
                    if pid == 0:
                        _child(conn, exits, zygote, target, kwargs, env, log, nice)
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
