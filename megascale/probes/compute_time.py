"""Per-step compute time of this rank, measured where the compute runs: the straggler signal.

megatron-core's schedules call ``config.timers("forward-compute").start()/.stop()`` around every
micro-batch's forward step and ``"backward-compute"`` around its backward; pipeline sends and
receives, and so the bubbles of the schedule, lie outside both. ``ComputeMeter`` stands in
``config.timers`` for those two names (every other name, and the same two, still reach the
timeline's timers when it is on: ``ComputeMeter.inner``) and sums, per training step, the time
between each start and stop:

* on a GPU, as the device sees it: a CUDA event recorded on the current stream at start and at
  stop, never waited for on the training thread. A step's events are read with ``query()`` (no
  sync) when the step ends; events not complete yet are read at a later step's end. On a GPU the
  TP collectives inside a layer run on the stream, so a rank waiting for a slow TP peer computes
  longer too: the analysis then names the machine (TP stays within one) rather than the GPU.
* on CPU, the same code path with the host clock (``time.monotonic_ns``), less the time the host
  was blocked in communication inside the span (the flight recorder's ``blocked_s``; zero in
  an asynchronous mode where collectives do not block the host).

Only spans between ``begin(step)`` and ``end()`` count (an evaluation's forward passes do not).
``latest`` is the newest step whose time is known, and its seconds. The cost on the hot path is two
clock reads (or two event records) and two counter reads per span.

``stretch`` (fault injection, ``slow-rank``/``slow-node``): each span's compute is made ``factor``
times as long by sleeping inside it, as a slow machine's would be: ``factor - 1`` times the span's
compute so far, timed on the span's own clock (``elapsed_to_now_s``). On a GPU that waits for its
work to finish (a synchronisation, in a stretched span only); the stream idles while the host
sleeps, and the span's end event is recorded after the sleep, so the device's time of the span
holds the slowdown as the host clock's does on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

COMPUTE_TIMERS = ("forward-compute", "backward-compute")
"""The megatron-core timer names whose spans are compute."""


class _HostEvents:
    """Compute spans on the host clock; always complete."""

    def now(self) -> int:
        return time.monotonic_ns()

    def ready(self, token: Any) -> bool:
        return True

    def elapsed_s(self, start: Any, end: Any) -> float:
        return (end - start) / 1e9

    def elapsed_to_now_s(self, start: Any) -> float:
        return (time.monotonic_ns() - start) / 1e9


class _CudaEvents:
    """Compute spans as CUDA events on the current stream; read without waiting."""

    def __init__(self) -> None:
        import torch

        self._event = torch.cuda.Event

    def now(self) -> Any:
        event = self._event(enable_timing=True)
        event.record()
        return event

    def ready(self, token: Any) -> bool:
        return token.query()

    def elapsed_s(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3

    def elapsed_to_now_s(self, start: Any) -> float:
        """Device seconds from ``start`` to the work issued so far: waits for that work."""
        now = self.now()
        now.synchronize()
        return self.elapsed_s(start, now)


class _Timer:
    """What megatron-core gets for a compute timer name: starts and stops the meter's span inside
    the timeline's (so the timeline's span also holds an injected slowdown)."""

    __slots__ = ("_meter", "_inner")

    def __init__(self, meter: ComputeMeter, inner: Any) -> None:
        self._meter, self._inner = meter, inner

    def start(self, barrier: bool = False) -> None:
        if self._inner is not None:
            self._inner.start(barrier=barrier)
        self._meter._start()

    def stop(self, barrier: bool = False) -> None:
        self._meter._stop()
        if self._inner is not None:
            self._inner.stop(barrier=barrier)


class _NullTimer:
    __slots__ = ()

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


_NULL_TIMER = _NullTimer()


class ComputeMeter:
    """This rank's compute time per step. Contract: ``install(config)`` once (after the timeline
    attached its timers, if any); per training step ``begin(step)`` before the schedule and
    ``end()`` after it; ``latest`` at any time. Never blocks on the device; call from the
    training thread only."""

    def __init__(self, device: str = "cpu", blocked_s: Callable[[], float] | None = None) -> None:
        self._events = _CudaEvents() if device == "cuda" else _HostEvents()
        self._blocked = blocked_s if blocked_s is not None and device != "cuda" else _zero
        self.inner: Any = None
        """The timers megatron-core would call without the meter (the timeline's), or None."""
        self._timers: dict[str, _Timer] = {}
        self._factor = 1.0
        self._step: int | None = None
        self._spans: list[tuple[Any, Any, float]] = []  # (start, end, seconds blocked inside)
        self._open: tuple[Any, float] | None = None
        self._pending: list[tuple[int, list[tuple[Any, Any, float]]]] = []
        self.latest: tuple[int, float] | None = None
        """(step, compute seconds) of the newest step whose spans are all read; None before."""

    def install(self, config) -> ComputeMeter:
        """Stand in ``config.timers`` (megatron-core's model config), keeping what was there."""
        self.inner, config.timers = config.timers, self
        return self

    def stretch(self, factor: float) -> None:
        """Make every compute span ``factor`` (>= 1) times as long (fault injection)."""
        self._factor = float(factor)

    def __call__(self, name: str, log_level: int | None = None) -> Any:
        """megatron-core's ``config.timers(name, log_level)``."""
        inner = self.inner(name, log_level) if self.inner is not None else None
        if name not in COMPUTE_TIMERS:
            return inner if inner is not None else _NULL_TIMER
        timer = self._timers.get(name)
        if timer is None or timer._inner is not inner:
            timer = self._timers[name] = _Timer(self, inner)
        return timer

    # -- per step ---------------------------------------------------------------------------------

    def begin(self, step: int) -> None:
        """Training step ``step`` starts: compute spans count towards it until ``end``."""
        self._step, self._spans, self._open = step, [], None

    def end(self) -> None:
        """The step's compute is issued: queue its spans and read every queued step whose events
        are complete (a query, no wait); ``latest`` moves to the newest one read."""
        if self._step is None:
            return
        if self._spans:
            self._pending.append((self._step, self._spans))
        self._step, self._spans, self._open = None, [], None
        while self._pending:
            step, spans = self._pending[0]
            if not self._events.ready(spans[-1][1]):
                return  # a later step's end reads it
            self._pending.pop(0)
            total = sum(self._events.elapsed_s(s, e) - blocked for s, e, blocked in spans)
            self.latest = (step, max(0.0, total))

    def _start(self) -> None:
        if self._step is not None:
            self._open = (self._events.now(), self._blocked())

    def _stop(self) -> None:
        if self._open is None:
            return
        start, blocked_before = self._open
        self._open = None
        if self._factor > 1.0:  # injected slowness: sleep (factor - 1) x this span's compute
            spent = self._events.elapsed_to_now_s(start)
            time.sleep((self._factor - 1.0) * max(0.0, spent - self._blocked() + blocked_before))
        self._spans.append((start, self._events.now(), self._blocked() - blocked_before))


def _zero() -> float:
    return 0.0
