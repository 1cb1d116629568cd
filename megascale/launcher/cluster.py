"""``megascale launch``: the whole fault-tolerant stack as real processes on this machine.

::

    megascale launch [CONFIG] [--set ...] --nodes 2 --nproc-per-node 1 --spares 1 \\
        --inject kill-worker:rank=1,step=12

starts an embedded etcd (free loopback port, temporary data dir, etcd auth on with a password
generated for the job: ``RUN_DIR/etcd.password``, mode 0600), M + S node agents (``node-0`` ..
``node-{M+S-1}``; the last S are spares), each with K workers, and a controller (plus a standby
with ``--standby-controller``), then watches (``monitor.Monitor``): it prints progress and the controller's decisions,
fires the launcher-side faults (``inject.py``) when the job reaches their step, and at the end
writes ``RUN_DIR/final.json`` (``summarize``) and stops everything. Exit code 0 iff training
finished.

Process model: the launcher imports torch and megatron-core once, then forks the agents and
controllers (``multiprocessing`` fork; each runs the same code as ``megascale agent`` /
``megascale controller``). Each agent forks its zygote before starting threads, and the zygote
forks the workers, so no process of the cluster pays the ~8 s import again. The launcher itself
never starts a thread (a fork of a threaded process may inherit a held lock).

A killed agent (``kill-agent``) takes its workers with it; with spares, a spare takes its slot;
without, under ``fault_tolerance.policy = "wait"`` the launcher starts the node's agent again once
its lease has expired and the controller waits for it (a repaired node re-registering), and the
controller restarts the job on it; under ``shrink`` the job goes on without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import secrets
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megascale import gpus, runfiles
from megascale.launcher.monitor import Monitor
from megascale.launcher.outcome import FINAL_FILE, summarize
from megascale.launcher.runlock import prepare_run_dir
from megascale.launcher.signals import StopSignals, reset_in_child
from megascale.machine_check import check_machine
from megascale.machine_check import gpu_count as _gpu_count
from megascale.messages import ControllerState, FinalOutcome, decoded
from megascale.probes import inject

logger = logging.getLogger("megascale.launch")


ETCD_USER = "root"
ETCD_PASSWORD_FILE = "etcd.password"
"""``RUN_DIR/etcd.password`` (mode 0600): the embedded etcd's password, for ``--user root
--password-file`` of a process started by hand."""


def write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600, also when it existed)."""
    runfiles.write_text(path, text + "\n", mode=0o600)  # a symlink at ``path`` is refused


def local_store_config(run_dir: Path | str, endpoint: str, **kwargs: Any) -> Any:
    """A ``StoreConfig`` for the embedded etcd of the local cluster that runs in ``run_dir``:
    its endpoint (the launcher logs it) and the job's credentials (``ETCD_PASSWORD_FILE``), for
    tools that read the job's keys (``megascale.etcd.keys``) while it runs."""
    from megascale.etcd.store import StoreConfig

    password = (Path(run_dir) / ETCD_PASSWORD_FILE).read_text().strip()
    return StoreConfig.parse(endpoint, username=ETCD_USER, password=password, **kwargs)


class LaunchError(ValueError):
    """A ``megascale launch`` argument is invalid; the message names it and what is accepted."""


@dataclass
class LaunchOptions:
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    nodes: int = 2
    nproc_per_node: int = 1
    spares: int | None = 0
    """None: 0 on one machine, the rest of the allocation under ``slurm``."""
    faults: list[inject.FaultSpec] = field(default_factory=list)
    run_dir: Path | None = None
    heartbeat_interval: float = 0.5
    standby_controller: bool = False
    fault_policy: str | None = None
    """``--fault-policy``; None: the config's ``fault_tolerance.policy``. Likewise below."""
    max_restarts: int | None = None
    restart_window_s: float | None = None
    selfcheck: str = "builtin"
    timeout_s: float | None = None
    node_wait_timeout_s: float | None = None
    """None: the config's, else 60 s."""
    topology_file: str | None = None
    """``--topology FILE`` (``neighbour_check.load_topology``), read into ``topology``."""
    topology: dict[str, str] = field(default_factory=dict)
    """node -> switch/rack label: the self-check's neighbour all-reduce groups nodes under one
    label; nodes not listed are grouped by order."""
    job_id: str = field(default_factory=lambda: f"local-{uuid.uuid4().hex[:8]}")
    slurm: bool = False
    """``--slurm``: agents on the hosts of the Slurm allocation (``launcher.slurm``)."""
    addr: str | None = None
    """``--addr``: this host's address on the cluster network, for etcd (``--slurm`` only)."""
    hosts: list[str] = field(default_factory=list)
    """The allocation's hosts that run agents (``--slurm``; filled in by ``check_slurm``)."""
    notes: list[str] = field(default_factory=list)
    """Lines for the log about what was filled in before ``check_options``."""


