"""The controller's decision log: one JSON object per decision, append-only, in
``RUN_DIR/events.jsonl`` and mirrored to etcd under ``/megascale/<job>/events/<seq>``.

An event (``messages.Event``)::

    {"schema": "1.0", "seq": 7, "time": 1764000000.1, "generation": 2, "kind": "fault",
     "node": "node-1", "rank": 5, "detail": {...}}

``kind`` is one of the names the controller uses (``EVENT_KINDS`` in ``controller/fsm.py``: ``fault``,
``evict``, ``generation_started``, ...); ``node``/``rank`` are null when the decision is about the
job as a whole. Reports and tests read the file with ``read_events`` (typed events).

Unbuffered (the default), ``append`` writes the event to etcd and the file before it returns.
Buffered (``buffered=True``, the controller's), ``append`` only queues it and ``flush`` writes every
queued event: to etcd in transactions of up to ``TXN_MAX_OPS`` creates, then to the file. A
decision that records many events (a self-check round records one per node) then costs a few round
trips, not one per event on the decision thread.

Contract: the etcd mirror is best effort: when etcd is unreachable (after the store's retries) the
failure is logged and the event is still written to the file, which is the complete record.

Fencing (the controller's log): with ``fence`` (a function returning the transaction conditions
that hold only while this writer leads, ``Election.guard``) every etcd write of events is
conditioned on it, and the file is written only after such a write succeeded: a controller that
lost its lease (stopped, partitioned) writes nothing, and its queued events are dropped. Events
carry the writer's ``term`` (the leader key's create revision); ``read_events`` drops an event
whose term is older than one already read (a deposed leader's late line, e.g. written while
etcd was unreachable and the fence could not be checked).
Sequence numbers continue from the highest one already in etcd (or in the file), so a standby
controller that takes over appends after its predecessor; each etcd key is created only if absent,
so two writers cannot overwrite one another's events.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from megascale import runfiles
from megascale.etcd.keys import JobKeys
from megascale.etcd.store import TXN_MAX_OPS, Compare, Put, Store, StoreError, missing
from megascale.messages import SCHEMA_KEY, Event

logger = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"


class Fenced(Exception):
    """The writer's fence no longer holds: it does not lead any more."""


