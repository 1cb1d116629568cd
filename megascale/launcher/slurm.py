"""``megascale launch --slurm``: the fault-tolerant stack inside a Slurm allocation.

::

    salloc -N 3 --no-kill megascale launch CONFIG --slurm --nodes 2 --nproc-per-node 8 \\
        --run-dir /shared/runs/job1        # or the same line in an sbatch script

Where the launcher runs (the batch script's node, or the host ``salloc`` was called on) it starts
the job's etcd on this host's address on the cluster network (``--addr``; default: the address
this host's name resolves to), authenticated before it listens, and the controller, as
``megascale launch`` does on one machine. On every host of the allocation it starts one agent with
its own ``srun`` step (``srun --nodes 1 --ntasks 1 --nodelist HOST``): one step per host, so a
host that dies takes only its own step with it. Each agent listens on the address its host's name
resolves to, which must be an address of that host on the training network (checked by the
agent, one line when it is not). The first ``--nodes`` hosts to register form the job; the rest
of the allocation are its spares (``--spares`` takes fewer). The run directory must be on a file
system every host of the allocation shares.

The agents are megascale's own: a host that stops heartbeating is detected by its lease (seconds),
not by Slurm's ``NODE_FAIL`` (``SlurmdTimeout`` later), evicted, and replaced by a spare of the
allocation. Run the allocation with ``--no-kill`` (``#SBATCH --no-kill``): without it Slurm ends
the whole allocation when one of its hosts fails. Faults that name a node by index (``node-N``)
or kill an agent's process on this machine cannot be injected here: the hosts are the
allocation's.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from megascale.launcher.cluster import ETCD_PASSWORD_FILE, LaunchError, LocalCluster

INDEXED_FAULTS = ("kill-agent", "slow-node", "fail-selfcheck", "break-net")
"""``--inject`` kinds that name a node by index or act on an agent's process on this machine."""


def allocation_hosts(environ: dict[str, str] | None = None) -> list[str]:
    """The host names of the allocation this process runs in (``SLURM_JOB_NODELIST`` expanded by
    ``scontrol show hostnames``), in Slurm's order; LaunchError (one line) outside one."""
    env = os.environ if environ is None else environ
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not env.get("SLURM_JOB_ID") or not nodelist:
        raise LaunchError(
            "--slurm: not inside a Slurm allocation (SLURM_JOB_ID / SLURM_JOB_NODELIST unset); "
            "run it from an sbatch script or under salloc"
        )
    for tool in ("scontrol", "srun"):
        if shutil.which(tool) is None:
            raise LaunchError(f"--slurm: {tool} is not on PATH")
    proc = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
    )
    hosts = proc.stdout.split()
    if proc.returncode or not hosts:
        why = (proc.stderr.strip() or "no host names").splitlines()[-1]
        raise LaunchError(f"--slurm: SLURM_JOB_NODELIST = {nodelist!r}: {why}")
    return hosts


def host_address(name: str, flag: str) -> str:
    """The IPv4 address ``name`` resolves to; LaunchError when it resolves nowhere or to
    loopback (its ranks would dial their peers at 127.x)."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise LaunchError(f"{flag} {name!r}: does not resolve ({e})") from None
    addr = str(infos[0][4][0])
    if ipaddress.ip_address(addr).is_loopback:
        raise LaunchError(
            f"{flag} {name!r} resolves to {addr}, a loopback address: host names must resolve "
            "to their address on the training network (or give this host's with --addr)"
        )
    return addr


def launch(opts: Any) -> int:
    """``megascale launch --slurm``: ``cluster.launch`` with the allocation's hosts."""
    from megascale.launcher.cluster import launch as launch_cluster

    opts.notes = [*opts.notes, *check_slurm(opts)]
    return launch_cluster(opts, SlurmCluster)


