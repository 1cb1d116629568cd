"""The node agent (``megascale agent``): one per node, between the controller and the workers.

What it does, in its threads:

* main loop: registers the node (``nodes/<node>`` under a lease of ``lease_ttl`` s, with the
  job's config hash; only while no other agent holds the name: ``agent.identity``, else exit 2),
  then every ``heartbeat_interval`` -- and at once when a worker exits -- writes ``heartbeats/<node>``
  (``heartbeat()``: a ``messages.Heartbeat``);
* command thread (``agent.commands``): runs what the controller writes to ``commands/<node>`` -- ``stop`` (stop the
  workers), ``selfcheck`` (the node self-check; its result is the ack), ``start`` (generation G
  with rank assignment R) -- and acks each under ``acks/<node>``. A command is run only if
  ``keys.is_current`` (this job, not an older generation), at most once (by its id), and not
  when its generation is beyond the one the controller published (``generation``);
* the zygote's reader: worker exits, and the zygote's own death (its workers' exits and a
  ``zygote_died`` error, reported at once: this node's fault) (``megascale.agent.workers``).

etcd unreachable: the workers keep running and the agent keeps trying (each store call gives up
after ``retry_s`` and is retried at the next beat); acks are retried until written. If the lease
expired meanwhile, the agent registers again under a new lease. Commands are watched from the
revision current at start-up, so a command left from before this agent started is never run, and
run only if written after the agent's claim of its name (earlier ones were another agent's).

The agent exits when told to (SIGTERM/SIGINT: workers stopped, lease revoked) or when the job's
``status`` (the controller's few-byte summary) says the job ended and its workers are gone (0
finished, 1 failed).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from queue import Queue
from typing import Any

from megascale import runfiles
from megascale.agent import neighbour_check
from megascale.agent.commands import (  # noqa: F401  (ack_message: re-exported)
    CommandRunner,
    _Reported,
    ack_message,
)
from megascale.agent.identity import INSTANCE, NameTaken, claim_node, config_hash
from megascale.agent.logscan import DEVICE_ERRORS, error_kind
from megascale.agent.nodeinfo import gpu_status, hardware_info, network_counters
from megascale.agent.workers import WorkerPool
from megascale.agent.zygote import Zygote
from megascale.controller.policy import lease_ttl
from megascale.etcd.keys import JobKeys, check_name
from megascale.etcd.store import (
    KeepAlive,
    Lease,
    LeaseNotFound,
    Store,
    StoreConfig,
    StoreError,
    WatchEvent,
)
from megascale.messages import (
    Command,
    ControllerStatus,
    GenerationRecord,
    Heartbeat,
    RankFigures,
    RankProgress,
    Reported,
    WorkerStatus,
    decoded,
)
from megascale.probes import inject
from megascale.probes.fatal import EXIT_JOB_FATAL, read_exit_error, read_fatal
from megascale.probes.progress import progress_path, read_progress
from megascale.process import (
    add_metrics_arguments,
    add_store_arguments,
    check_listen_address,
    setup_logging,
    store_config,
    write_metrics_url,
)

logger = logging.getLogger(__name__)

TERMINAL_STATES = ("finished", "failed")


@dataclass(frozen=True)
class AgentOptions:
    job_id: str
    node: str
    run_dir: Path
    config: str | None
    """The workers' ``megascale train`` CONFIG (a TOML file or preset; None: the default)."""
    overrides: tuple[str, ...] = ()
    """Their ``--set SECTION.KEY=VALUE`` items."""
    nproc_per_node: int = 1
    heartbeat_interval: float = 1.0
    addr: str = "127.0.0.1"
    """The address other nodes reach this node's rank-0 store at, when it runs rank 0."""
    faults: tuple[inject.FaultSpec, ...] = ()
    selfcheck: str = "auto"
    """``builtin`` (``selfcheck.builtin.selfcheck_rank``), ``full`` (``megascale.agent.selfcheck``),
    or ``auto`` (full when importable)."""
    worker_nice: int = 0
    visible_devices: str | None = None
    """``CUDA_VISIBLE_DEVICES`` for this node's workers (several "nodes" on one GPU machine)."""
    stop_grace_s: float = 3.0
    rendezvous_timeout_s: float = 60.0
    metrics_port: int = 0
    """Port of this agent's Prometheus ``/metrics`` on ``metrics_addr`` (0: a free one; -1: none)."""
    metrics_addr: str = "127.0.0.1"
    """Address ``/metrics`` listens on: loopback locally, the pod's IP in Kubernetes."""
    topology: str | None = None
    """This node's switch/rack label: the controller pairs nodes under one label for the
    self-check's neighbour all-reduce (None: by order)."""
    neighbour_timeout_s: float = 10.0
    """Deadline of each neighbour all-reduce's first phase (later phases wait longer)."""

    @property
    def lease_ttl(self) -> int:
        return lease_ttl(self.heartbeat_interval)

    def train_argv(self) -> list[str]:
        """The workers' ``megascale train`` arguments. ``parallel.dp`` is left to each
        generation's ranks to derive from the world size the controller gave them (a resolved
        config states the configured one; a shrunk generation has fewer replicas)."""
        argv = [self.config] if self.config else []
        for item in self.overrides:
            argv += ["--set", item]
        return [*argv, "--set", "parallel.dp=none", "--run-dir", str(self.run_dir)]


