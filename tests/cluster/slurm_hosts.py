"""A real Slurm (Debian's 22.05: slurmctld, slurmd, munge) across the hosts of a
``netns_hosts.Cluster``::

    with Slurm(cluster, ctl="ctl", nodes=["node1", "node2"]) as slurm:   # up in a few seconds
        slurm.srun(["hostname"], nodes=2)                                 # ["node1", "node2"]

``munged`` (foreground), ``slurmctld`` and a ``slurmd`` per node each run inside their host, so
``Cluster.down`` (or ``kill_all``) ends them with everything else; ``stop`` ends them first, by
pid. Client commands (``srun``, ``sinfo``) run in the controller's host with ``SLURM_CONF`` set.
Everything lives in one directory (state, spools, logs, munge key and socket) that ``stop``
removes. Every directory above munge's socket is o+x (munged refuses otherwise); the nodes declare
``CPUs=2`` each whatever this machine has (``SlurmdParameters=config_overrides``).

``unavailable()`` says in one line why Slurm cannot run here (None: it can).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from netns_hosts import Cluster, HostsError

BINARIES = ("slurmctld", "slurmd", "srun", "salloc", "sinfo", "scontrol", "munged")


def unavailable() -> str | None:
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"Slurm tests need {', '.join(missing)} (scripts/install-test-deps.sh installs them)"
    return None


class Slurm:
    def __init__(
        self, cluster: Cluster, ctl: str, nodes: Sequence[str], slurmd_timeout_s: int = 10
    ) -> None:
        self.cluster, self.ctl, self.nodes = cluster, ctl, list(nodes)
        self.slurmd_timeout_s = slurmd_timeout_s
        self.dir = Path(tempfile.mkdtemp(prefix=f"{cluster.prefix}-slurm-"))
        self.conf = self.dir / "etc" / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf), **(extra or {})}

    def up(self, wait_s: float = 60.0) -> Slurm:
        try:
            self._files()
            d = self.dir
            self._daemon("munged", self.ctl, [
                "munged", "--foreground", "--force", f"--socket={d}/munge-run/munge.sock",
                f"--key-file={d}/munge/munge.key", f"--pid-file={d}/munge-run/munged.pid",
                f"--seed-file={d}/munge/seed", f"--log-file={d}/log/munged.log",
            ])  # fmt: skip
            self._wait(lambda: (d / "munge-run" / "munge.sock").exists(), 10, "munged")
            self._daemon("slurmctld", self.ctl, ["slurmctld", "-D", "-c", "-f", str(self.conf)])
            for node in self.nodes:
                self._daemon(f"slurmd-{node}", node, ["slurmd", "-D", "-f", str(self.conf)])
            want = f"{len(self.nodes)} idle"
            self._wait(lambda: self.sinfo() == want, wait_s, f"{want} nodes in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def _files(self) -> None:
        d = self.dir
        for sub in ("etc", "state", "spool", "log", "run", "munge", "munge-run"):
            (d / sub).mkdir()
        for node in self.nodes:
            (d / "spool" / node).mkdir()
        for path in (d, d / "munge-run"):
            path.chmod(0o755)
        (d / "munge").chmod(0o700)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        ctl_addr = self.cluster.addr(self.ctl)
        lines = [
            f"ClusterName={self.cluster.prefix}",
            f"SlurmctldHost={self.ctl}({ctl_addr})",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={d}/munge-run/munge.sock",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/run/slurmctld.pid",
            f"SlurmdPidFile={d}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            f"SlurmdTimeout={self.slurmd_timeout_s}",
            "MessageTimeout=5",
            "KillWait=3",
            "SlurmdParameters=config_overrides",
        ]
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname={node} NodeAddr={self.cluster.addr(node)} "
                "CPUs=2 RealMemory=1000 State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")

    def _daemon(self, name: str, host: str, argv: list[str]) -> None:
        log = self.dir / "log" / f"{name}.out"
        self.procs[name] = self.cluster.run(host, argv, env=self.env(), log=log)

    def _wait(self, ready, wait_s: float, what: str) -> None:
        deadline = time.monotonic() + wait_s
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise HostsError(f"Slurm: no {what} (exited: {dead}); {self.log_tail()}")
            time.sleep(0.2)

    def sinfo(self) -> str:
        argv = ["sinfo", "-h", "-o", "%D %t"]
        proc = subprocess.run(
            self.cluster.command(self.ctl, argv), capture_output=True, text=True, env=self.env()
        )
        return proc.stdout.strip()

    def srun(
        self,
        argv: Sequence[str],
        nodes: int,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 300,
        extra: Sequence[str] = (),
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess:
        """``srun -N nodes --ntasks-per-node 1 ARGV`` from the controller's host, in ``cwd`` (the
        tasks' working directory too); this process's environment plus ``env`` is exported to
        the tasks."""
        cmd = ["srun", "-N", str(nodes), "--ntasks-per-node", "1", *extra, *argv]
        return subprocess.run(
            self.cluster.command(self.ctl, cmd),
            capture_output=True,
            text=True,
            env=self.env(env),
            timeout=timeout_s,
            cwd=cwd,
        )

    def salloc(
        self, argv: Sequence[str], nodes: int, env: Mapping[str, str], log: Path, cwd: Path
    ) -> subprocess.Popen:
        """``salloc -N nodes --no-kill ARGV`` started in the controller's host (a login node's
        view: ARGV runs there, inside the allocation), output to ``log``."""
        cmd = ["salloc", "-N", str(nodes), "--no-kill", *argv]
        return self.cluster.run(self.ctl, cmd, env=self.env(env), log=log, cwd=cwd)

    def node_state(self, node: str) -> str:
        """Slurm's state of ``node`` (``idle``, ``alloc``, ``down*``, ...)."""
        argv = ["sinfo", "-h", "-n", node, "-o", "%t"]
        proc = subprocess.run(
            self.cluster.command(self.ctl, argv), capture_output=True, text=True, env=self.env()
        )
        return proc.stdout.strip()

    def log_tail(self, chars: int = 1500) -> str:
        out = []
        for path in sorted((self.dir / "log").glob("*")):
            text = path.read_text(errors="replace")[-chars:]
            if text.strip():
                out.append(f"--- {path.name}\n{text}")
        return "\n".join(out)

    def stop(self) -> None:
        """SIGKILL every daemon (by pid; slurmd's job steps go with their host's ``kill_all``),
        then remove the directory."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(5)
        self.procs.clear()
        for host in {self.ctl, *self.nodes}:
            self.cluster.kill_all(host)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Slurm:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.stop()
