"""The simulated node agents: the real ``Agent`` with simulated workers (``SimPool``: no
processes; a self-check passes at once), run as the agent's own threads (``agents_main``, many
nodes per process). ``agents_async`` drives the same ``SimAgent`` from coroutines."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megascale.agent.service import Agent, AgentOptions
from megascale.etcd.store import Store, StoreConfig

logger = logging.getLogger(__name__)


class SimPool:
    """Stands in for ``WorkerPool``: the workers a node would run, without processes."""

    def __init__(self) -> None:
        self.workers: dict[int, Any] = {}
        self.ranks: list[int] = []
        self.generation = 0

    def start(
        self, generation: int, ranks: list[int], env: Any, argv: Any, nice: int = 0, keep=None
    ) -> list:
        self.generation, self.ranks = generation, list(ranks)
        return []

    def stop(
        self, grace_s: float = 0.0, keep: frozenset[int] = frozenset()
    ) -> dict[int, int | None]:
        self.ranks = []
        return {}

    def running(self) -> list:
        return []

    def scan(self) -> list:
        return []

    def status(self, generation: int) -> dict[str, dict[str, Any]]:
        if generation != self.generation:
            return {}
        return {str(r): {"alive": True, "exit_code": None, "pid": 0} for r in self.ranks}

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
        """``WorkerPool.selfcheck``'s signature: every simulated node is fit."""
        return True, "simulated", []


class _NoZygote:
    on_exit: Any = None

    def close(self) -> None:
        pass


class SimAgent(Agent):
    """The real agent with ``SimPool`` workers; ``kill()`` makes its node vanish."""

    def __init__(self, store: Store, opts: AgentOptions) -> None:
        super().__init__(store, opts, _NoZygote())  # type: ignore[arg-type]
        self.pool = SimPool()  # type: ignore[assignment]
        self.killed = False

    def _rendezvous(self, generation: int, master: str) -> tuple[str, int]:
        return self.opts.addr, 29500  # no rank-0 store to publish: nothing runs

    def _recovery(self) -> Any:
        return None  # no worker process to keep: every generation starts its simulated ranks

    def kill(self) -> float:
        """Stop heartbeating and stop refreshing the lease, now; returns the wall time."""
        self.killed = True
        if self._keepalive is not None:
            self._keepalive.stop(revoke=False)
        self.stopping.set()
        self.wake()
        return time.time()

    def _shutdown(self) -> None:
        if not self.killed:
            super()._shutdown()
            return
        for watch in self._watches:
            watch.cancel()


def agents_main(
    endpoint: str,
    job: str,
    nodes: list[str],
    interval: float,
    run_dir: str,
    conn: Any,
) -> None:
    """One simulator process: run ``nodes`` agents as threads; obey ``("kill", node)`` and
    ``("exit",)`` from ``conn`` (answering a kill with its wall time)."""
    logging.getLogger().setLevel(logging.ERROR)
    threading.stack_size(512 * 1024)
    agents: dict[str, SimAgent] = {}
    threads = []
    for node in nodes:
        cfg = StoreConfig.parse(endpoint, retry_s=max(0.5, interval), request_timeout_s=2.0)
        opts = AgentOptions(
            job_id=job, node=node, run_dir=Path(run_dir), config=None, heartbeat_interval=interval
        )
        agents[node] = SimAgent(Store(cfg), opts)
        threads.append(threading.Thread(target=agents[node].run, name=f"agent-{node}", daemon=True))
        threads[-1].start()
        time.sleep(0.002)  # a ramp, as pods starting: not one burst of N lease grants
    conn.send(("ready", len(agents)))
    while True:
        message = conn.recv()
        if message[0] == "kill":
            conn.send(("killed", agents[message[1]].kill()))
            continue
        for agent in agents.values():
            agent.stopping.set()
            agent.wake()
        deadline = time.monotonic() + 10  # each revokes its lease on the way out
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return
