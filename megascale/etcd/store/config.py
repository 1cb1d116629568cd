"""How the etcd client reaches etcd, and how etcd refuses: ``StoreConfig`` (endpoints, TLS,
credentials, timeouts; ``parse`` for a command-line string), endpoint parsing, and the errors
(``StoreError`` and its subclasses, and which of them mean an expired token). Pure data, no I/O;
``megascale.etcd.store`` re-exports every public name.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class StoreError(RuntimeError):
    """etcd refused a request; ``code`` is the gRPC status code etcd gave (0 when none)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class StoreUnavailable(StoreError):
    """No endpoint answered (or the cluster had no leader) for ``StoreConfig.retry_s`` seconds."""


class LeaseNotFound(StoreError):
    """The lease expired or was revoked."""


_AUTH_ERRORS = ("invalid auth token", "user name is empty", "authentication failed")


def _is_auth_error(error: StoreError) -> bool:
    return any(message in str(error) for message in _AUTH_ERRORS)


@dataclass(frozen=True)
class StoreConfig:
    """Where etcd is and how to reach it. ``parse`` builds one from a command-line string."""

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    """``host:port`` (plain HTTP) or ``http(s)://host:port``; on failure the next one is tried."""
    ca_file: str | None = None
    """PEM CA bundle that signed the server certificates (https endpoints); system CAs when None."""
    cert_file: str | None = None
    """PEM client certificate, for servers started with ``--client-cert-auth``."""
    key_file: str | None = None
    """PEM private key of ``cert_file``."""
    username: str | None = None
    """etcd user (etcd auth enabled); needs ``password``."""
    password: str | None = None
    request_timeout_s: float = 5.0
    """Socket timeout of one request."""
    retry_s: float = 10.0
    """How long an operation keeps retrying while etcd is unreachable before StoreUnavailable."""

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("StoreConfig.endpoints = (): give at least one host:port")
        if (self.username is None) != (self.password is None):
            raise ValueError("StoreConfig.username/password: give both or neither")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("StoreConfig.cert_file/key_file: give both or neither")
        for ep in self.endpoints:
            _split_endpoint(ep)

    @classmethod
    def parse(cls, endpoints: str | Sequence[str], **kwargs: Any) -> StoreConfig:
        """``"127.0.0.1:2379"``, ``"https://a:2379,https://b:2379"`` or a list of those."""
        items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
        return cls(endpoints=tuple(e.strip() for e in items if e.strip()), **kwargs)


def _split_endpoint(endpoint: str) -> tuple[bool, str, int]:
    scheme, _, rest = endpoint.rpartition("://")
    if scheme not in ("", "http", "https"):
        raise ValueError(f"etcd endpoint {endpoint!r}: scheme must be http or https")
    host, _, port = rest.rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r}: expected host:port or http(s)://host:port")
    return scheme == "https", host, int(port)


@dataclass
class _Endpoint:
    tls: bool
    host: str
    port: int
    ssl_context: ssl.SSLContext | None = field(default=None, repr=False)
