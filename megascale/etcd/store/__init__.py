"""The control plane's etcd client: a small synchronous facade over etcd v3's JSON gateway.

The parts: ``client`` (``Store``: puts, gets, leases, transactions, watches), ``config`` (how the
client reaches etcd, and how etcd refuses: ``StoreConfig`` and the errors), ``values`` (what the
client takes and returns: encoding, ``KeyValue``, the transaction ops) and ``watch`` (its
background threads: ``KeepAlive``, ``Watch``).
"""

from megascale.etcd.store.client import Store
from megascale.etcd.store.config import LeaseNotFound, StoreConfig, StoreError, StoreUnavailable
from megascale.etcd.store.values import (
    TXN_MAX_OPS,
    Compare,
    Delete,
    Get,
    KeyValue,
    Lease,
    Put,
    Snapshot,
    WatchEvent,
    created_at,
    encode,
    missing,
    value_is,
)
from megascale.etcd.store.watch import KeepAlive, Watch

__all__ = [
    "TXN_MAX_OPS",
    "Compare",
    "Delete",
    "Get",
    "KeepAlive",
    "KeyValue",
    "Lease",
    "LeaseNotFound",
    "Put",
    "Snapshot",
    "Store",
    "StoreConfig",
    "StoreError",
    "StoreUnavailable",
    "Watch",
    "WatchEvent",
    "created_at",
    "encode",
    "missing",
    "value_is",
]
