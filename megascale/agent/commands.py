"""How the node agent carries out the controller's commands (``commands/<node>``): one at a
time, in the order written, each at most once and only when current (``keys.is_current``) and
published (its generation is the controller's ``generation`` or older); ``stop`` stops the
workers, ``selfcheck`` runs the node self-check (and the neighbour all-reduces it names),
``start`` rendezvouses with the master node and starts the generation's workers. Each ends in an
ack under ``acks/<node>`` (``ack_message``), retried until etcd takes it.

``CommandRunner`` is a part of ``agent.Agent``, holding no state of its own: the agent's fields
(``store``, ``opts``, ``pool``, ``keys``, ``generation``, ...) are what it reads and sets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from queue import Empty
from typing import Any

from megascale.agent import neighbour_check, rejoin
from megascale.etcd.keys import is_current
from megascale.etcd.store import StoreError
from megascale.launcher.job_store import NODE_ADDR_ENV
from megascale.launcher.local import free_port
from megascale.messages import Ack, Command, GenerationRecord
from megascale.probes import inject
from megascale.probes.fatal import RUN_DIR_ENV
from megascale.train.resident import REJOIN_DIR_ENV, in_process_applies

logger = logging.getLogger("megascale.agent.service")


@dataclass
class _Reported:
    """Errors and notices of the current generation, numbered for the controller."""

    errors: list[dict[str, Any]] = field(default_factory=list)
    notices: list[dict[str, Any]] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0


def ack_message(command: Command, ok: bool, detail: str, suspects: Sequence[str] = ()) -> Ack:
    """The ``acks/<node>`` value (``messages.Ack``, encoded) answering ``command``: its id,
    generation and kind, whether it succeeded, ``detail`` (cut to 2,000 characters) and, for a
    self-check, the neighbours the node suspects."""
    return Ack(
        id=command.id,
        generation=command.generation,
        kind=command.kind,
        ok=ok,
        detail=detail[:2000],
        suspects=list(suspects),
    )


class CommandRunner:
    """The agent's command thread (a part of ``agent.Agent``; see the module)."""

    opts: Any
    _in_process: Any = None  # the job's fault_tolerance section, False, or None: not read yet

    def _command_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                command = self._commands.get(timeout=0.2)
            except Empty:
                continue
            ack = self.execute(command)
            if ack is not None:
                self._ack(ack)

    def execute(self, command: Command) -> Ack | None:
        """Run ``command`` if it is current (``keys.is_current``) and not run before (by id);
        returns the ``acks/<node>`` value to write, None when the command was skipped. Called
        for one command at a time, in the order they were written."""
        if not is_current(command, self.opts.job_id, self.generation):
            logger.info("ignoring command %s (agent at generation %d)", command, self.generation)
            return None
        if command.id in self._done_ids:
            return None
        if command.generation > self.generation and not self._published(command):
            return None
        self._done_ids.add(command.id)
        self.generation = max(self.generation, command.generation)
        logger.info("command %s %s (generation %d)", command.kind, command.id, self.generation)
        try:  # (ok, detail), and a self-check's suspected neighbours
            ok, detail, *suspects = getattr(self, f"_cmd_{command.kind}")(command)
        except Exception as e:  # a failed command is a failed ack, not a dead agent
            logger.exception("command %s failed", command.id)
            ok, detail, suspects = False, f"{type(e).__name__}: {e}", []
        return ack_message(command, ok, detail, suspects[0] if suspects else ())

    def _published(self, command: Command) -> bool:
        """Whether the controller has published ``command``'s generation (``generation``, which
        it writes with or before that generation's commands): a command of a generation beyond
        it was not written by the controller, and running it would make this agent ignore every
        real command after it."""
        try:
            kv = self.store.get(self.keys.generation)
            published = GenerationRecord.decode(kv.json()).generation if kv is not None else 0
        except (StoreError, ValueError) as e:
            logger.warning("ignoring command %s: cannot read the generation (%s)", command, e)
            return False
        if command.generation > published:
            logger.warning(
                "ignoring command %s: generation beyond the controller's (%d)", command, published
            )
            return False
        return True

    def _ack(self, ack: Ack) -> None:
        """Write ``ack``, retrying until etcd takes it or the agent stops."""
        while not self.stopping.is_set():
            try:
                self.store.put(self.keys.ack(self.opts.node), ack)
                return
            except StoreError as e:
                self._etcd_failed(e)
                time.sleep(min(1.0, self.opts.heartbeat_interval))

    def _cmd_stop(self, command: Command) -> tuple[bool, str]:
        recovery = self._recovery()
        if recovery is not None:  # in-process: the healthy workers pause, keeping their state
            wait_s = recovery.pause_timeout_s
            bound = command.pause_wait_s  # a peer's number: used within its bounds only
            if bound is not None and 0 <= bound < wait_s:  # ranks likely blocked: no pause
                wait_s = bound
            paused, killed = rejoin.pause(self.pool, self._rejoin_dir(), wait_s)
            self.wake()
            return True, f"paused ranks {paused}; killed {killed} (could not pause)"
        codes = self.pool.stop(self.opts.stop_grace_s)
        self.wake()
        return True, f"stopped; exit codes {codes}"

    def _rejoin_dir(self) -> Any:
        return rejoin.rejoin_dir(self.opts.run_dir, self.opts.node)

    def _recovery(self) -> Any:
        """The job's ``fault_tolerance`` section when it recovers in-process, else None."""
        if self._in_process is None:
            try:
                job = self._job_config()
                self._in_process = job.fault_tolerance if in_process_applies(job) else False
            except Exception as e:  # the workers will report the config's problem themselves
                logger.warning("in-process recovery off: the job's config: %s", e)
                self._in_process = False
        return self._in_process or None

    def _cmd_selfcheck(self, command: Command) -> tuple[bool, str, list[str]]:
        self.selfchecks += 1
        # nothing of ours may run during the check; paused workers wait, keeping their state
        paused = rejoin.paused_workers(self.pool, self._rejoin_dir()) if self._recovery() else {}
        self.pool.stop(self.opts.stop_grace_s, keep=frozenset(paused))
        for spec in self.opts.faults:
            if spec.kind == "corrupt-checkpoint":
                inject.corrupt_latest_checkpoint(
                    self.opts.run_dir, self.opts.config, self.opts.overrides, spec
                )
        ok, detail, suspects = self._run_selfcheck(self._neighbour_job(command))
        for spec in self.opts.faults:
            if spec.kind == "fail-selfcheck" and self.opts.node == f"node-{spec.get('node')}":
                inject.claim(self.opts.run_dir, spec, node=self.opts.node)
                ok, detail = False, f"injected fault {spec.text}; {detail}"
        log = logger.info if ok else logger.warning
        log("self-check %s: %s", "passed" if ok else "FAILED", detail)
        return ok, detail, suspects

    def _neighbour_job(self, command: Command) -> dict[str, Any] | None:
        """``run_selfcheck_neighbours``'s arguments for the command's neighbours (None: none)."""
        down = None
        for spec in self.opts.faults:
            if spec.kind == "break-net" and self.opts.node == f"node-{spec.get('node')}":
                inject.claim(self.opts.run_dir, spec, node=self.opts.node)
                down = f"network down (injected fault {spec.text})"
        return neighbour_check.neighbour_job(
            command.neighbours,
            self._registration_of,
            host=self.opts.addr,
            port=self.neighbour_port,
            timeout_s=self.opts.neighbour_timeout_s,
            down=down,
        )

    def _registration_of(self, node: str) -> dict[str, Any] | None:
        """``nodes/<node>``'s value (None: not registered, or etcd unreachable)."""
        try:
            kv = self.store.get(self.keys.node(node))
        except StoreError as e:
            self._etcd_failed(e)
            return None
        return None if kv is None else kv.json()

    def _run_selfcheck(
        self, neighbours: dict[str, Any] | None = None
    ) -> tuple[bool, str, list[str]]:
        mode = self.opts.selfcheck
        if mode == "auto":
            try:
                import megascale.agent.selfcheck  # noqa: F401

                mode = "full"
            except ImportError:
                mode = "builtin"
        job = self._job_config() if mode == "full" else None
        thresholds = None
        if job is not None and job.diagnostics.selfcheck_thresholds is not None:
            thresholds = str(self.opts.run_dir / job.diagnostics.selfcheck_thresholds)
        return self.pool.selfcheck(
            self.opts.nproc_per_node,
            full=mode == "full",
            thresholds=thresholds,
            neighbours=neighbours,
            tests=job.fault_tolerance.selfcheck_tests if job is not None else None,
            env=self._device_env(),  # the GPUs the node's workers train on
        )

    def _device_env(self) -> dict[str, str]:
        """The node's GPUs as every process it starts sees them (its workers, its self-check):
        ``CUDA_VISIBLE_DEVICES`` when ``visible_devices`` names them, else nothing (the agent's
        own environment, the machine's GPUs)."""
        devices = self.opts.visible_devices
        return {"CUDA_VISIBLE_DEVICES": devices} if devices else {}

    def _job_config(self) -> Any:
        """The job's config (its ``diagnostics.selfcheck_thresholds`` file, relative to the run
        directory, and ``fault_tolerance.selfcheck_tests``)."""
        from megascale import config as config_mod

        return config_mod.load(self.opts.config, list(self.opts.overrides))

    def _cmd_start(self, command: Command) -> tuple[bool, str]:
        assignment = command.rank_assignment
        if assignment is None:
            return False, "a start command without a rank_assignment"
        generation = command.generation
        recovery = self._recovery()
        if recovery is None:
            self.pool.stop(self.opts.stop_grace_s)
        with self._lock:
            self._reported = _Reported()
        addr, port = self._rendezvous(generation, assignment.master_node)
        env = {
            "WORLD_SIZE": str(assignment.world_size),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
            "MEGASCALE_JOB": self.opts.job_id,
            "MEGASCALE_NODE": self.opts.node,
            NODE_ADDR_ENV: self.opts.addr,
            "MEGASCALE_GENERATION": str(generation),
            RUN_DIR_ENV: str(self.opts.run_dir),
            inject.ENV: inject.to_env(self.opts.faults),
            **self._device_env(),
        }
        ranks = list(assignment.ranks)
        argv, nice = self.opts.train_argv(), self.opts.worker_nice
        if recovery is not None:
            env[REJOIN_DIR_ENV] = str(self._rejoin_dir())
            kept, new = rejoin.rejoin(
                self.pool, self._rejoin_dir(), generation, ranks, env, argv, nice
            )
            self.wake()
            return True, (
                f"generation {generation}: ranks {ranks}, master {addr}:{port}; "
                f"rejoined {kept}, new processes {new}"
            )
        self.pool.start(generation, ranks, env, argv, nice)
        self.wake()
        return True, f"generation {generation}: ranks {ranks}, master {addr}:{port}"

    def _rendezvous(self, generation: int, master: str) -> tuple[str, int]:
        """The master node's agent picks a free port and publishes it under
        ``rendezvous/<generation>`` (on its lease); the others wait for it."""
        key = f"{self.keys.prefix}rendezvous/{generation}"
        if master == self.opts.node:
            port = free_port(self.opts.addr)
            value = {"addr": self.opts.addr, "port": port, "node": master}
            self.store.put(key, value, lease=self._lease)
            return self.opts.addr, port
        deadline = time.monotonic() + self.opts.rendezvous_timeout_s
        pause = 0.002  # the master publishes within milliseconds of this node's own start command
        while time.monotonic() < deadline and not self.stopping.is_set():
            try:
                kv = self.store.get(key)
            except StoreError as e:
                self._etcd_failed(e)
                kv = None
            if kv is not None:
                value = kv.json()
                return str(value["addr"]), int(value["port"])
            time.sleep(pause)
            pause = min(2 * pause, 0.05)  # a few quick reads, then 20 a second per node at most
        raise TimeoutError(f"{master} did not publish {key} in {self.opts.rendezvous_timeout_s} s")
