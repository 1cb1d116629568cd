"""The flight recorder's watcher: follows the ops in flight and writes their device state (started,
completed, failed; with the device's times) into the recorder's file, so that the agent reads the
last state of a rank whose host is stuck or stopped.

An op is followed through a *tracker*, in the cheapest way it allows:

* **notified** (no thread, exact times): the NCCL-like mode's ``CommOp`` calls back when its
  communication thread starts it and when it completes (``CommOp.observe``); a CPU collective's
  torch ``Work`` (gloo) completes a future whose callback runs when the op completes
  (``Work.get_future().add_done_callback``). The write happens on the thread that ran the op.
  Not on CUDA: a NCCL ``Work``'s future may complete once the kernel is enqueued, not run.
* **polled** (everything else: on CUDA an op's ``DeviceSpan``, timing events recorded on the stream
  before and after it, or before it and its NCCL ``Work``; gloo's p2p ``Work``, which has no
  future): one thread per process calls
  ``is_completed()`` with an adaptive interval (``Backoff``): ``MIN_INTERVAL_S`` after a change, or
  a new op, doubling on every poll that sees no change up to ``MAX_INTERVAL_S``. A polled op's
  completion time is when the poll saw it: late by at most the interval then in force, so a
  timeline segment of a polled op is too long by up to ``MAX_INTERVAL_S`` (20 ms) after an op
  stayed in flight for ~30 ms with nothing changing, and by up to ``MIN_INTERVAL_S`` (1 ms) while
  ops keep being issued or completing. Notified ops carry the exact times.

Either source gives the same triple, and one function (``device_interval``) turns it into the
op's device start and completion: when its start was observed (the NCCL-like mode's thread starting
it; the first poll that finds a ``DeviceSpan``'s start event complete), when its completion was
observed, and its duration where the device measured it (``start.elapsed_time(done)`` of a
``DeviceSpan``; ``CommOp.duration``). With a duration the segment's length is exact however
coarsely the watcher polled, and it is placed at the earliest start the observations allow.

Either way an op that never completes keeps its last state (queued or started): that is what a
stall looks like from outside. Device states only move forward (the recorder's ``device``
ignores a write that would move one back), so a late notification cannot undo a completion.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from megascale.probes.flight.format import DeviceState

MIN_INTERVAL_S = 0.001  # polling interval after a change or a new op
MAX_INTERVAL_S = 0.02  # polling interval once nothing has changed for a while (worst-case lag)

Write = Callable[..., None]
"""``write(index, state, start=0.0, done=0.0)``: the recorder's ``device``."""


def device_interval(started: float, done: float, duration: float | None) -> tuple[float, float]:
    """An op's (device start, device completion), monotonic seconds, from when its start was
    observed (0.0: never seen started), when its completion was observed, and the duration the
    device measured (None: not measured; the observations are the times). Pure.

    With a duration the interval has that length: it starts at the observed start, or at
    ``done - duration`` where the start was seen too late for it (in the same poll as the
    completion) or not at all; a completion observed within a microsecond of the end the duration
    gives is kept as observed (the notified case, where both observations are exact)."""
    if duration is None:
        return started, done
    duration = max(0.0, duration)
    start = started if started and done - started >= duration else done - duration
    end = start + duration
    return start, (done if abs(end - done) < 1e-6 else end)


class EventPool:
    """Reusable CUDA events (``make()`` creates one, with timing enabled): the hot path takes one
    per op boundary, the watcher gives them back once the op finished, so an op allocates none in
    the steady state. Thread-safe (a list's append and pop are atomic)."""

    def __init__(self, make: Callable[[], object]) -> None:
        self._make, self._free = make, []

    def get(self):
        try:
            return self._free.pop()
        except IndexError:
            return self._make()

    def put(self, *events) -> None:
        self._free.extend(e for e in events if e is not None)