def progress_figures(progress: dict[int, RankProgress]) -> dict[str, Any]:
    """The heartbeat's training fields from its ranks' progress records: per-rank figures as
    they are; the node's times are its slowest rank's; the job-wide tokens/s and MFU are rank
    0's, carried only by the node that runs rank 0 (so a job figure is reported once, never
    summed or averaged with a spare's or a slowed rank's)."""
    if not progress:
        return {"section": "init"}
    records = [progress[r] for r in sorted(progress)]
    sections = {p.section for p in records}
    first = progress.get(0)
    saves = [p.checkpoint for p in records if p.checkpoint is not None]
    durable = [p.durable for p in records if p.durable is not None]
    return {
        "step": max(p.step for p in records),
        "section": next((s for s in ("init", "checkpoint") if s in sections), "step"),
        "tokens_per_s": first.tokens_per_s if first else None,
        "mfu": first.mfu if first else None,
        "mfu_peak": first.mfu_peak if first else None,
        "durable": max(durable, key=lambda c: c.time) if durable else None,
        "step_time_s": max((p.step_time_s or 0.0 for p in records), default=0.0),
        "compute_time_s": max((p.compute_time_s or 0.0 for p in records), default=0.0) or None,
        "val_loss": next((p.val_loss for p in records if p.val_loss is not None), None),
        "checkpoint": max(saves, key=lambda c: (c.step, c.stall_s)) if saves else None,
        "ranks": {
            str(r): RankFigures(
                step=p.step,
                step_time_s=p.step_time_s,
                compute_time_s=p.compute_time_s,
                compute_step=p.compute_step,
                stage=p.stage,
                comm_time_s=p.comm_time_s,
                data_wait_s=p.data_wait_s,
                mem_rss_gib=p.mem_rss_gib,
                mem_max_allocated_gib=p.mem_max_allocated_gib,
                mem_max_reserved_gib=p.mem_max_reserved_gib,
            )
            for r, p in progress.items()
        },
    }


