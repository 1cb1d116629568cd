"""The etcd client's background threads: ``KeepAlive`` (refreshes a lease until stopped, and
says when it is gone) and ``Watch`` (follows a key or prefix across etcd restarts, re-watching
from the last revision delivered + 1). ``Store.keep_alive`` and ``Store.watch*`` create them;
``megascale.etcd.store`` re-exports both.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from queue import Empty, Queue
from typing import TYPE_CHECKING, Any

from megascale.etcd.store.config import LeaseNotFound, StoreError, _is_auth_error
from megascale.etcd.store.values import KeyValue, Lease, WatchEvent, _b64

if TYPE_CHECKING:
    from megascale.etcd.store import Store

logger = logging.getLogger("megascale.etcd.store")


# -- leases ------------------------------------------------------------------------------------


class KeepAlive:
    """Refreshes a lease every ``interval_s`` (default ttl/3) in a daemon thread until ``stop``.

    If etcd says the lease is gone, ``lost`` is set, ``on_lost(lease)`` is called (in the thread)
    and the thread ends. Failures to reach etcd are retried every ``interval_s`` (the lease may
    expire meanwhile; that is then reported as lost once etcd answers).
    """

    def __init__(
        self,
        store: Store,
        lease: Lease,
        interval_s: float | None = None,
        on_lost: Callable[[Lease], None] | None = None,
    ) -> None:
        self.store, self.lease = store, lease
        self.interval_s = interval_s if interval_s is not None else max(lease.ttl / 3.0, 0.05)
        self.on_lost = on_lost
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-keepalive-{lease.id:x}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.store.refresh(self.lease.id)
            except LeaseNotFound:
                logger.warning("lease %x is gone (expired or revoked)", self.lease.id)
                self.lost.set()
                if self.on_lost is not None and not self._stop.is_set():
                    self.on_lost(self.lease)
                return
            except StoreError as e:
                logger.warning("lease %x keepalive failed, retrying: %s", self.lease.id, e)

    def stop(self, revoke: bool = False) -> None:
        """Stop refreshing (idempotent); with ``revoke`` also delete the lease and its keys now.
        Without it the lease expires after its TTL, as if this process had died."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.store.config.request_timeout_s + 1)
        if revoke:
            self.store.revoke(self.lease.id)


# -- watches -----------------------------------------------------------------------------------


class Watch:
    """Events for a key or prefix, from a daemon thread that follows etcd across restarts.

    Iterate it (blocks until ``cancel``), call ``get(timeout)``, or pass ``callback`` to
    ``Store.watch*`` to be called in the watch thread instead. ``revision`` is the revision of
    the last event delivered. Use as a context manager to cancel on exit.
    """

    _END = object()

    def __init__(
        self,
        store: Store,
        key: str,
        range_end: str | None,
        start_revision: int | None,
        callback: Callable[[WatchEvent], None] | None,
    ) -> None:
        self._store, self._key, self._range_end = store, key, range_end
        self._next_revision = start_revision
        self._callback = callback
        self._queue: Queue[Any] = Queue()
        self._cancelled = threading.Event()
        self._created = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self.revision = (start_revision - 1) if start_revision else 0
        self.reconnects = 0
        """How many times the stream was re-established (etcd restarts, dropped connections)."""
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch-{key}", daemon=True)
        self._thread.start()

    def wait_created(self, timeout: float | None = None) -> bool:
        """Block until etcd confirmed the watch (events after this point are seen)."""
        return self._created.wait(timeout)

    def get(self, timeout: float | None = None) -> WatchEvent | None:
        """The next event, or None after ``timeout`` seconds or once cancelled."""
        try:
            item = self._queue.get(timeout=timeout)
        except Empty:
            return None
        if item is self._END:
            self._queue.put(item)
            return None
        return item

    def __iter__(self) -> Iterator[WatchEvent]:
        while (event := self.get()) is not None:
            yield event

    def cancel(self) -> None:
        """Stop the watch (idempotent); iteration ends."""
        self._cancelled.set()
        with self._lock:
            if self._conn is not None and self._conn.sock is not None:
                try:
                    self._conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._thread.join(timeout=2)
        self._queue.put(self._END)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def _run(self) -> None:
        backoff = 0.02
        while not self._cancelled.is_set():
            try:
                self._stream()
                backoff = 0.02
            except (OSError, http.client.HTTPException, ValueError, StoreError) as e:
                if self._cancelled.is_set():
                    break
                if isinstance(e, ConnectionError):
                    self._store._rotate()
                elif isinstance(e, StoreError) and _is_auth_error(e):
                    try:
                        self._store._authenticate()
                    except StoreError as auth_error:
                        logger.warning(
                            "watch on %s: re-authentication failed: %s", self._key, auth_error
                        )
                logger.debug("watch on %s dropped (%s); re-watching", self._key, e)
            if self._cancelled.is_set():
                break
            self.reconnects += 1
            time.sleep(backoff)
            backoff = min(backoff * 2, 0.5)

    def _stream(self) -> None:
        request: dict[str, Any] = {"key": _b64(self._key)}
        if self._range_end is not None:
            request["range_end"] = self._range_end
        if self._next_revision:
            request["start_revision"] = str(self._next_revision)
        conn = self._store._new_connection(stream=True)
        with self._lock:
            if self._cancelled.is_set():
                conn.close()
                return
            self._conn = conn
        try:
            conn.request(
                "POST", "/v3/watch", json.dumps({"create_request": request}), self._store._headers()
            )
            response = conn.getresponse()
            if response.status != 200:
                raise self._store._error(response.status, response.read())
            while not self._cancelled.is_set():
                line = response.readline()
                if not line:
                    return  # the server closed the stream: reconnect
                self._handle(json.loads(line))
        finally:
            with self._lock:
                self._conn = None
            conn.close()

    def _handle(self, message: dict) -> None:
        if "error" in message:
            raise self._store._error(0, json.dumps(message["error"]).encode())
        result = message.get("result", {})
        if int(result.get("compact_revision", 0)):
            compacted = int(result["compact_revision"])
            logger.error(
                "watch on %s: revisions before %d were compacted; events between %s and "
                "%d are lost",
                self._key,
                compacted,
                self._next_revision,
                compacted,
            )
            self._next_revision = compacted
            raise StoreError(f"watch start revision compacted at {compacted}")
        if result.get("canceled"):  # e.g. permission denied, or the token expired: re-watch
            raise StoreError(f"etcd cancelled the watch: {result.get('cancel_reason', '')}")
        if result.get("created"):
            if not self._next_revision:
                self._next_revision = int(result["header"]["revision"]) + 1
            self._created.set()
        for raw in result.get("events", ()):
            kv = KeyValue._from(raw.get("kv", {}))
            event = WatchEvent(
                kind="delete" if raw.get("type") == "DELETE" else "put",
                key=kv.key,
                value=kv.value,
                revision=kv.mod_revision,
                lease=kv.lease,
            )
            self._next_revision = event.revision + 1
            self.revision = event.revision
            if self._callback is not None:
                try:
                    self._callback(event)
                except Exception:
                    logger.exception("watch callback for %s failed on %s", self._key, event)
            else:
                self._queue.put(event)


# -- the store ---------------------------------------------------------------------------------
