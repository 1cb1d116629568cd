"""Hosts on one machine: each a network namespace plus a UTS namespace (its own hostname), with its
own IPv4 address on one Linux bridge, and network faults as verbs.

::

    with Cluster(["ctl", "node1", "node2"]) as c:     # up in ~1 s; down on exit, even on error
        c.run("node1", ["python", "-m", "http.server", "--bind", c.addr("node1")])
        c.partition("node1")      # every packet in or out of node1's eth0 dropped (carrier up)
        c.cut("node1", "node2")   # only that pair: the bridge drops frames between their ports
        c.loss("node2", 30)       # node2 drops 30 % of the packets it sends
        c.delay("node2", 50)      # each packet node2 sends waits 50 ms (NFQUEUE + nfq_delayer)
        c.crash("node2")          # link down, every process in its namespace SIGKILLed
        c.heal()                  # every fault above undone (a crashed host comes back empty)

Names: every namespace, link and nftables table carries ``prefix`` (default ``ms<pid>``), so two
sessions on one machine never touch each other's. Host ``i`` of the list is ``<subnet>.<10+i>``;
the bridge holds ``<subnet>.1`` so that the root namespace's route to the subnet is the bridge
and not the default route (``up`` checks ``ip route get`` and refuses otherwise). The hosts
themselves have no default route: a wrong address there fails as "Network unreachable".

Processes: ``run``/``exec`` start them inside a host (``nsenter`` into its network and UTS
namespaces, then a mount namespace of their own where the cluster's ``hosts`` file is mounted over
/etc/hosts: every host name resolves to its address, as a cluster's DNS would resolve it); they
share this machine's file system (nothing else is mounted) and pid space. ``down`` SIGKILLs every pid ``ip netns pids`` names for a host, never
anything found by name, then deletes the veth (synchronous) before the namespace (asynchronous),
unmounts the UTS files and deletes the bridge and the root namespace's table. ``leftovers`` lists
what is still there (empty after a clean ``down``).

Needs root, ``ip netns`` and ``unshare``; the fault verbs need ``nft`` (Debian ``nftables``) and
``delay`` needs ``iptables`` (this kernel's nftables has no ``queue`` expression, but the xt
NFQUEUE target that iptables-nft uses works).
``unavailable()`` says in one line why hosts cannot be made here (None: they can);
``reap_stale()`` removes the clusters of test runs that were killed before their teardown.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

DELAYER = Path(__file__).with_name("nfq_delayer.py")
OWNER_FILE = "owner"
FAULT_TABLES = ("part", "loss")
"""The nftables tables a fault verb adds inside a host (``inet <prefix>_<name>``)."""


class HostsError(RuntimeError):
    """A host could not be made or a command failed; the message says which command and why."""


def unavailable() -> str | None:
    """Why namespaces cannot be made here, in one line (None: they can)."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces); not root here"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"multi-host tests need `{tool}` (iproute2 / util-linux); not found"
    for tool, package in (("nft", "nftables"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return (
                f"multi-host tests need `{tool}` (scripts/install-test-deps.sh installs {package})"
            )
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()[:200]}"
    return None


def _sh(argv: Sequence[str], stdin: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise HostsError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()[:400]}")
    return proc.stdout


def _free_subnet() -> str:
    """The first 10.77.N (N < 250) that no address or route of the root namespace uses."""
    used = _sh(["ip", "-4", "-o", "addr"]) + _sh(["ip", "-4", "route", "show", "table", "all"])
    for n in range(250):
        if f"10.77.{n}." not in used:
            return f"10.77.{n}"
    raise HostsError("no free 10.77.N.0/24 subnet: every one is in use on this machine")


class Cluster:
    """Hosts as namespaces on one bridge (see the module docstring). Not thread-safe."""

    def __init__(
        self, names: Sequence[str], prefix: str | None = None, subnet: str | None = None
    ) -> None:
        if len(set(names)) != len(names) or not names or len(names) > 200:
            raise ValueError(f"names = {list(names)!r}: 1..200 distinct host names")
        self.prefix = prefix or f"ms{os.getpid() % 100000}"
        if len(self.prefix) + 1 + max(len(n) for n in names) > 15:
            raise ValueError(
                f"prefix {self.prefix!r} + host names: interface names are limited to 15 characters"
            )
        self.names = list(names)
        self.subnet = subnet
        self.bridge = f"{self.prefix}br"
        self.dir = Path(tempfile.gettempdir()) / f"{self.prefix}-hosts"  # made by ``up``
        self._delayers: dict[str, subprocess.Popen] = {}
        self._queues: dict[str, int] = {}
        self._crashed: set[str] = set()
        self._cut_pairs: set[tuple[str, str]] = set()
        self._up = False

    # -- naming ---------------------------------------------------------------------------------

    def ns(self, host: str) -> str:
        self._check(host)
        return f"{self.prefix}-{host}"

    def veth(self, host: str) -> str:
        """The host's port on the bridge (root namespace); inside the host it is ``eth0``."""
        return self.ns(host)

    def etc(self, host: str) -> Path:
        """The files mounted over /etc for what runs in ``host`` (its ``hosts`` names every host)."""
        return self.dir / "etc" / host

    def addr(self, host: str) -> str:
        self._check(host)
        return f"{self.subnet}.{10 + self.names.index(host)}"

    def _check(self, host: str) -> None:
        if host not in self.names:
            raise ValueError(f"host {host!r}: not one of {self.names}")

    # -- lifetime -------------------------------------------------------------------------------

    def up(self) -> Cluster:
        """Make the bridge and every host; on any failure, remove what was made and raise."""
        why = unavailable()
        if why:
            raise HostsError(why)
        self.subnet = self.subnet or _free_subnet()
        self.dir.mkdir(mode=0o700)
        owner = {"pid": os.getpid(), "start": _start_time(os.getpid()), "names": self.names}
        (self.dir / OWNER_FILE).write_text(json.dumps(owner))
        self._up = True
        try:
            _sh(["ip", "link", "add", self.bridge, "type", "bridge"])
            _sh(["ip", "link", "set", self.bridge, "up"])
            _sh(["ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge])
            self.check_route()
            for host in self.names:
                self._make_host(host)
        except BaseException:
            self.down()
            raise
        return self

    def _make_host(self, host: str) -> None:
        ns, veth = self.ns(host), self.veth(host)
        _sh(["ip", "netns", "add", ns])
        _sh(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _sh(["ip", "link", "set", veth, "master", self.bridge, "up"])
        _sh(["ip", "-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0"])
        _sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        uts = self.dir / "uts" / host
        uts.parent.mkdir(exist_ok=True)
        uts.touch()
        _sh(["unshare", f"--uts={uts}", "hostname", host])
        # Names resolve inside the hosts as a cluster's DNS would resolve them (``command``
        # mounts this file over /etc/hosts for what it runs).
        etc = self.etc(host)
        etc.mkdir(parents=True)
        lines = ["127.0.0.1 localhost"] + [f"{self.addr(h)} {h}" for h in self.names]
        (etc / "hosts").write_text("\n".join(lines) + "\n")

    def check_route(self) -> None:
        """Refuse (HostsError) unless this namespace reaches the subnet through the bridge: traffic
        to a host address must never follow the default route off the machine."""
        probe = f"{self.subnet}.11"
        route = _sh(["ip", "route", "get", probe])
        if f"dev {self.bridge} " not in route + " ":
            raise HostsError(f"`ip route get {probe}` is not via {self.bridge}: {route.strip()!r}")

    def down(self) -> None:
        """Remove everything ``up`` and the verbs made; safe to call twice and after a failure."""
        if not self._up:
            return
        for proc in self._delayers.values():
            _stop(proc)
        self._delayers.clear()
        for host in self.names:
            try:
                self.kill_all(host)
            except HostsError as e:  # go on removing; ``leftovers`` will name the survivor
                logger.error("%s", e)
        _sh(["nft", "delete", "table", "bridge", f"{self.prefix}_cut"], check=False)
        for host in self.names:
            # the veth first: its deletion is synchronous, the namespace's is not
            _sh(["ip", "link", "del", self.veth(host)], check=False)
            _sh(["ip", "netns", "del", self.ns(host)], check=False)
            uts = self.dir / "uts" / host
            if uts.exists():
                subprocess.run(["umount", str(uts)], capture_output=True)
        _sh(["ip", "link", "del", self.bridge], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
        self._up = False

    def leftovers(self) -> list[str]:
        """What of this cluster still exists: namespaces, links, tables, processes, mounts."""
        out = []
        netns = _sh(["ip", "netns", "list"], check=False)
        out += [f"netns {n.split()[0]}" for n in netns.splitlines() if n.startswith(self.prefix)]
        for line in _sh(["ip", "-o", "link"], check=False).splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if name.startswith(self.prefix):
                out.append(f"link {name}")
        if shutil.which("nft"):
            for line in _sh(["nft", "list", "tables"], check=False).splitlines():
                if self.prefix in line:
                    out.append(f"nft {line.strip()}")
        for host in self.names:
            if Path(f"/run/netns/{self.prefix}-{host}").exists():
                pids = self.pids(host)
                out += [f"pid {p} in {host}" for p in pids]
        mounts = Path("/proc/self/mounts").read_text()
        out += [f"mount {m.split()[1]}" for m in mounts.splitlines() if str(self.dir) in m]
        return out

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- processes ------------------------------------------------------------------------------

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside ``host`` (its network and UTS namespaces)."""
        uts = self.dir / "uts" / host
        return [
            "nsenter", f"--net=/run/netns/{self.ns(host)}", f"--uts={uts}", "--",
            # a mount namespace of its own, only to see the host's /etc/hosts
            "unshare", "--mount", "--propagation", "slave", "--",
            "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(self.etc(host) / "hosts"),
            *argv,
        ]  # fmt: skip

    def run(
        self,
        host: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        **popen: object,
    ) -> subprocess.Popen:
        """Start ``argv`` in ``host`` (output to ``log``, else discarded); ``down`` kills it."""
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (the child keeps it)
        try:
            return subprocess.Popen(
                self.command(host, argv),
                env=dict(env) if env is not None else None,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                **popen,  # type: ignore[arg-type]
            )
        finally:
            if log:
                out.close()  # type: ignore[union-attr]

    def exec(self, host: str, argv: Sequence[str], timeout: float = 30, check: bool = True) -> str:
        """Run ``argv`` in ``host`` to the end; its stdout (HostsError if it fails and ``check``)."""
        proc = subprocess.run(
            self.command(host, argv), capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise HostsError(
                f"{host}: {' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()[:400]}"
            )
        return proc.stdout

    def pids(self, host: str) -> list[int]:
        return [int(p) for p in _sh(["ip", "netns", "pids", self.ns(host)], check=False).split()]

    def kill_all(self, host: str, wait_s: float = 5.0) -> None:
        """SIGKILL every process in ``host``'s network namespace (by pid, repeatedly: a process
        may fork while the first ones die) until none is left or ``wait_s`` has passed."""
        deadline = time.monotonic() + wait_s
        while pids := self.pids(host):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise HostsError(f"{host}: processes {pids} survive SIGKILL")
            time.sleep(0.02)

    def listeners(self, host: str) -> list[tuple[str, int]]:
        """(address, port) of every listening TCP socket in ``host`` (``/proc/net/tcp{,6}``)."""
        out = []
        for name in ("tcp", "tcp6"):
            text = self.exec(host, ["cat", f"/proc/net/{name}"], check=False)
            for line in text.splitlines()[1:]:
                fields = line.split()
                if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                    hex_addr, hex_port = fields[1].split(":")
                    out.append((_decode_addr(hex_addr), int(hex_port, 16)))
        return sorted(set(out))

    # -- faults ---------------------------------------------------------------------------------

    def _nft(self, host: str | None, script: str) -> None:
        if shutil.which("nft") is None:
            raise HostsError("network faults need `nft` (Debian nftables); not found")
        argv = ["nft", "-f", "-"]
        if host is None:
            _sh(argv, stdin=script)
        else:
            proc = subprocess.run(
                self.command(host, argv), input=script, capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise HostsError(f"{host}: nft: {proc.stderr.strip()[:400]}")

    def _host_table(self, host: str, name: str, rules_in: str, rules_out: str) -> None:
        table = f"{self.prefix}_{name}"
        self._nft(
            host,
            f"""table inet {table} {{
  chain i {{ type filter hook input priority -10; policy accept; {rules_in} }}
  chain o {{ type filter hook output priority -10; policy accept; {rules_out} }}
}}
""",
        )

    def partition(self, host: str) -> None:
        """Drop every packet in and out of ``host``'s eth0 (the link and carrier stay up, as when
        a switch port stops forwarding): connections time out, nothing is refused."""
        self._host_table(host, "part", 'iifname "eth0" drop;', 'oifname "eth0" drop;')

    def cut(self, a: str, b: str) -> None:
        """Drop the frames between ``a`` and ``b`` only (at the bridge, both ways)."""
        self._cut_pairs.add((a, b))
        rules = " ".join(
            f'iifname "{self.veth(x)}" oifname "{self.veth(y)}" drop;'
            for x, y in sorted(self._cut_pairs | {(q, p) for p, q in self._cut_pairs})
        )
        table = f"{self.prefix}_cut"
        _sh(["nft", "delete", "table", "bridge", table], check=False)
        self._nft(
            None,
            f"table bridge {table} {{\n  chain f {{ type filter hook forward priority -10; "
            f"policy accept; {rules} }}\n}}\n",
        )

    def loss(self, host: str, pct: int) -> None:
        """Drop ``pct`` % of the packets ``host`` sends (random, per packet)."""
        if not 0 <= pct <= 100:
            raise ValueError(f"pct = {pct!r}: a percentage in [0, 100]")
        self._drop_table(host, "loss")
        pick = "" if pct == 100 else f"numgen random mod 100 < {pct} "  # nft: values 0..99 only
        self._host_table(host, "loss", "", f'oifname "eth0" {pick}drop;' if pct else "")

    def delay(self, host: str, ms: float, queue: int = 7) -> None:
        """Hold each packet ``host`` sends for ``ms`` (so a round trip to it gains ``ms``): its
        output goes to NFQUEUE ``queue`` with ``bypass`` (a dead delayer lets traffic through,
        never black-holes the host) and ``nfq_delayer.py`` in the host releases it."""
        if not 0 <= ms <= 60_000:
            raise ValueError(f"ms = {ms!r}: a delay in [0, 60000] milliseconds")
        self._undelay(host)
        if host in self._delayers:
            _stop(self._delayers.pop(host))
        proc = self.run(
            host,
            [sys.executable, str(DELAYER), str(queue), str(ms)],
            log=self.dir / f"delayer-{host}.log",
        )
        self._delayers[host] = proc
        time.sleep(0.2)  # the delayer binds the queue before packets are sent to it
        if proc.poll() is not None:
            log = (self.dir / f"delayer-{host}.log").read_text()[-400:]
            raise HostsError(f"{host}: the delayer exited ({proc.returncode}): {log}")
        # iptables (its nftables flavour, through the xt NFQUEUE target): this kernel has no
        # nftables ``queue`` expression
        self.exec(host, ["iptables", *self._delay_rule(queue, "-A")])
        self._queues[host] = queue

    @staticmethod
    def _delay_rule(queue: int, op: str) -> list[str]:
        return [
            op,
            "OUTPUT",
            "-o",
            "eth0",
            "-j",
            "NFQUEUE",
            "--queue-num",
            str(queue),
            "--queue-bypass",
        ]

    def _undelay(self, host: str) -> None:
        if host in self._queues:
            self.exec(
                host, ["iptables", *self._delay_rule(self._queues.pop(host), "-D")], check=False
            )

    def crash(self, host: str) -> None:
        """Power loss: the host's link goes down and every process in it is SIGKILLed."""
        _sh(["ip", "link", "set", self.veth(host), "down"])
        self._crashed.add(host)
        self._delayers.pop(host, None)
        self.kill_all(host)

    def heal(self) -> None:
        """Undo every fault: tables dropped, delayers stopped, crashed links up again."""
        for host, proc in list(self._delayers.items()):
            _stop(proc)
            del self._delayers[host]
        for host in self.names:
            self._undelay(host)
            for name in FAULT_TABLES:
                self._drop_table(host, name)
        _sh(["nft", "delete", "table", "bridge", f"{self.prefix}_cut"], check=False)
        self._cut_pairs.clear()
        for host in sorted(self._crashed):
            _sh(["ip", "link", "set", self.veth(host), "up"])
        self._crashed.clear()

    def _drop_table(self, host: str, name: str) -> None:
        if shutil.which("nft"):
            argv = ["nft", "delete", "table", "inet", f"{self.prefix}_{name}"]
            subprocess.run(self.command(host, argv), capture_output=True)


def reap_stale() -> list[str]:
    """Remove the clusters whose owner process is gone (a test run killed before its teardown):
    each ``up`` records its pid and hosts in ``<tmp>/<prefix>-hosts/owner``. Returns the prefixes
    removed. A cluster whose owner is alive is never touched."""
    reaped = []
    for owner_file in Path(tempfile.gettempdir()).glob(f"*-hosts/{OWNER_FILE}"):
        try:
            owner = json.loads(owner_file.read_text())
            pid, names = int(owner["pid"]), list(owner["names"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _start_time(pid) == owner.get("start"):
            continue  # alive (the same process, not a reused pid)
        prefix = owner_file.parent.name[: -len("-hosts")]
        stale = Cluster(names, prefix=prefix)
        stale._up = True
        stale.down()
        reaped.append(prefix)
    return reaped


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot; None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(5)


def _decode_addr(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    v6 = ipaddress.IPv6Address(words)
    return str(v6.ipv4_mapped or v6)