class Agent(CommandRunner):
    """One node's agent (see the module docstring). ``run()`` returns the exit code."""

    def __init__(self, store: Store, opts: AgentOptions, zygote: Zygote) -> None:
        self.store, self.opts = store, opts
        self.keys = JobKeys(opts.job_id)
        self.generation = 0
        self.pool = WorkerPool(zygote, opts.run_dir, opts.node, on_change=self.wake)
        self.zygote = zygote
        self.stopping = threading.Event()
        self._wake = threading.Event()
        self._commands: Queue[dict[str, Any]] = Queue()
        self._done_ids: set[str] = set()
        self._lease: Lease | None = None
        self._keepalive: KeepAlive | None = None
        self._need_register = threading.Event()
        self._need_register.set()
        self._watches: list[Any] = []
        self._job_state: str | None = None
        self._reported = _Reported()
        self._lock = threading.Lock()
        self._claim_revision: int | None = None  # the store's revision at this agent's claim
        self._early: list[WatchEvent] = []  # commands seen before it (run if written after)
        self._etcd_ok = True
        self.hardware = hardware_info()
        self.config_hash = config_hash(opts.config, opts.overrides)
        self.selfchecks = 0
        self.neighbour_port = neighbour_check.reserve_ports(opts.addr)
        self.metrics: Any = None
        self.metrics_server: Any = None
        if opts.metrics_port >= 0:
            from megascale.agent.metrics import AgentMetrics

            self.metrics = AgentMetrics(opts.job_id, opts.node)
            self.metrics_server = self.metrics.serve(opts.metrics_port, opts.metrics_addr)
            logger.info("node %s metrics at %s", opts.node, self.metrics_server.url)
            write_metrics_url(opts.run_dir, opts.node, self.metrics_server.url)

    @property
    def metrics_url(self) -> str | None:
        return self.metrics_server.url if self.metrics_server is not None else None

    def wake(self) -> None:
        """Send a heartbeat now (a worker exited)."""
        self._wake.set()

    # -- main loop --------------------------------------------------------------------------------

    def run(self) -> int:
        commands = threading.Thread(target=self._command_loop, name="agent-commands", daemon=True)
        commands.start()
        try:
            while not self.stopping.is_set():
                if self._need_register.is_set():
                    try:
                        self._register()
                    except NameTaken as e:
                        logger.error("agent %s refused: %s", self.opts.node, e)
                        return 2
                if not self._need_register.is_set():
                    self._beat()
                if self._job_state in TERMINAL_STATES and not self.pool.running():
                    logger.info("job %s; agent exits", self._job_state)
                    return 0 if self._job_state == "finished" else 1
                self._wake.wait(self.opts.heartbeat_interval)
                self._wake.clear()
            return 0
        finally:
            self._shutdown()

    def _register(self) -> None:
        """Take a lease, publish ``nodes/<node>``, watch commands and the job status."""
        try:
            if self._keepalive is not None:
                self._keepalive.stop()
            self._lease = self.store.grant(self.opts.lease_ttl)
            self._keepalive = self.store.keep_alive(self._lease, on_lost=self._lease_lost)
            if not self._watches:
                self._watch_commands()
            key, wait_s = self.keys.node(self.opts.node), self.opts.lease_ttl + 1.0
            revision = claim_node(self.store, key, self.registration(), self._lease.id, wait_s)
            self._claimed(revision)
        except StoreError as e:
            self._etcd_failed(e)
            return
        self._need_register.clear()
        self._etcd_back()
        logger.info(
            "node %s registered (lease %x, ttl %d s)",
            self.opts.node,
            self._lease.id,
            self._lease.ttl,
        )

    def registration(self) -> dict[str, Any]:
        """The ``nodes/<node>`` value, written under the lease at each registration."""
        return {
            "node": self.opts.node,
            "host": socket.gethostname(),
            "addr": self.opts.addr,
            "nproc": self.opts.nproc_per_node,
            "pid": os.getpid(),
            "hardware": self.hardware,
            "registered_at": time.time(),
            "metrics_url": self.metrics_url,
            "topology": self.opts.topology,
            "neighbour_port": self.neighbour_port,
            "config_hash": self.config_hash,
            "instance": INSTANCE,
        }

    def _watch_commands(self) -> None:
        generation = decoded(GenerationRecord, self.store.get(self.keys.generation))
        if generation is not None:
            self.generation = max(self.generation, generation.generation)
        # From now on: a command written before this agent started is never run.
        start = self.store.snapshot(self.keys.command(self.opts.node)).revision + 1
        self._watches.append(
            self.store.watch(
                self.keys.command(self.opts.node), start_revision=start, callback=self._on_command
            )
        )
        self._watches.append(self.store.watch(self.keys.status, callback=self._on_status))
        status = decoded(ControllerStatus, self.store.get(self.keys.status))
        if status is not None:
            self._job_state = status.state

    def _lease_lost(self, lease: Lease) -> None:
        logger.warning("lease %x expired: registering again", lease.id)
        self._need_register.set()
        self.wake()

    def _on_command(self, event: WatchEvent) -> None:
        """A command for this node: run once the name is this agent's, only if written after
        its first claim (before it, the commands are another agent's: ``claim_node``)."""
        if event.kind != "put":
            return
        with self._lock:
            if self._claim_revision is None:
                self._early.append(event)
                return
        if event.revision > self._claim_revision:
            command = decoded(Command, event)
            if command is not None:
                self._commands.put(command)

    def _claimed(self, revision: int) -> None:
        with self._lock:
            if self._claim_revision is not None:
                return
            self._claim_revision, early, self._early = revision, self._early, []
        for event in early:
            self._on_command(event)

    def _on_status(self, event: WatchEvent) -> None:
        if event.kind == "put":
            status = decoded(ControllerStatus, event)
            if status is not None:
                self._job_state = status.state
            if self._job_state in TERMINAL_STATES:
                self.wake()

    def _etcd_failed(self, error: Exception) -> None:
        if self._etcd_ok:
            logger.warning("etcd unreachable (%s); workers keep running, retrying", error)
        self._etcd_ok = False

    def _etcd_back(self) -> None:
        if not self._etcd_ok:
            logger.warning("etcd reachable again")
        self._etcd_ok = True

    def _beat(self) -> None:
        payload = self.heartbeat()
        if self.metrics is not None:
            self.metrics.observe_heartbeat(payload)
        try:
            self.store.put(self.keys.heartbeat(self.opts.node), payload.encode(), lease=self._lease)
        except LeaseNotFound:
            logger.warning("lease gone: registering again")
            self._need_register.set()
        except StoreError as e:
            self._etcd_failed(e)
        else:
            self._etcd_back()

    def _shutdown(self) -> None:
        self.stopping.set()
        self.pool.stop(self.opts.stop_grace_s)
        for watch in self._watches:
            watch.cancel()
        if self._keepalive is not None:
            try:
                self._keepalive.stop(revoke=True)  # deregister now rather than at lease expiry
            except StoreError as e:
                logger.warning("could not revoke the lease: %s", e)
        self.zygote.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None

    # -- the heartbeat ----------------------------------------------------------------------------

    def heartbeat(self) -> Heartbeat:
        """The ``heartbeats/<node>`` value (``messages.Heartbeat`` defines every field once)."""
        # One reading of the generation for the whole beat (workers, progress, flight, errors):
        # the command thread may move it on meanwhile (a start), and the last generation's exits
        # must not go out labelled as the next one's (the controller would take a rank killed at
        # the stop for a new fault).
        generation = self.generation
        # Exits before output: a worker seen exited here has written all of its output, so the
        # scan reads all of it (a peer's failure included) before its exit is reported.
        workers = self.pool.status(generation)
        for rank, status in workers.items():
            self._exit_reasons(int(rank), status)
        self._collect_output()
        self._mark_peer_failures(workers, generation)
        progress = self._progress(generation)
        with self._lock:
            current = [e for e in self._reported.errors if e["generation"] == generation]
            errors = current[-50:]
            notices = [n for n in self._reported.notices if n["generation"] == generation]
            notices = notices[-20:]
        return Heartbeat(
            node=self.opts.node,
            time=time.time(),
            generation=generation,
            workers={r: WorkerStatus(**w) for r, w in workers.items()},
            flight=self._flight(generation),
            errors=[f"rank {e['rank']}: {e['kind']}: {e['text']}" for e in errors],
            error_events=[Reported(**e) for e in errors],
            notices=[Reported(**n) for n in notices],
            host=socket.gethostname(),
            addr=self.opts.addr,
            pid=os.getpid(),
            hardware=self.hardware,
            gpus=gpu_status(),
            network=network_counters(),
            selfchecks=self.selfchecks,
            **progress_figures(progress),
        )

    def _exit_reasons(self, rank: int, status: dict[str, Any]) -> None:
        """Add to a worker's ``status`` why it exited: ``fatal``, the reason of a job-fatal exit;
        ``error``, the uncaught exception of another failed exit (``{"text", "signature"}``),
        None for a device error (CUDA, NCCL, OOM, segfault: this node's evidence, never
        classified as the job's own error)."""
        code, pid = status["exit_code"], status["pid"]
        fatal = code == EXIT_JOB_FATAL
        status["fatal"] = read_fatal(self.opts.run_dir, rank, pid) if fatal else None
        error = read_exit_error(self.opts.run_dir, rank, pid) if code and not fatal else None
        if error is not None and error_kind(error.text) not in DEVICE_ERRORS:
            status["error"] = {"text": error.text, "signature": error.signature}
        else:
            status["error"] = None

    def _collect_output(self) -> None:
        """Scan the workers' output. An error is published one beat after it was found (or at
        once when its worker had exited before the scan), so the lines after it -- a peer's
        connection closing -- can mark it secondary first. Each item carries its worker's
        generation: the heartbeat reports only the current generation's."""
        # The workers that had exited before the scan: their output is read to the end. One that
        # exits during the scan may have lines left unread (its peer's failure): its errors wait
        # for the next beat (which its exit wakes), whose scan reads the rest.
        with self._lock:
            waiting = [e["worker"] for e in self._reported.pending]
        exited = {id(w) for w in [*self.pool.workers.values(), *waiting] if not w.alive}
        found = self.pool.scan()
        with self._lock:
            rep = self._reported
            found_before, items, rep.pending = rep.seq, rep.pending, []  # a beat ago: seq <= it
            for worker, match in found:
                rep.seq += 1
                item = {
                    "seq": rep.seq,
                    "rank": worker.rank,
                    "generation": worker.generation,
                    "kind": match.kind,
                    "text": match.text,
                    "worker": worker,
                }
                if match.kind == "resumed" and worker.rank != 0:
                    continue  # every rank says so; one is enough
                (rep.notices if match.notice else items).append(item)
            ready = []
            for item in items:
                worker = item["worker"]
                if id(worker) in exited or (item["seq"] <= found_before and worker.alive):
                    ready.append(item)
                else:
                    rep.pending.append(item)
            for error in sorted(ready, key=lambda e: e["seq"]):
                scanner = error.pop("worker").scanner
                error["secondary"] = bool(scanner and scanner.peer_failure)
                rep.errors.append(error)
                logger.warning("rank %d: %s: %s", error["rank"], error["kind"], error["text"])
            for notice in rep.notices:
                notice.pop("worker", None)

    def _mark_peer_failures(self, workers: dict[str, dict[str, Any]], generation: int) -> None:
        """Update the ``peer`` flags of a ``pool.status`` taken before ``_collect_output`` with
        what that scan found."""
        for rank, worker in self._current_workers(generation):
            status = workers.get(str(rank))
            if status is not None and status["pid"] == worker.pid and worker.scanner is not None:
                status["peer"] = status["peer"] or worker.scanner.peer_failure

    def _current_workers(self, generation: int) -> list[tuple[int, Any]]:
        return [(r, w) for r, w in list(self.pool.workers.items()) if w.generation == generation]

    def _progress(self, generation: int) -> dict[int, RankProgress]:
        """Per current worker: its progress file (``megascale.probes.progress``), if this
        worker (not an earlier one of the same rank) wrote it."""
        out: dict[int, RankProgress] = {}
        for rank, worker in self._current_workers(generation):
            try:
                state = read_progress(progress_path(self.opts.run_dir, rank))
            except (OSError, ValueError):
                continue
            if state.pid == worker.pid:
                out[rank] = state
        return out

    def _flight(self, generation: int) -> dict[str, Any]:
        try:
            from megascale.probes.flight.format import FlightFileError, flight_path, last_state
        except ImportError:
            return {}
        states = {}
        for rank, worker in self._current_workers(generation):
            try:
                state = last_state(flight_path(self.opts.run_dir, rank))
            except (OSError, FlightFileError):
                continue
            if state.pid == worker.pid:
                states[str(rank)] = state.to_json()
        return states