def check_options(opts: LaunchOptions) -> tuple[Any, list[str]]:
    """Validate everything before anything starts. Returns the validated ``JobConfig`` and notes
    on what was filled in (for the log)."""
    from megascale import config as config_mod

    for name, low in (("nodes", 1), ("nproc_per_node", 1), ("spares", 0)):
        value = getattr(opts, name)
        if value is None and name == "spares" and opts.slurm:
            continue  # --slurm: the rest of the allocation
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            flag = "--" + name.replace("_", "-")
            raise LaunchError(f"{flag} = {value!r}: must be an integer >= {low}")
    notes = list(opts.notes)
    if not opts.slurm and opts.addr is not None:
        raise LaunchError(f"--addr {opts.addr}: only with --slurm (one machine keeps loopback)")
    if opts.timeout_s is not None and not 0 < opts.timeout_s < float("inf"):
        raise LaunchError(f"--timeout = {opts.timeout_s}: must be a number of seconds > 0")
    if not 0.05 <= opts.heartbeat_interval <= 60:
        raise LaunchError(
            f"--heartbeat-interval = {opts.heartbeat_interval}: must be in [0.05, 60] seconds"
        )
    job = config_mod.load(opts.config, opts.overrides)
    ft = job.fault_tolerance  # the flags win over the config file
    for flag, key in (
        ("fault_policy", "policy"),
        ("max_restarts", "max_restarts"),
        ("restart_window_s", "restart_window_s"),
        ("node_wait_timeout_s", "node_wait_timeout_s"),
    ):
        if getattr(opts, flag) is not None:
            setattr(ft, key, getattr(opts, flag))
    if ft.node_wait_timeout_s is None:
        ft.node_wait_timeout_s = 60.0
    world = opts.nodes * opts.nproc_per_node
    job = config_mod.validate(job, world, "nccl" if _device(job) == "cuda" else "gloo")
    available = 0 if opts.slurm else _gpus(job)  # each host of an allocation has its own
    if available and (opts.nodes + opts.spares) * opts.nproc_per_node > available:
        raise LaunchError(
            f"train.device = cuda: (--nodes + --spares) x --nproc-per-node = "
            f"{(opts.nodes + opts.spares) * opts.nproc_per_node} ranks, but {available} GPUs here "
            "(each local node gets GPUs of its own)"
        )
    if opts.nproc_per_node % job.parallel.tp:
        raise LaunchError(
            f"parallel.tp = {job.parallel.tp} with --nproc-per-node {opts.nproc_per_node}: a "
            "tensor-parallel group must fit in one node (tp must divide nproc-per-node)"
        )
    inject.check_fits(
        opts.faults, nodes=opts.nodes + opts.spares, world_size=world, steps=job.train.steps
    )
    if opts.topology_file is not None:
        from megascale.agent.neighbour_check import TopologyError, load_topology

        nodes = opts.hosts or [f"node-{i}" for i in range(opts.nodes + opts.spares)]
        try:
            opts.topology = load_topology(opts.topology_file, nodes)
        except TopologyError as e:
            raise LaunchError(str(e)) from e
    check_machine(job, _device(job), ranks_here=0 if opts.slurm else world)
    if job.checkpoint.interval == 0:
        job.checkpoint.interval = max(1, job.train.steps // 5)
        notes.append(f"checkpoint.interval = 0: using {job.checkpoint.interval} (restarts resume)")
    leader_faults = {f.kind for f in opts.faults} & {"kill-controller", "pause-controller"}
    if leader_faults and not opts.standby_controller:
        opts.standby_controller = True
        notes.append(f"{', '.join(sorted(leader_faults))} injected: starting a standby controller")
    return job, notes


def _gpus(job: Any) -> int:
    """GPUs the local cluster splits among its nodes; 0 when training on CPU."""
    return _gpu_count() if _device(job) == "cuda" else 0


def _device(job: Any) -> str:
    if job.train.device != "auto":
        return job.train.device
    return "cuda" if _gpu_count() else "cpu"


# -- processes ----------------------------------------------------------------------------------


def _die_with_launcher(launcher_pid: int) -> None:
    """In a forked agent or controller: be SIGKILLed when the launcher dies (a launcher killed
    outright, e.g. by a test's timeout, leaves no process behind: an agent's zygote and workers
    die with the agent), and exit now if it already has (it died before the ``prctl``). Only
    here, in the launcher's fork path: ``megascale agent`` / ``megascale controller`` started
    by hand or by a pod are not tied to their parent. The launcher's signal handlers are not
    inherited (``signals.reset_in_child``)."""
    from megascale.launcher.lifetime import die_with_parent

    reset_in_child()
    die_with_parent(parent=launcher_pid)


def _agent_process(agent_opts: Any, store_cfg: Any, launcher_pid: int) -> None:
    _die_with_launcher(launcher_pid)
    from megascale.agent import service as agent

    sys.exit(agent.main(agent_opts, store_cfg))


def _controller_process(service_opts: Any, store_cfg: Any, launcher_pid: int) -> None:
    _die_with_launcher(launcher_pid)
    from megascale.controller import command as controller_command

    sys.exit(controller_command.serve(service_opts, store_cfg))


class LocalCluster:
    """The processes of one ``megascale launch`` (see the module docstring)."""

    def __init__(self, opts: LaunchOptions, job: Any, run_dir: Path) -> None:
        from megascale.etcd.keys import JobKeys
        from megascale.etcd.server import EmbeddedEtcd
        from megascale.etcd.store import Store, StoreConfig

        self.opts, self.job, self.run_dir = opts, job, run_dir
        self.keys = JobKeys(opts.job_id)
        # etcd dies with the launcher too (``die_with_parent``): the launcher starts and restarts
        # it from its only thread, the thread whose exit the parent-death signal follows.
        # Per-job credentials: no other process on the machine may read or write the job's keys;
        # etcd has them before it listens on TCP (``EmbeddedEtcd``'s auth bootstrap).
        password = secrets.token_urlsafe(32)
        write_secret(run_dir / ETCD_PASSWORD_FILE, password)
        self.etcd = EmbeddedEtcd(
            unsafe_no_fsync=True,
            die_with_parent=True,
            credentials=(ETCD_USER, password),
            host=self.etcd_host(),
        ).start()
        self.store_cfg = StoreConfig.parse(
            self.etcd.endpoint, username=ETCD_USER, password=password
        )
        self.store = Store(dataclasses.replace(self.store_cfg, retry_s=2.0))
        self.ctx = mp.get_context("fork")
        self.agents: dict[str, Any] = {}
        self.controllers: dict[str, Any] = {}

    def etcd_host(self) -> str:
        return "127.0.0.1"

    def node_names(self) -> list[str]:
        return [f"node-{i}" for i in range(self.opts.nodes + self.opts.spares)]

    def start_agents(self) -> None:
        for node in self.node_names():
            self.start_agent(node)

    def agent_options(self, node: str) -> Any:
        from megascale.agent.service import AgentOptions

        return AgentOptions(
            job_id=self.opts.job_id,
            node=node,
            run_dir=self.run_dir,
            config=str(self.run_dir / "job.toml"),
            nproc_per_node=self.opts.nproc_per_node,
            heartbeat_interval=self.opts.heartbeat_interval,
            faults=tuple(self.opts.faults),
            visible_devices=self.visible_devices(node),
            selfcheck=self.opts.selfcheck,
            metrics_port=0,
            topology=self.opts.topology.get(node),
        )

    def visible_devices(self, node: str) -> str | None:
        """Node i of a GPU machine gets GPUs i*K .. i*K+K-1 (``check_options`` made sure there
        are enough)."""
        if not _gpus(self.job):
            return None
        k, i = self.opts.nproc_per_node, int(node.rsplit("-", 1)[1])
        return ",".join(str(g) for g in range(i * k, (i + 1) * k))

    def start_agent(self, node: str, wait_s: float = 60.0) -> None:
        """Fork ``node``'s agent and wait until it has registered."""
        proc = self.ctx.Process(
            target=_agent_process,
            args=(self.agent_options(node), self.store_cfg, os.getpid()),
            name=node,
        )
        proc.start()
        self.agents[node] = proc
        deadline = time.monotonic() + wait_s
        while self.store.get(self.keys.node(node)) is None:
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"agent {node} did not register (exit code {proc.exitcode})")
            time.sleep(0.02)

    def start_controllers(self) -> None:
        from megascale.controller.policy import policy_for
        from megascale.train.resident import in_process_applies

        o, p, ft, t = self.opts, self.job.parallel, self.job.fault_tolerance, self.job.train
        policy = policy_for(
            o.nodes,
            o.nproc_per_node,
            tp=p.tp,
            pp=p.pp,
            heartbeat_interval=o.heartbeat_interval,
            fault_tolerance=ft,
            global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size,
            vpp=p.vpp,
            init_timeout_s=120.0,
            start_timeout_s=60.0,
            stop_timeout_s=15.0,
            recovery="in-process" if in_process_applies(self.job) else "restart",
        )
        self._policy = policy
        for i in range(2 if o.standby_controller else 1):
            name = f"controller-{i}"
            self.spawn_controller(name)
            if i == 0 and o.standby_controller:
                self.wait_for_leader(name)  # controller-0 leads; the next one is its standby
        self.log_metrics_urls()

    def spawn_controller(self, name: str) -> None:
        """Fork controller ``name``; it leads once elected, resuming from the state in etcd."""
        from megascale.agent.identity import config_hash
        from megascale.controller.policy import straggler_options
        from megascale.controller.service import ServiceOptions

        o = self.opts
        service_opts = ServiceOptions(
            o.job_id,
            self.run_dir,
            self._policy,
            name,
            o.heartbeat_interval,
            metrics_port=0,
            metrics_addr=self.etcd_host(),
            **straggler_options(self.job.fault_tolerance),
            train_steps=self.job.train.steps,
            config_hash=config_hash(str(self.run_dir / "job.toml")),  # as each agent hashes it
        )
        proc = self.ctx.Process(
            target=_controller_process, args=(service_opts, self.store_cfg, os.getpid()), name=name
        )
        proc.start()
        self.controllers[name] = proc
        logger.info("%s started (pid %d)", name, proc.pid)

    def wait_for_leader(self, name: str, wait_s: float = 30.0) -> None:
        """Wait until controller ``name`` holds the leader key (RuntimeError if it exits or has
        not won within ``wait_s``)."""
        from megascale.etcd.store import StoreError

        proc, key = self.controllers[name], self.keys.controller_leader
        deadline = time.monotonic() + wait_s
        holder: Any = None
        while True:
            try:
                kv = self.store.get(key)
                holder = kv.json().get("id") if kv is not None else None
            except (StoreError, ValueError) as e:
                holder = f"unreadable: {e}"
            if holder == name:
                return
            if not proc.is_alive():
                raise RuntimeError(f"controller {name} exited (code {proc.exitcode}) before it led")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"controller {name} did not become the leader within {wait_s:.0f} s "
                    f"({key} holder: {holder!r})"
                )
            time.sleep(0.02)

    def log_metrics_urls(self, wait_s: float = 5.0) -> None:
        """Log the controllers' and agents' ``/metrics`` URLs (``RUN_DIR/metrics/*.url``)."""
        names = [*self.controllers, *self.agents]
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if all((self.run_dir / "metrics" / f"{n}.url").exists() for n in names):
                break
            time.sleep(0.05)
        for n in names:
            path = self.run_dir / "metrics" / f"{n}.url"
            if path.exists():
                logger.info("%s metrics at %s", n, path.read_text().strip())

    def job_state(self) -> str | None:
        from megascale.etcd.store import StoreError

        try:
            kv = self.store.get(self.keys.state)
        except StoreError:
            return None
        state = decoded(ControllerState, kv)
        return state.state if state is not None else None

    def stop(self) -> None:
        """SIGTERM every agent and controller (agents stop their workers), then stop etcd."""
        for proc in [*self.agents.values(), *self.controllers.values()]:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 15
        for proc in [*self.agents.values(), *self.controllers.values()]:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.store.close()
        self.etcd.stop()