class DeviceSpan:
    """An op on a CUDA stream as a polled tracker: a timing event recorded on the stream before it
    (``start``; None if none was), and what completes after it: an event recorded after it on the
    same stream, or its NCCL ``Work``. ``started``: the monotonic time a poll first saw the start
    event complete (0.0 before); ``duration``: seconds from start to done as the device timed
    them, once complete (when ``done`` is a NCCL ``Work``: its kernel's time on NCCL's stream,
    ``work_duration``; None where that is not timed). ``release`` gives the events back."""

    __slots__ = ("start", "done", "pool", "_started")

    def __init__(self, start, done, pool: EventPool | None = None) -> None:
        self.start, self.done, self.pool, self._started = start, done, pool, 0.0

    @property
    def started(self) -> float:
        if not self._started and self.start is not None and self.start.query():
            self._started = time.monotonic()
        return self._started

    def is_completed(self) -> bool:
        done = self.done
        return done.query() if hasattr(done, "query") else done.is_completed()

    @property
    def duration(self) -> float | None:
        if not hasattr(self.done, "query"):
            return work_duration(self.done)
        if self.start is None:
            return None
        return self.start.elapsed_time(self.done) / 1e3  # ms -> s

    def release(self) -> None:
        if self.pool is not None:
            self.pool.put(self.start, self.done if hasattr(self.done, "query") else None)
            self.start = self.done = self.pool = None


def work_duration(work) -> float | None:
    """A completed NCCL ``Work``'s kernel time (s), timed by the events NCCL's process group
    records around the kernel on its own stream when collective timing is on
    (``TORCH_NCCL_ENABLE_TIMING``, which ``parallel.groups.init_distributed`` turns on); None
    where it is off, or the ``Work`` is not NCCL's (torch raises then)."""
    get = getattr(work, "_get_duration", None)
    if get is None:
        return None
    try:
        return get() / 1e3  # ms -> s
    except RuntimeError:
        return None


def _finished(tracker, started: float, done: float) -> tuple[float, float]:
    """``device_interval`` for a tracker that has completed (a ``CommOp``, a ``DeviceSpan``)."""
    return device_interval(started, done, getattr(tracker, "duration", None))


class Backoff:
    """The polling interval's policy (pure: no clock, no thread).

    ``polled(changed)`` after each poll returns the next interval: ``low`` if the poll saw a state
    change, else twice the last one, at most ``high``. ``added()`` when a new op is followed resets
    the interval to ``low`` and returns whether the thread was in a backed-off wait and should be
    woken now (so that a new op is never seen later than ``low`` after the thread's next poll)."""

    def __init__(self, low: float = MIN_INTERVAL_S, high: float = MAX_INTERVAL_S) -> None:
        self.low, self.high, self.interval = low, high, low

    def polled(self, changed: bool) -> float:
        self.interval = self.low if changed else min(self.high, self.interval * 2)
        return self.interval

    def added(self) -> bool:
        wake = self.interval > self.low
        self.interval = self.low
        return wake


class Poller:
    """The polled trackers of one process and one pass over them (``poll``); no thread.

    Ops are kept in *lanes*: the ops added with the same ``key`` complete in the order they were
    added (a NCCL communicator's stream, a CUDA stream, the NCCL-like mode's group thread), so a
    pass queries a lane's oldest op only, and the ones behind it once it finished. An op added
    with ``key=None`` is a lane of its own (gloo's p2p ops: no order between them)."""

    def __init__(self, write: Write) -> None:
        self._write = write
        self.lock = threading.RLock()  # guards ``lanes`` and ``backoff``
        self.lanes: dict[object, list[list]] = {}  # key -> [[index, tracker, queued, shown]]
        self.backoff = Backoff()

    def add(self, index: int, tracker, queued: bool, key: object = None) -> bool:
        """Follow ``tracker``; returns whether a backed-off waiter should be woken."""
        with self.lock:
            self.lanes.setdefault(object() if key is None else key, []).append(
                [index, tracker, queued, False]
            )
            return self.backoff.added()

    def in_flight(self) -> list[int]:
        """The record indices followed now, lane by lane."""
        with self.lock:
            return [e[0] for lane in self.lanes.values() for e in lane]

    def poll(self) -> bool:
        """Query each lane's oldest op (and the next ones while they finished), write what
        changed, drop the finished ones; returns whether any state changed."""
        changed = False
        with self.lock:
            lanes = [(key, list(lane)) for key, lane in self.lanes.items()]
        for key, lane in lanes:
            finished = 0
            for entry in lane:
                outcome = self._query(entry)
                changed = changed or outcome != ""
                if outcome != "finished":
                    break  # the ops behind it in its lane have not completed either
                finished += 1
            if finished:
                with self.lock:
                    del self.lanes[key][:finished]
                    if not self.lanes[key]:
                        del self.lanes[key]
        return changed

    def _query(self, entry: list) -> str:
        """Write ``entry``'s op's state if it changed: "finished" (completed or failed),
        "started" (its start written now), or "" (nothing new)."""
        index, tracker, queued, shown = entry
        started = getattr(tracker, "started", 0.0) if queued else 0.0
        try:
            done = tracker.is_completed()
        except RuntimeError:  # the op failed
            self._write(index, DeviceState.FAILED, done=time.monotonic())
            _release(tracker)
            return "finished"
        if done:
            when = getattr(tracker, "completed", 0.0) or time.monotonic()
            self._write(index, DeviceState.COMPLETED, *_finished(tracker, started, when))
            _release(tracker)
            return "finished"
        if started and not shown:
            self._write(index, DeviceState.STARTED, started)
            entry[3] = True
            return "started"
        return ""


