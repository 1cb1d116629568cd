"""One fault-tolerant megascale job across the hosts of a ``netns_hosts.Cluster``.

The processes are those ``megascale launch`` forks on one machine, started here as their own
commands, each inside its host (``Cluster.run``), every one pointed at the etcd host's bridge
address and listening on its own host's address:

    ctl      etcd (the server binary ``megascale.etcd.server`` finds; client and peer URLs on
             ctl's address, no auth) and ``megascale controller``
    nodeN    ``megascale agent CONFIG --node nodeN --addr <nodeN's address>``: heartbeats to etcd,
             and its workers (``megascale train`` ranks) rendezvous at the master node's address

The first ``nodes`` agents of the list register before the others start: they form the first
generation (which of them gets rank 0 is the controller's choice: see its ``generation_start``
event) and the rest wait as spares. The run directory (config, checkpoints, logs, ``events.jsonl``) is on the
file system every host shares, as a job's shared file system would be.

Gloo picks its network device by resolving the host's name (``GLOO_SOCKET_IFNAME`` is not set
here, nor by the agent): each host's name resolves to its bridge address (``netns_hosts``), as
on a cluster whose DNS names the training network. Where a name resolves nowhere, gloo falls back
to loopback and the ranks on other hosts cannot connect (seen: ``connectFullMesh ... remote=
[127.0.0.1]``, the job fails after its restart).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from netns_hosts import Cluster

REPO = Path(__file__).resolve().parents[2]
ETCD_PORT = 2379
STEPS = 20
OVERRIDES = [f"train.steps={STEPS}", "checkpoint.interval=4", "train.log_interval=1"]
"""The job every multi-host test runs: the tiny preset, 2 ranks (2 nodes x 1, or 2 hosts under
Slurm x 1), these overrides."""


@dataclass
class MultiHostJob:
    cluster: Cluster
    run_dir: Path
    workers: list[str]
    """Hosts with an agent, in start order: the first ``nodes`` train, the others are spares."""
    nodes: int
    overrides: list[str]
    etcd_host: str = "ctl"
    job_id: str = "multihost"
    heartbeat_interval: float = 0.5
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"{self.cluster.addr(self.etcd_host)}:{ETCD_PORT}"

    def env(self) -> dict[str, str]:
        return {
            **{k: v for k, v in os.environ.items() if not k.startswith("MEGASCALE_")},
            "PYTHONPATH": str(REPO),
        }

    def log(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.out"

    # -- start ----------------------------------------------------------------------------------

    def start(self, wait_s: float = 120.0) -> None:
        """etcd; the training nodes' agents (together) until all have registered; then the
        spares' agents and the controller (together), until the spares have registered too. A
        spare that registers after the first generation started waits as a spare all the same."""
        self.write_config()
        self.start_etcd()
        first, spares = self.workers[: self.nodes], self.workers[self.nodes :]
        for host in first:
            self.start_agent(host)
        for host in first:
            self.wait_registered(host, wait_s)
        for host in spares:
            self.start_agent(host)
        self.start_controller()
        for host in spares:
            self.wait_registered(host, wait_s)

    def write_config(self) -> None:
        """``RUN_DIR/job.toml``: the tiny preset with ``overrides``, validated for ``nodes``."""
        from megascale import config

        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        job = config.validate(config.load("tiny", self.overrides), self.nodes, "gloo")
        (self.run_dir / "job.toml").write_text(config.to_toml(job))

    def start_etcd(self, wait_s: float = 60.0) -> None:
        """``megascale etcd`` on the etcd host's address, authenticated: the job's password in
        the shared run directory, given to the controller and the agents (``credentials``)."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "megascale.cli", "etcd", "--addr",
                self.cluster.addr(self.etcd_host), "--port", str(ETCD_PORT),
                "--run-dir", str(self.run_dir)]  # fmt: skip
        proc = self.cluster.run(self.etcd_host, argv, env=self.env(), log=self.log("etcd"))
        self.procs["etcd"] = proc
        deadline = time.monotonic() + wait_s
        while "megascale etcd: serving" not in self.tail("etcd"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd on {self.etcd_host} did not start: {self.tail('etcd')}")
            time.sleep(0.1)

    @property
    def password_file(self) -> Path:
        return self.run_dir / "etcd.password"

    def credentials(self) -> list[str]:
        return ["--user", "root", "--password-file", str(self.password_file)]

    def megascale(self, host: str, name: str, args: list[str]) -> subprocess.Popen:
        argv = [sys.executable, "-m", "megascale.cli", *args, "--endpoints", self.endpoint]
        argv += self.credentials()
        proc = self.cluster.run(host, argv, env=self.env(), log=self.log(name))
        self.procs[name] = proc
        return proc

    def start_agent(self, host: str) -> subprocess.Popen:
        a = self.cluster.addr(host)
        return self.megascale(host, f"agent-{host}", [
            "agent", str(self.run_dir / "job.toml"), "--job", self.job_id, "--node", host,
            "--nproc-per-node", "1", "--run-dir", str(self.run_dir),
            "--heartbeat-interval", str(self.heartbeat_interval), "--addr", a,
            "--selfcheck", "builtin", "--metrics-port", "0", "--metrics-addr", a,
        ])  # fmt: skip

    def start_controller(
        self, host: str | None = None, name: str = "controller", cid: str = "controller-0"
    ) -> subprocess.Popen:
        """``megascale controller --id CID`` on ``host`` (default: the etcd host); a second one
        with another id is its standby."""
        host = host or self.etcd_host
        a = self.cluster.addr(host)
        return self.megascale(host, name, [
            "controller", "--job", self.job_id, "--run-dir", str(self.run_dir),
            "--nodes", str(self.nodes), "--nproc-per-node", "1",
            "--heartbeat-interval", str(self.heartbeat_interval), "--init-timeout", "120",
            "--metrics-port", "0", "--metrics-addr", a, "--id", cid,
        ])  # fmt: skip

    def wait_registered(self, host: str, wait_s: float) -> None:
        from megascale.etcd.keys import JobKeys

        key = JobKeys(self.job_id).node(host)
        deadline = time.monotonic() + wait_s
        while key not in self.etcdctl("get", key, "--keys-only"):
            proc = self.procs[f"agent-{host}"]
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent {host} did not register: {self.tail(f'agent-{host}')}")
            time.sleep(0.2)

    def etcdctl(self, *args: str, host: str | None = None, auth: bool = True) -> str:
        """``etcdctl`` (v3 API) run in ``host`` (default: the etcd host), with the job's
        credentials unless ``auth`` is false; its stdout and stderr."""
        from megascale.etcd.server import find_etcd_binary

        ctl = str(Path(find_etcd_binary()).with_name("etcdctl"))
        argv = [ctl, "--endpoints", self.endpoint, "--command-timeout=2s"]
        if auth:
            argv.append(f"--user=root:{self.password_file.read_text().strip()}")
        proc = subprocess.run(
            self.cluster.command(host or self.etcd_host, [*argv, *args]),
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        return proc.stdout + proc.stderr

    # -- run and stop ---------------------------------------------------------------------------

    def wait(self, timeout_s: float) -> int:
        """The controller's exit status (0: the job finished); TimeoutError after ``timeout_s``."""
        try:
            return self.procs["controller"].wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"the job did not end within {timeout_s:.0f} s: {self.tail('controller')}"
            ) from None

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM agents and controller (agents stop their workers), then etcd; SIGKILL what is
        left after ``grace_s``. The cluster's ``kill_all`` is the backstop for anything they forked."""
        agents_first = [p for n, p in self.procs.items() if n != "etcd"]
        for group in (agents_first, [self.procs[n] for n in self.procs if n == "etcd"]):
            for proc in group:
                if proc.poll() is None:
                    proc.terminate()
            deadline = time.monotonic() + grace_s
            for proc in group:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)

    def tail(self, name: str, chars: int = 3000) -> str:
        try:
            return self.log(name).read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"(no log: {e})"

    def steps(self) -> list[dict]:
        """``metrics.jsonl`` records so far (one per logged step)."""
        return read_steps(self.run_dir)


def read_steps(run_dir: Path) -> list[dict]:
    """``RUN_DIR/metrics.jsonl`` records so far; a line being written is skipped."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
