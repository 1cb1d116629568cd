"""Leader election on one etcd key: a standby controller takes over when the active one dies.

Protocol: each candidate holds a lease of ``ttl`` seconds, kept alive in a thread. To campaign it
creates the election key under its lease in a transaction that succeeds only if the key does not
exist; if it exists, the candidate watches it and tries again when it is deleted. The leader's key
disappears when it resigns (deleted at once) or dies (its lease expires ``ttl`` seconds, plus
etcd's 0-0.6 s expiry latency, after its last renewal), so a standby campaigning on the same key
takes over within about ``ttl + 1`` seconds.

Fencing: a leader that stalled past its TTL may still believe it leads. Writes that only the
leader may make are transactions guarded by ``guard()`` (the key's create revision is the one this
candidate created), which fail once another candidate holds the key::

    election = Election(store, keys.controller_leader, "controller-a", ttl=5)
    election.campaign()                      # blocks until leader
    store.txn([election.guard()], [Put(keys.state, snapshot)])
    election.resign()

``lost`` is set when the lease is found expired; the holder must stop acting as leader and may
campaign again.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megascale.etcd.store import (
    Compare,
    Delete,
    Get,
    KeepAlive,
    Lease,
    LeaseNotFound,
    Put,
    Store,
    Watch,
    WatchEvent,
    created_at,
    missing,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Leader:
    """Who holds the election key: the candidate id, its published info, and the key's create
    revision (which names this term of leadership)."""

    id: str
    info: dict[str, Any]
    revision: int
    lease: int


class Election:
    """One candidate in an election on ``key`` (see the module docstring).

    Args:
        store: the etcd store.
        key: the election key, e.g. ``JobKeys(job).controller_leader``.
        candidate_id: this candidate's unique name.
        ttl: lease TTL in seconds: how long a dead leader blocks a takeover.
        info: extra JSON published with the leader's id (host and pid are added).
    """

    def __init__(
        self,
        store: Store,
        key: str,
        candidate_id: str,
        *,
        ttl: int = 5,
        info: Mapping[str, Any] | None = None,
    ) -> None:
        self.store, self.key, self.candidate_id, self.ttl = store, key, candidate_id, ttl
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), **(info or {})}
        self.lost = threading.Event()
        """Set when this candidate's lease expired (leadership lost)."""
        self._lease: Lease | None = None
        self._keepalive: KeepAlive | None = None
        self._revision = 0
        self._closing = threading.Event()

    # -- campaigning ---------------------------------------------------------------------------

    def campaign(self, timeout_s: float | None = None) -> bool:
        """Block until this candidate leads (True), ``timeout_s`` passes or ``close()`` is called
        from another thread (False). Idempotent while leading."""
        if self.is_leader():
            return True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._closing.is_set():
            self._ensure_lease()
            assert self._lease is not None
            value = {"id": self.candidate_id, **self.info, "since": time.time()}
            try:
                result = self.store.txn(
                    [missing(self.key)], [Put(self.key, value, self._lease.id)], [Get(self.key)]
                )
            except LeaseNotFound:  # expired while we waited (e.g. etcd was down): a new one
                self.lost.set()
                continue
            if result.succeeded:
                self._revision = result.revision
                logger.info(
                    "%s leads %s (revision %d)", self.candidate_id, self.key, result.revision
                )
                return True
            holder = result.gets[0][0] if result.gets and result.gets[0] else None
            if holder is not None and holder.lease == self._lease.id:
                self._revision = holder.create_revision  # ours already (e.g. after a retry)
                return True
            if not self._wait_for_vacancy(result.revision + 1, deadline):
                return False
        return False

    def _ensure_lease(self) -> None:
        if self._lease is not None and not self.lost.is_set():
            return
        if self._keepalive is not None:
            self._keepalive.stop()
        self.lost.clear()
        self._lease = self.store.grant(self.ttl)
        self._keepalive = self.store.keep_alive(self._lease, on_lost=self._on_lost)

    def _on_lost(self, lease: Lease) -> None:
        if self._revision:
            logger.warning("%s lost the lead of %s (lease expired)", self.candidate_id, self.key)
        self._revision = 0
        self.lost.set()

    def _wait_for_vacancy(self, from_revision: int, deadline: float | None) -> bool:
        """Wait until the key is deleted at or after ``from_revision``; False on deadline/close."""
        vacated = threading.Event()

        def on_event(event: WatchEvent) -> None:
            if event.kind == "delete":
                vacated.set()

        watch = self.store.watch(self.key, start_revision=from_revision, callback=on_event)
        try:
            while not vacated.wait(0.05):
                if self._closing.is_set():
                    return False
                if deadline is not None and time.monotonic() >= deadline:
                    return False
            return True
        finally:
            watch.cancel()

    # -- leading -------------------------------------------------------------------------------

    def is_leader(self) -> bool:
        """Whether this candidate won and has not lost, resigned or abandoned (no I/O; confirm
        with ``check()`` or fence writes with ``guard()``)."""
        return self._revision > 0 and not self.lost.is_set()

    @property
    def term(self) -> int | None:
        """This candidate's term while it leads: the election key's create revision (newer
        terms are larger); None when it does not lead."""
        return self._revision or None

    def check(self) -> bool:
        """Ask etcd whether the key is still this candidate's (one read)."""
        current = self.leader()
        still = current is not None and current.revision == self._revision and self.is_leader()
        if self._revision and not still:
            self._revision = 0
        return still

    def guard(self) -> Compare:
        """A transaction condition that holds only while this candidate leads (see module doc).
        ValueError if it is not leading."""
        if not self._revision:
            raise ValueError(f"{self.candidate_id} does not lead {self.key}: nothing to guard")
        return created_at(self.key, self._revision)

    def leader(self) -> Leader | None:
        """The current leader, or None when the key is vacant."""
        kv = self.store.get(self.key)
        if kv is None:
            return None
        info = kv.json()
        return Leader(
            id=str(info.pop("id", "")), info=info, revision=kv.create_revision, lease=kv.lease
        )

    def observe(self, callback: Callable[[Leader | None], None]) -> Watch:
        """Call ``callback(leader or None)`` (in a watch thread) whenever the leader changes;
        cancel the returned watch to stop."""

        def on_event(event: WatchEvent) -> None:
            if event.kind == "delete":
                callback(None)
            else:
                info = event.json()
                callback(Leader(str(info.pop("id", "")), info, event.revision, event.lease))

        return self.store.watch(self.key, callback=on_event)

    # -- leaving -------------------------------------------------------------------------------

    def resign(self) -> None:
        """Give up the lead now: delete the key if it is still ours and revoke the lease."""
        if self._revision:
            self.store.txn([created_at(self.key, self._revision)], [Delete(self.key)])
            logger.info("%s resigned %s", self.candidate_id, self.key)
        self._revision = 0
        self._drop_lease(revoke=True)

    def abandon(self) -> None:
        """Stop renewing the lease without revoking it, as if this process died: the key stays
        until the TTL runs out (for fault injection and tests)."""
        self._revision = 0
        self._drop_lease(revoke=False)

    def close(self) -> None:
        """Interrupt a ``campaign`` in another thread, then resign."""
        self._closing.set()
        self.resign()

    def _drop_lease(self, revoke: bool) -> None:
        if self._keepalive is not None:
            self._keepalive.stop(revoke=revoke)
        self._keepalive, self._lease = None, None