def _release(tracker) -> None:
    release = getattr(tracker, "release", None)
    if release is not None:
        release()


class CompletionWatcher:
    """Follows tracked ops until they complete or fail, writing their state with ``write``.

    ``notify``: use completion callbacks where the tracker offers them (set it False on CUDA, where
    a ``Work``'s future does not tell the device's completion). ``device``: the CUDA device
    whose work is followed (this rank's GPU), made current on the polling thread before its
    first query; None where no CUDA work is followed. A new thread starts on GPU 0, and querying an
    event or a NCCL ``Work`` from there would create a CUDA context on GPU 0 for every rank of the
    node (~500 MiB each on an H100). ``thread``: the polling thread, once a polled op was added
    (None before); ``stop`` ends it (ops still followed then are left in their last state)."""

    def __init__(self, write: Write, notify: bool = True, device: int | None = None) -> None:
        self._write, self.notify, self.device = write, notify, device
        self._poller = Poller(write)
        self._cv = threading.Condition(self._poller.lock)
        self.thread: threading.Thread | None = None
        self._stopped = False

    def stop(self) -> None:
        """End the polling thread at its next wake-up (the recorder is closed); idempotent."""
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def add(self, index: int, tracker, queued: bool, key: object = None) -> None:
        """Follow record ``index``'s op; ``queued``: its tracker tells when it started; ``key``:
        the ops added with one key complete in order (see ``Poller``), None: no order known."""
        if self.notify and self._subscribe(index, tracker):
            return
        with self._cv:
            idle = not self._poller.lanes
            if self._poller.add(index, tracker, queued, key) or idle:
                self._cv.notify()
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="flight-watcher", daemon=True)
                self.thread.start()

    def _subscribe(self, index: int, tracker) -> bool:
        """Ask ``tracker`` to call back on its state changes; False if it cannot."""
        observe = getattr(tracker, "observe", None)
        if observe is not None:  # the NCCL-like mode's CommOp
            observe(lambda op: self._observed(index, op))
            return True
        get_future = getattr(tracker, "get_future", None)
        if get_future is None:
            return False
        try:
            future = get_future()
        except RuntimeError:  # gloo's send / recv: "Work::getFuture not implemented"
            return False
        future.add_done_callback(lambda f: self._future_done(index, f))
        return True

    def _observed(self, index: int, op) -> None:
        if op.completed:
            state = DeviceState.COMPLETED if op.error is None else DeviceState.FAILED
            self._write(index, state, *_finished(op, op.started, op.completed))
        elif op.started:
            self._write(index, DeviceState.STARTED, op.started)

    def _future_done(self, index: int, future) -> None:
        now = time.monotonic()
        try:
            future.value()  # raises the op's error
            state = DeviceState.COMPLETED
        except Exception:  # noqa: BLE001 - the op failed; the host sees the error in wait()
            state = DeviceState.FAILED
        self._write(index, state, done=now)

    def _run(self) -> None:
        if self.device is not None:  # before any CUDA call of this thread (see the class)
            import torch

            torch.cuda.set_device(self.device)
        poller = self._poller
        while True:
            with self._cv:
                while not poller.lanes and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
            changed = poller.poll()
            with self._cv:
                self._cv.wait(poller.backoff.polled(changed))  # add() may cut a long wait short
