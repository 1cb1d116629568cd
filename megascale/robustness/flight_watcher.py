"""The flight recorder's watcher: one thread per process that follows the ops in flight and
writes their device state (started, completed, failed; with the device's times) into the
recorder's file, so that the agent reads the last state of a rank whose host is stuck or stopped.

An op is followed through a *tracker*: anything with ``is_completed()`` (a torch ``Work``, the
NCCL-like mode's ``CommOp``, which also tells ``started`` and ``completed``, or ``EventDone``
around a CUDA event recorded after a synchronous NCCL call). The thread starts with the first
tracked op and polls every ``WATCH_INTERVAL_S`` while any is in flight; it sleeps otherwise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from megascale.robustness.flight_format import DeviceState

WATCH_INTERVAL_S = 0.002  # how often the watcher thread polls the ops in flight

Write = Callable[..., None]
"""``write(index, state, start=0.0, done=0.0)``: the recorder's ``device``."""


class EventDone:
    """A CUDA event recorded after a synchronous op, as a completion handle."""

    def __init__(self, event) -> None:
        self.event = event

    def is_completed(self) -> bool:
        return self.event.query()


class CompletionWatcher:
    """Follows tracked ops until they complete or fail, writing their state with ``write``."""

    def __init__(self, write: Write) -> None:
        self._write = write
        self._watched: list[tuple[int, object, bool]] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, index: int, tracker, queued: bool) -> None:
        """Follow record ``index``'s op; ``queued``: its tracker tells when it started."""
        with self._cv:
            self._watched.append((index, tracker, queued))
            self._cv.notify()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="flight-watcher", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._watched:
                    self._cv.wait()
                watched = list(self._watched)
            finished = set()
            for index, tracker, queued in watched:
                started = getattr(tracker, "started", 0.0) if queued else 0.0
                try:
                    done = tracker.is_completed()
                except RuntimeError:  # the op failed
                    self._write(index, DeviceState.FAILED, done=time.monotonic())
                    finished.add(index)
                    continue
                if done:
                    when = getattr(tracker, "completed", 0.0) or time.monotonic()
                    self._write(index, DeviceState.COMPLETED, started, when)
                    finished.add(index)
                elif started:
                    self._write(index, DeviceState.STARTED, started)
            with self._cv:
                self._watched = [w for w in self._watched if w[0] not in finished]
            time.sleep(WATCH_INTERVAL_S)