class EventLog:
    """Append-only event log (see the module docstring).

    Args:
        run_dir: the run directory; events go to ``run_dir/events.jsonl``. None: etcd only.
        store / keys: where to mirror; None: file only.
        clock: wall clock for the ``time`` field (injectable for tests).
        buffered: queue events until ``flush`` (see the module docstring).
        fence: the conditions under which this writer may write (see the module docstring;
            buffered logs only); it raises ValueError when the writer knows it does not lead.
    """

    def __init__(
        self,
        run_dir: str | Path | None,
        store: Store | None = None,
        keys: JobKeys | None = None,
        *,
        clock: Callable[[], float] = time.time,
        buffered: bool = False,
        fence: Callable[[], Sequence[Compare]] | None = None,
    ) -> None:
        if (store is None) != (keys is None):
            raise ValueError("EventLog: give both store and keys to mirror to etcd, or neither")
        if fence is not None and not buffered:
            raise ValueError("EventLog: a fence applies to a buffered log's flush")
        self.path = Path(run_dir) / EVENTS_FILE if run_dir is not None else None
        self.store, self.keys, self.clock = store, keys, clock
        self.buffered, self.fence = buffered, fence
        self.term: int | None = None
        """Stamped on every event from now on (the leader key's create revision)."""
        self._lock = threading.Lock()
        self._pending: list[Event] = []
        self._next_seq = self._first_seq()
        if self.path is not None:
            runfiles.make_dir(self.path.parent)

    def _first_seq(self) -> int:
        last = -1
        if self.path is not None and self.path.exists():
            for event in read_events(self.path):
                last = max(last, event.seq)
        if self.store is not None and self.keys is not None:
            try:
                newest = self.store.get_prefix(self.keys.events_prefix, limit=1, descending=True)
                if newest:
                    last = max(last, self.keys.seq_of(newest[0].key))
            except StoreError as e:
                logger.warning("event log: cannot read the last event seq from etcd: %s", e)
        return last + 1

    def append(
        self,
        kind: str,
        *,
        generation: int,
        node: str | None = None,
        rank: int | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> Event:
        """Record one decision; returns the event as written (with its ``seq`` and ``time``)."""
        with self._lock:
            event = Event(
                seq=self._next_seq,
                time=self.clock(),
                generation=generation,
                kind=kind,
                node=node,
                rank=rank,
                detail=dict(detail or {}),
                term=self.term,
            )
            self._next_seq += 1
            if self.buffered:
                self._pending.append(event)
            else:
                self._mirror(event)  # first: it may move the event to a later free seq
                self._write([event])
        logger.info(
            "event %s gen=%s node=%s rank=%s %s", kind, generation, node, rank, event.detail
        )
        return event

    def record(self, action: Any) -> Event:
        """Append a controller ``RecordEvent`` action (anything with ``kind``, ``generation``,
        ``node``, ``rank``, ``detail``)."""
        return self.append(
            action.kind,
            generation=action.generation,
            node=action.node,
            rank=action.rank,
            detail=action.detail,
        )

    def flush(self, mirror: bool = True) -> None:
        """Write the queued events (buffered mode): to etcd, renumbered after the newest event
        there if another writer took their seqs meanwhile (unless ``mirror`` is False: etcd is
        known to be down), then to the file."""
        with self._lock:
            events, self._pending = self._pending, []
            if not events:
                return
            try:
                fence = list(self.fence()) if self.fence is not None else []
                if not mirror:
                    raise StoreError("etcd is unavailable")
                for start in range(0, len(events), TXN_MAX_OPS):
                    self._mirror_batch(events[start : start + TXN_MAX_OPS], fence)
            except (Fenced, ValueError) as e:
                logger.warning("event log: not the leader (%s): %d events dropped", e, len(events))
                return
            except StoreError as e:
                logger.warning("event log: etcd mirror failed for %d events: %s", len(events), e)
            self._write(events)

    def discard(self) -> list[str]:
        """Drop the queued events (their writer lost the lead); their kinds."""
        with self._lock:
            dropped, self._pending = self._pending, []
        return [e.kind for e in dropped]

    def resync(self) -> None:
        """Continue numbering after the newest event in etcd (a standby that just took over:
        its predecessor appended after this log was opened)."""
        with self._lock:
            self._next_seq = max(self._next_seq, self._first_seq())
            for event in self._pending:  # queued before: keep their order, after the newest
                event.seq, self._next_seq = self._next_seq, self._next_seq + 1

    def _mirror_batch(self, events: list[Event], fence: list[Compare]) -> None:
        if self.store is None or self.keys is None:
            return
        for _ in range(100):
            keys = [self.keys.event(e.seq) for e in events]
            done = self.store.txn(
                [*fence, *(missing(k) for k in keys)],
                [Put(k, e) for k, e in zip(keys, events, strict=True)],
            )
            if done.succeeded:
                return
            if fence and not self.store.txn(fence, []).succeeded:
                raise Fenced("the fence of the event log failed: another controller leads")
            newest = self.store.get_prefix(self.keys.events_prefix, limit=1, descending=True)
            self._next_seq = max(self._next_seq, self.keys.seq_of(newest[0].key) + 1)
            for event in events:
                event.seq, self._next_seq = self._next_seq, self._next_seq + 1
        logger.warning("event log: no free seqs for %d events", len(events))

    def _write(self, events: list[Event]) -> None:
        if self.path is not None:
            with runfiles.open_append(self.path) as f:
                f.writelines(
                    json.dumps(e.encode(), sort_keys=True, default=str) + "\n" for e in events
                )

    def _mirror(self, event: Event) -> None:
        if self.store is None or self.keys is None:
            return
        try:
            # Another writer (a controller we took over from) may hold this seq: skip ahead.
            for _ in range(100):
                if self.store.create(self.keys.event(event.seq), event):
                    return
                event.seq = self._next_seq
                self._next_seq += 1
            logger.warning("event log: no free seq for %s", event)
        except StoreError as e:
            logger.warning("event log: etcd mirror failed for event %d: %s", event.seq, e)


def read_events(path: str | Path) -> list[Event]:
    """Every event in an ``events.jsonl`` (a path to the file or to its run directory); a torn
    last line (the writer crashed mid-write) is skipped; a line without a schema (written
    before messages were versioned, the same fields) reads as 1.0; ``MessageError`` for a line
    of another major."""
    path = Path(path)
    if path.is_dir():
        path = path / EVENTS_FILE
    events, term = [], -1
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            logger.warning("skipping a torn line in %s", path)
            continue
        if isinstance(event, dict) and SCHEMA_KEY not in event:
            event = {SCHEMA_KEY: "1.0", **event}
        record = Event.decode(event)
        if record.term is not None:
            if record.term < term:
                logger.warning("skipping an event of a deposed controller: %s", line[:200])
                continue
            term = record.term
        events.append(record)
    return events
