"""The real Kubernetes CRD API server for tests: ``k8s.io/apiextensions-apiserver`` built from
Debian's Go sources by ``tests/k8s/apiserver/build.sh`` (``make test`` builds it once; the binary
is cached under ``~/.cache/megascale/apiserver/<key>/``), on a real etcd.

It is the CRD half of kube-apiserver (validation, defaulting, CEL, status subresource, server-side
dry run) without core/v1, authentication or admission. Requests go through ``request()``: plain
HTTPS + JSON, so every query parameter a test relies on (``dryRun``, ``fieldValidation``) is in
sight.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from megascale.k8s import validation

BUILD_SCRIPT = Path(__file__).resolve().parent / "apiserver" / "build.sh"
START_TIMEOUT_S = 30.0


def find_binary() -> tuple[str | None, str]:
    """``(path, "")`` of the cached server binary, or ``(None, why)`` in one line."""
    found = subprocess.run([str(BUILD_SCRIPT), "--check"], capture_output=True, text=True)
    if found.returncode == 0:
        return found.stdout.strip(), ""
    why = (found.stderr.strip().splitlines() or ["not built"])[-1]
    return None, f"{why}; tests/k8s/apiserver/build.sh builds it (make test runs it)"


class APIServer:
    """The server binary on ``etcd`` (a running ``EmbeddedEtcd``), on a free loopback port.

    ``start()`` returns once ``/readyz`` answers 200 (0.3-1 s warm); ``stop()`` terminates it.
    Each instance gets its own etcd prefix, so several may share one etcd.
    """

    def __init__(self, binary: str, etcd_url: str) -> None:
        self.binary = binary
        self.etcd_url = etcd_url
        self.port = _free_port()
        self.base = f"https://127.0.0.1:{self.port}"
        self._tmp = tempfile.TemporaryDirectory(prefix="megascale-apiserver-")
        self._log = Path(self._tmp.name) / "apiserver.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._ssl = ssl.create_default_context()
        self._ssl.check_hostname = False
        self._ssl.verify_mode = ssl.CERT_NONE

    def start(self) -> APIServer:
        command = [
            self.binary,
            f"--etcd-servers={self.etcd_url}",
            f"--etcd-prefix=/megascale-test-{self.port}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--cert-dir={self._tmp.name}",
        ]
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the API server exited: {self.log_tail()}")
            try:
                if self.request("GET", "/readyz")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"the API server was not ready in {START_TIMEOUT_S} s: {self.log_tail()}"
        )

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._tmp.cleanup()

    def log_tail(self, chars: int = 3000) -> str:
        return self._log.read_text(errors="replace")[-chars:] if self._log.exists() else ""

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        **query: str,
    ) -> tuple[int, Any]:
        """``(status code, decoded JSON body or text)``; never raises for an HTTP error."""
        url = self.base + path
        if query:
            url += "?" + "&".join(f"{k}={v}" for k, v in query.items())
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=self._ssl, timeout=30) as resp:
                code, raw = resp.status, resp.read()
        except urllib.error.HTTPError as error:
            code, raw = error.code, error.read()
        try:
            return code, json.loads(raw)
        except ValueError:
            return code, raw.decode(errors="replace")

    def kubeconfig(self) -> dict[str, Any]:
        """A kubeconfig for this server (anonymous; its certificate is self-signed)."""
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "test", "cluster": {"server": self.base, "insecure-skip-tls-verify": True}}
            ],
            "users": [{"name": "anonymous", "user": {}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "anonymous"}}],
            "current-context": "test",
        }

    def lightkube_client(self, field_manager: str) -> Any:
        """A lightkube ``Client`` for this server (what the operator uses on a cluster)."""
        from lightkube import Client, KubeConfig

        return Client(KubeConfig.from_dict(self.kubeconfig()), field_manager=field_manager)

    def wait_for(self, path: str, predicate, timeout_s: float = 30.0) -> Any:
        """GET ``path`` until ``predicate(body)`` holds; the last body."""
        deadline = time.monotonic() + timeout_s
        while True:
            code, body = self.request("GET", path)
            if code == 200 and predicate(body):
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"{path}: condition not met in {timeout_s} s: {body}")
            time.sleep(0.05)

    def __enter__(self) -> APIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def established(crd: dict[str, Any]) -> bool:
    status = crd.get("status") or {}
    conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
    return conditions.get("Established") == "True"


# What the server says for the bad jobs that break the structural schema (the CEL ones are
# checked against their rule's message).
SCHEMA_MESSAGES = {
    "replicas < 1": "spec.replicaSpecs.Worker.replicas: Invalid value: 0: "
    "spec.replicaSpecs.Worker.replicas in body should be greater than or equal to 1",
    "replicas of the wrong type": "spec.replicaSpecs.Worker.replicas: Invalid value: "
    '"string": spec.replicaSpecs.Worker.replicas in body must be of type integer',
    "suspend of the wrong type": "spec.runPolicy.suspend in body must be of type boolean",
    "template missing": "spec.replicaSpecs.Worker.template: Required value",
    "unknown field in spec": 'unknown field "spec.workers"',
    "unknown nested field": 'unknown field "spec.faultTolerance.spares"',
    "gang not in the enum": 'spec.runPolicy.scheduling.gang: Unsupported value: "kueue"',
    "bad etcd endpoint": "spec.etcd.endpoints[0] in body should match",
}


def server_message(case: str) -> str:
    """What the server's refusal of the bad job ``case`` of test_crd contains: the schema's words,
    or the message of the CEL rule the offline expectation cites."""
    if case in SCHEMA_MESSAGES:
        return SCHEMA_MESSAGES[case]
    from test_crd import BAD

    offline = BAD[case][1]
    for _, _, rule in validation.cel_rules():
        if rule["message"] in offline or offline.split('": ')[-1] in rule["message"]:
            return rule["message"]
    raise AssertionError(f"no rule says {offline!r}")
