"""The etcd store's values, apart from any connection: what ``Store`` takes and returns.

Pure data, no I/O and no threads: the errors (``StoreError`` and its subclasses, and which of
them mean an expired token), ``StoreConfig`` and endpoint parsing, value encoding (``encode`` and
the base64 and prefix-range helpers), what reads return (``KeyValue``, ``Snapshot``,
``WatchEvent``), the parts of a transaction (``Compare`` and its helpers, ``Put``/``Delete``/
``Get``, ``TxnResult``, ``TXN_MAX_OPS``) and ``Lease`` (``_lease_id`` takes one or its id).
``megascale.robustness.store`` re-exports every public name; import them from there.
"""

from __future__ import annotations

import base64
import json
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from megascale.messages import Message

Value = bytes | str | dict | list | int | float | Message


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


# -- values ------------------------------------------------------------------------------------


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def encode(value: Value) -> bytes:
    """bytes as they are, str as UTF-8, a typed message (``megascale.messages``) as its
    ``encode()``, anything else as compact JSON."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, Message):
        value = value.encode()
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def _prefix_end(prefix: str) -> str:
    """The range end that selects every key starting with ``prefix`` (etcd's ``--prefix``)."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return _b64(b"\0")  # every key
    raw[-1] += 1
    return _b64(bytes(raw))


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd returned it."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int

    def text(self) -> str:
        return self.value.decode()

    def json(self) -> Any:
        return json.loads(self.value)

    @classmethod
    def _from(cls, kv: dict) -> KeyValue:
        return cls(
            key=_unb64(kv.get("key")).decode(),
            value=_unb64(kv.get("value")),
            mod_revision=int(kv.get("mod_revision", 0)),
            create_revision=int(kv.get("create_revision", 0)),
            version=int(kv.get("version", 0)),
            lease=int(kv.get("lease", 0)),
        )


@dataclass(frozen=True)
class Snapshot:
    """The keys under a prefix and the store revision they were read at (watch from ``+ 1``)."""

    items: list[KeyValue]
    revision: int


@dataclass(frozen=True)
class WatchEvent:
    """A change to a watched key: ``put`` (value is the new value) or ``delete`` (value b"")."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes
    revision: int
    lease: int = 0

    def text(self) -> str:
        return self.value.decode()

    def json(self) -> Any:
        return json.loads(self.value)


# -- transactions ------------------------------------------------------------------------------


TXN_MAX_OPS = 64
"""Operations per transaction that writers batch into: well under etcd's default
``--max-txn-ops`` of 128, which refuses larger ones (``InvalidArgument``)."""


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction; build with the helpers below (``value_is``, ``missing``)."""

    key: str
    target: Literal["VALUE", "VERSION", "CREATE", "MOD", "LEASE"]
    result: Literal["EQUAL", "NOT_EQUAL", "LESS", "GREATER"]
    operand: bytes | int

    def _json(self) -> dict:
        field_name = {
            "VALUE": "value",
            "VERSION": "version",
            "CREATE": "create_revision",
            "MOD": "mod_revision",
            "LEASE": "lease",
        }[self.target]
        operand = _b64(self.operand) if self.target == "VALUE" else str(self.operand)
        return {
            "key": _b64(self.key),
            "target": self.target,
            "result": self.result,
            field_name: operand,
        }


def value_is(key: str, value: Value) -> Compare:
    """Holds when ``key`` exists with exactly this value."""
    return Compare(key, "VALUE", "EQUAL", encode(value))


def missing(key: str) -> Compare:
    """Holds when ``key`` does not exist."""
    return Compare(key, "CREATE", "EQUAL", 0)


def created_at(key: str, revision: int) -> Compare:
    """Holds while ``key`` is the incarnation created at ``revision`` (not deleted, re-created)."""
    return Compare(key, "CREATE", "EQUAL", revision)


@dataclass(frozen=True)
class Put:
    key: str
    value: Value
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    key: str
    prefix: bool = False


@dataclass(frozen=True)
class Get:
    key: str
    prefix: bool = False


@dataclass(frozen=True)
class TxnResult:
    """``succeeded``: whether every compare held; ``gets``: the KeyValues of each ``Get`` op that
    ran, in order; ``revision``: the store revision after the transaction."""

    succeeded: bool
    gets: list[list[KeyValue]]
    revision: int


def _op_json(op: Put | Delete | Get) -> dict:
    if isinstance(op, Put):
        return {
            "request_put": {
                "key": _b64(op.key),
                "value": _b64(encode(op.value)),
                "lease": str(op.lease),
            }
        }
    body = {"key": _b64(op.key)}
    if op.prefix:
        body["range_end"] = _prefix_end(op.key)
    return {"request_delete_range" if isinstance(op, Delete) else "request_range": body}


# -- leases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lease:
    """A granted lease: keys put under it are deleted when it expires or is revoked."""

    id: int
    ttl: int
    """Granted TTL in seconds."""


def _lease_id(lease: Lease | int | None) -> int:
    if lease is None:
        return 0
    return lease.id if isinstance(lease, Lease) else int(lease)
