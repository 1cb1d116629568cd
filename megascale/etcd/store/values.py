"""What the etcd client takes and returns, apart from any connection: value encoding
(``encode`` and the base64 and prefix-range helpers), what reads return (``KeyValue``,
``Snapshot``, ``WatchEvent``), the parts of a transaction (``Compare`` and its helpers,
``Put``/``Delete``/``Get``, ``TxnResult``, ``TXN_MAX_OPS``) and ``Lease`` (``_lease_id`` takes one
or its id). Pure data, no I/O and no threads; ``megascale.etcd.store`` re-exports every
public name: import them from there.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, Literal

from megascale.messages import Message

Value = bytes | str | dict | list | int | float | Message


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