def launch(opts: LaunchOptions, cluster_class: type[LocalCluster] | None = None) -> int:
    """Run the local cluster to the end (see the module docstring); returns the exit code.
    SIGTERM and SIGINT stop it in order (``signals.StopSignals``), final.json included.
    ``cluster_class``: ``LocalCluster`` or a subclass (``launcher.slurm.SlurmCluster``)."""
    from megascale.config import to_toml
    from megascale.process import setup_logging

    job, notes = check_options(opts)  # LaunchError, ConfigError, InjectError: nothing started
    run_dir = Path(opts.run_dir or f"runs/launch-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    lock = prepare_run_dir(run_dir)  # RunDirError: another job holds it; nothing started
    runfiles.write_text(run_dir / "job.toml", to_toml(job))
    setup_logging("launch", run_dir / "logs" / "launch.log")
    stop_signals = StopSignals().install()
    started = time.monotonic()
    cluster_class = cluster_class or LocalCluster
    state, reason = _run_cluster(opts, job, notes, run_dir, stop_signals, started, cluster_class)
    wall_s = time.monotonic() - started
    try:
        final = summarize(run_dir, job, state, wall_s, opts, reason=reason)
    except Exception as e:  # every exit writes final.json: the summary without the run's details
        logger.exception("summarizing the run failed; final.json says only how it ended")
        final = FinalOutcome(
            finished=state == "finished", state=state, final_step=0, steps=job.train.steps,
            job_id=opts.job_id, run_dir=str(run_dir), wall_time_s=round(wall_s, 3),
            reason=reason or f"summary failed: {type(e).__name__}: {str(e)[:300]}",
        )  # fmt: skip
    path = run_dir / FINAL_FILE
    try:
        runfiles.write_text(path, json.dumps(final.encode(), indent=1, sort_keys=True) + "\n")
    except OSError as e:  # e.g. a symlink planted at final.json during the run: never followed
        logger.error("final.json not written: %s", e)
        stop_signals.restore()
        lock.release()
        return 1
    logger.info(
        "%s: step %s/%s, faults detected %s, recoveries %d, %.1f s; %s",
        state, final.final_step, job.train.steps, final.faults_detected,
        final.recoveries, final.wall_time_s, path,
    )  # fmt: skip
    stop_signals.restore()
    lock.release()
    return 0 if state == "finished" else 1


def _run_cluster(
    opts: LaunchOptions,
    job: Any,
    notes: list[str],
    run_dir: Path,
    stops: StopSignals,
    t0: float,
    cluster_class: type[LocalCluster],
) -> tuple[str, str | None]:
    """Start the cluster, watch it to the end, stop it; (state, reason the launcher stopped it)."""
    cluster: LocalCluster | None = None
    state, reason = "failed", None
    try:
        gpus.prefer_nvml_checks()  # imports below probe CUDA; the agents and workers fork later
        import megascale.train.command  # noqa: F401  (imported once here, inherited by every fork)
        import megascale.train.run  # noqa: F401

        cluster = cluster_class(opts, job, run_dir)
        logger.info(
            "job %s: %d nodes x %d ranks + %d spare(s); etcd at %s; run dir %s",
            opts.job_id, opts.nodes, opts.nproc_per_node, opts.spares, cluster.etcd.endpoint,
            run_dir,
        )  # fmt: skip
        for line in [*notes, *(f"fault to inject: {f.text}" for f in opts.faults)]:
            logger.info("%s", line)
        cluster.start_agents()
        cluster.start_controllers()
        monitor = Monitor(cluster)
        state = monitor.run(None if opts.timeout_s is None else t0 + opts.timeout_s)
        reason = monitor.reason or ("timed out" if state == "timeout" else None)
    except KeyboardInterrupt as e:
        state, reason = "interrupted", f"{e or 'SIGINT'} received"
        logger.warning("interrupted (%s): stopping", reason)
    except RuntimeError as e:  # a process that would not start
        logger.error("%s", e)
        reason = str(e)
    except Exception as e:  # the launcher's own bug or an unexpected error: stopped in order
        logger.exception("launcher error: stopping the job")
        reason = f"launcher error: {type(e).__name__}: {str(e)[:300]}"
    finally:
        stops.stopping()  # a second SIGINT/SIGTERM no longer cuts the stop short
        if cluster is not None:
            cluster.stop()
    return state, reason


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megascale.controller.fault_tolerance_flags import add_fault_tolerance_arguments

    parser.add_argument("--nodes", type=int, default=2, help="nodes per generation (M)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node (K)")
    parser.add_argument(
        "--spares",
        type=int,
        default=None,
        help="spare nodes (S; default 0, under --slurm the rest of the allocation)",
    )
    parser.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help=f"a fault to inject (repeatable): {inject.accepted()}",
    )
    parser.add_argument(
        "--run-dir", default=None, help="output directory (default: runs/launch-DATE)"
    )
    parser.add_argument("--heartbeat-interval", type=float, default=0.5, help="agents' (s)")
    parser.add_argument(
        "--standby-controller", action="store_true", help="also start a standby controller"
    )
    add_fault_tolerance_arguments(parser)
    parser.add_argument(
        "--selfcheck",
        choices=("auto", "builtin", "full"),
        default="builtin",
        help="node self-check after a fault: builtin (matmul, gloo all-reduce, disk; the default: "
        "every 'node' here shares one machine, so the full check's bandwidth thresholds would "
        "measure the others), full (+ megascale.agent.selfcheck), auto (full if present)",
    )
    parser.add_argument(
        "--topology",
        default=None,
        metavar="FILE",
        help='TOML or JSON mapping node names to switch/rack labels (node-0 = "tor-1"): the '
        "self-check's neighbour all-reduce pairs nodes under one label (default: by order)",
    )
    parser.add_argument("--timeout", type=float, default=None, help="give up after (s)")
    parser.add_argument(
        "--slurm",
        action="store_true",
        help="inside a Slurm allocation (sbatch/salloc, with --no-kill): etcd and the controller "
        "here, an agent per host of the allocation through srun, the rest of it as spares",
    )
    parser.add_argument(
        "--addr",
        default=None,
        help="--slurm: this host's address on the cluster network, for etcd (default: the "
        "address its host name resolves to)",
    )


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    """LaunchOptions from the command line (InjectError for a bad --inject, LaunchError for a
    bad fault-tolerance flag)."""
    from megascale.controller.fault_tolerance_flags import check_fault_tolerance_arguments

    try:
        check_fault_tolerance_arguments(args)
    except ValueError as e:
        raise LaunchError(str(e)) from e
    return LaunchOptions(
        config=args.config,
        overrides=list(args.overrides),
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        spares=0 if args.spares is None and not args.slurm else args.spares,
        faults=[inject.parse(s) for s in args.inject],
        run_dir=Path(args.run_dir) if args.run_dir else None,
        heartbeat_interval=args.heartbeat_interval,
        standby_controller=args.standby_controller,
        fault_policy=args.fault_policy,
        max_restarts=args.max_restarts,
        restart_window_s=args.restart_window,
        node_wait_timeout_s=args.node_wait_timeout,
        selfcheck=args.selfcheck,
        timeout_s=args.timeout,
        topology_file=args.topology,
        slurm=args.slurm,
        addr=args.addr,
    )