def check_slurm(opts: Any) -> list[str]:
    """Check ``--slurm``'s options against the allocation; fills in ``opts.hosts``,
    ``opts.addr`` and ``opts.spares`` (None: the rest of the allocation). Notes for the log."""
    hosts = allocation_hosts()
    if opts.nodes > len(hosts):
        raise LaunchError(
            f"--nodes = {opts.nodes}: the allocation has {len(hosts)} host(s) ({', '.join(hosts)})"
        )
    spares = len(hosts) - opts.nodes if opts.spares is None else opts.spares
    if opts.nodes + spares > len(hosts):
        raise LaunchError(
            f"--nodes + --spares = {opts.nodes + spares}: the allocation has {len(hosts)} host(s)"
        )
    indexed = sorted({f.kind for f in opts.faults} & set(INDEXED_FAULTS))
    if indexed:
        raise LaunchError(
            f"--inject {', '.join(indexed)}: not with --slurm (they name a node by index or kill "
            "a process on this machine; the hosts here are the allocation's)"
        )
    opts.hosts, opts.spares = hosts[: opts.nodes + spares], spares
    opts.addr = opts.addr or host_address(socket.gethostname(), "this host's name")
    from megascale.process import check_listen_address

    try:
        check_listen_address("--addr", opts.addr)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    for host in opts.hosts:
        host_address(host, "allocation host")
    return [f"Slurm allocation {os.environ['SLURM_JOB_ID']}: hosts {', '.join(opts.hosts)}"]


class SrunStep:
    """An agent's ``srun`` step, with the part of ``multiprocessing.Process`` the launcher's
    monitor uses (``pid``, ``is_alive``, ``join``, ``terminate``, ``kill``, ``exitcode``)."""

    def __init__(self, argv: list[str], log: Path) -> None:
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        self.pid = self.proc.pid

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        """srun passes SIGTERM on to its task (the agent stops its workers and exits)."""
        if self.is_alive():
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.is_alive():
            self.proc.kill()


class SlurmCluster(LocalCluster):
    """``LocalCluster`` whose etcd listens on the cluster network and whose agents are ``srun``
    steps on the allocation's hosts (see the module docstring)."""

    def etcd_host(self) -> str:
        return self.opts.addr

    def node_names(self) -> list[str]:
        return list(self.opts.hosts)

    def visible_devices(self, node: str) -> str | None:
        return None  # each host's own GPUs, as Slurm gives them to the step

    def agent_argv(self, node: str) -> list[str]:
        o = self.opts
        addr = host_address(node, "allocation host")
        argv = [
            "srun", "--nodes", "1", "--ntasks", "1", "--nodelist", node, "--kill-on-bad-exit=0",
            "--job-name", f"megascale-agent-{node}",
            sys.executable, "-m", "megascale.cli", "agent", str(self.run_dir / "job.toml"),
            "--job", o.job_id, "--node", node, "--nproc-per-node", str(o.nproc_per_node),
            "--run-dir", str(self.run_dir), "--heartbeat-interval", str(o.heartbeat_interval),
            "--addr", addr, "--metrics-addr", addr, "--metrics-port", "0",
            "--selfcheck", o.selfcheck, "--endpoints", self.etcd.endpoint,
            "--user", "root", "--password-file", str(self.run_dir / ETCD_PASSWORD_FILE),
        ]  # fmt: skip
        for spec in o.faults:
            if spec.side != "launcher":
                argv += ["--inject", spec.text]
        if o.topology.get(node):
            argv += ["--topology", o.topology[node]]
        return argv

    def start_agents(self, wait_s: float = 120.0) -> None:
        """One ``srun`` step per host at once, then wait until every agent has registered."""
        logs = self.run_dir / "logs"
        for node in self.node_names():
            self.agents[node] = SrunStep(self.agent_argv(node), logs / f"srun_{node}.out")
        self.wait_registered(self.node_names(), wait_s)

    def start_agent(self, node: str, wait_s: float = 120.0) -> None:
        """A lost host's agent again (the monitor, under ``policy = "wait"`` with no spares)."""
        self.agents[node] = SrunStep(
            self.agent_argv(node), self.run_dir / "logs" / f"srun_{node}.out"
        )
        self.wait_registered([node], wait_s)

    def wait_registered(self, nodes: list[str], wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        waiting = list(nodes)
        while waiting:
            waiting = [n for n in waiting if self.store.get(self.keys.node(n)) is None]
            for node in waiting:
                step = self.agents[node]
                if not step.is_alive() or time.monotonic() > deadline:
                    log = self.run_dir / "logs" / f"srun_{node}.out"
                    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                    raise RuntimeError(
                        f"agent {node} did not register (srun exit code {step.exitcode}): "
                        + " | ".join(tail)
                    )
            time.sleep(0.1)