# -- the command ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", required=True, help="job id (the etcd key prefix)")
    parser.add_argument("--node", required=True, help="this node's name (unique in the job)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="worker processes (K)")
    parser.add_argument("--run-dir", required=True, help="the job's run directory (shared)")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds")
    parser.add_argument(
        "--addr", default="127.0.0.1", help="address other nodes reach this node at (rank 0)"
    )
    parser.add_argument(
        "--selfcheck", choices=("auto", "builtin", "full"), default="auto", help="which self-check"
    )
    parser.add_argument(
        "--inject", action="append", default=[], metavar="SPEC", help="faults (tests, demos)"
    )
    parser.add_argument(
        "--topology",
        default=os.environ.get("MEGASCALE_TOPOLOGY") or None,
        metavar="LABEL",
        help="this node's switch/rack label for the neighbour all-reduce "
        "(default: $MEGASCALE_TOPOLOGY; none: nodes are paired by order)",
    )
    add_metrics_arguments(parser)
    add_store_arguments(parser)


def options_from_args(args: argparse.Namespace) -> AgentOptions:
    """The options, or ValueError (one line) before anything is written: names that reach the
    file system (``logs/agent_<node>.log``) and the run directory's path are checked here."""
    check_name("--job", args.job)
    check_name("--node", args.node)
    check_listen_address("--addr", args.addr)
    check_listen_address("--metrics-addr", args.metrics_addr)
    runfiles.check_dir_path("--run-dir", args.run_dir)
    faults = [inject.parse(s) for s in args.inject] + inject.from_env()
    return AgentOptions(
        job_id=args.job,
        node=args.node,
        run_dir=Path(args.run_dir).resolve(),
        config=args.config,
        overrides=tuple(args.overrides),
        nproc_per_node=args.nproc_per_node,
        heartbeat_interval=args.heartbeat_interval,
        addr=args.addr,
        faults=tuple(faults),
        selfcheck=args.selfcheck,
        metrics_port=args.metrics_port,
        topology=args.topology,
        metrics_addr=args.metrics_addr,
    )


def main(opts: AgentOptions, store_cfg: StoreConfig, zygote: Zygote | None = None) -> int:
    """Run an agent until it is told to stop or the job ends. Forks the zygote first (before any
    thread exists), unless one is given."""
    zygote = zygote or Zygote()
    setup_logging(
        f"agent {opts.node}", opts.run_dir / "logs" / f"agent_{opts.node}.log", logging.WARNING
    )
    retry = max(0.5, opts.heartbeat_interval)
    store = Store(dataclasses.replace(store_cfg, retry_s=retry, request_timeout_s=2.0))
    agent = Agent(store, opts, zygote)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: (agent.stopping.set(), agent.wake()))
    logger.info("agent %s of job %s starting (pid %d)", opts.node, opts.job_id, os.getpid())
    return agent.run()


def run_from_args(args: argparse.Namespace) -> int:
    """``megascale agent``: the zygote is forked before anything else starts a thread."""
    opts, store_cfg = options_from_args(args), store_config(args)  # refuse bad input first
    return main(opts, store_cfg, Zygote())
