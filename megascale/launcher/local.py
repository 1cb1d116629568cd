"""Start N ranks of a function on this machine, torchrun-style.

The parent imports torch and megatron-core once (~8 s on 2 cores) and forks the ranks, so N ranks
cost one import, not N. Each child gets the environment ``torch.distributed`` expects (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). If any rank fails, the others
are terminated and ``RankFailed`` names the failed ranks and their exit codes.

Lifetime: every rank dies with the parent (``lifetime.die_with_parent``: a parent killed outright
leaves no rank training), and SIGTERM or SIGINT to the parent is forwarded to the ranks as
SIGTERM; the parent then raises ``Stopped`` naming the signal.

MASTER_PORT is a port that was free when picked; another process may take it before rank 0 listens
on it. When rank 0 fails with EADDRINUSE and no rank has returned, every rank is started again on a
new port (``PORT_ATTEMPTS`` starts in all).
"""

from __future__ import annotations

import collections
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from megascale.gpus import check_fork_safe

logger = logging.getLogger(__name__)


PORT_ATTEMPTS = 3


class RankFailed(RuntimeError):
    """One or more ranks exited with a non-zero code or raised."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed: {detail}")


class Stopped(RuntimeError):
    """The parent got SIGTERM or SIGINT and stopped the ranks (forwarding SIGTERM to them)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}: ranks terminated")


class _PortTaken(RankFailed):
    """Rank 0 could not listen on MASTER_PORT (taken since it was picked) and no rank returned:
    the run can start again on another port."""


_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=4096)
_HANDED_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``, and not one this process handed out
    lately: the kernel gives a port closed a moment ago again (8 repeats in 500 calls here), and
    two jobs started side by side on one port would join each other's rendezvous."""
    with _HANDED_LOCK:
        for _ in range(64):
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                break
        _HANDED_OUT.append(port)
        return port


def _child(
    fn: Callable, rank: int, world: int, port: int, args: tuple, results: Any, parent: int
) -> None:
    from megascale.launcher.lifetime import die_with_parent
    from megascale.launcher.signals import reset_in_child

    reset_in_child()  # not the parent's forwarding handler
    die_with_parent(parent=parent)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        results.put((rank, "ok", fn(*args)))
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        results.put((rank, "error", "".join(traceback.format_exception(e))[-4000:]))
        raise SystemExit(1) from e


def run_local(
    fn: Callable, nprocs: int, args: tuple = (), *, timeout_s: float | None = None
) -> list[Any]:
    """Run ``fn(*args)`` as ranks 0..nprocs-1 in forked processes; return their results by rank.
    ``timeout_s`` bounds the whole call, a start again on a new port (module docstring) included."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return _run_ranks(fn, nprocs, args, free_port(), deadline)
        except _PortTaken as e:
            why = (e.failures[0].strip().splitlines() or [""])[-1]
            logger.warning("starting the ranks again on a new port: rank 0: %s", why[:300])
    return _run_ranks(fn, nprocs, args, free_port(), deadline)


def _port_taken(failures: dict[int, str], outcomes: dict[int, tuple[str, Any]], port: int) -> bool:
    """Whether rank 0 failed to listen on MASTER_PORT (torch: ``DistNetworkError ... port: N ...
    EADDRINUSE``) before any rank returned."""
    text = failures.get(0, "")
    taken = "EADDRINUSE" in text or "address already in use" in text.lower()
    return taken and str(port) in text and all(status != "ok" for status, _ in outcomes.values())


def _run_ranks(
    fn: Callable, nprocs: int, args: tuple, port: int, deadline: float | None
) -> list[Any]:
    check_fork_safe(f"{nprocs} rank(s)")  # a child cannot use CUDA its parent initialised
    ctx = mp.get_context("fork")
    results = ctx.SimpleQueue()
    procs = [
        ctx.Process(
            target=_child, args=(fn, r, nprocs, port, args, results, os.getpid()), daemon=False
        )
        for r in range(nprocs)
    ]
    stop = _forward_stop_signals(procs)  # before the starts: a signal meanwhile is not lost
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    failures: dict[int, str] = {}
    try:
        while len(outcomes) < nprocs and not stop.signum:
            while not results.empty():
                rank, status, value = results.get()
                outcomes[rank] = (status, value)
                if status == "error":
                    failures[rank] = value
            dead = [
                r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcomes
            ]
            for r in dead:
                failures[r] = f"exit code {procs[r].exitcode}"
                outcomes[r] = ("error", failures[r])
            if failures:
                break
            if deadline is not None and time.monotonic() > deadline:
                failures.update({r: "timed out" for r in range(nprocs) if r not in outcomes})
                break
            time.sleep(0.02)
    finally:
        if failures or stop.signum:
            time.sleep(0.1)  # let a failing rank's traceback arrive before the exit code wins
            while not results.empty():
                rank, status, value = results.get()
                if status == "error":
                    failures[rank] = value
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join()
        stop.restore()
    if stop.signum:
        raise Stopped(stop.signum)
    if failures:
        raise (_PortTaken if _port_taken(failures, outcomes, port) else RankFailed)(failures)
    return [outcomes[r][1] for r in range(nprocs)]


class _Forwarder:
    """SIGTERM/SIGINT to the parent: SIGTERM to every live rank, and ``signum`` set."""

    def __init__(self, procs: list[Any]) -> None:
        self.procs, self.signum, self.previous = procs, 0, {}

    def handle(self, signum: int, _frame: Any) -> None:
        self.signum = signum
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                os.kill(p.pid, signal.SIGTERM)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _forward_stop_signals(procs: list[Any]) -> _Forwarder:
    """Install the forwarding handler (main thread only: elsewhere signals are not ours)."""
    forwarder = _Forwarder(procs)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            forwarder.previous[sig] = signal.signal(sig, forwarder.handle)
    return forwarder
