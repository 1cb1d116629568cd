"""Effective training time: how much of the wall time went into training progress that was kept.

MegaScale's measure of what faults cost. The controller feeds ``EffectiveTime`` the job's highest
completed step from the heartbeats (``observe``) and tells it when a generation starts
(``new_generation``). Between two observations of one generation, the time is spread evenly over
the steps completed in it. A step done again after a restart (the job rolled back to a checkpoint)
counts once, with its latest time: the earlier work on it was lost. Start-up, recovery, and the
time before a generation's first reported step count as not productive.

Exported as ``megascale_productive_seconds`` and ``megascale_effective_training_time_ratio``
(``ControllerMetrics.set_effective_training_time``); the wall time is counted from when the
controller that exports it began leading.
"""

from __future__ import annotations

from array import array


class EffectiveTime:
    """Productive seconds (see the module docstring); times are any monotonic clock's."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.productive_s = 0.0
        self._seconds = array("d")  # step -> seconds its last completion took (0: not done)
        self._last: tuple[int, float] | None = None  # (step, time) last seen this generation

    def new_generation(self) -> None:
        """A generation starts: its first observation only sets the mark (start-up is lost)."""
        self._last = None

    def observe(self, step: int, now: float) -> None:
        """The job's highest completed step is ``step`` at ``now``."""
        if self._last is None:
            self._last = (step, now)
            return
        done, then = self._last
        if step <= done:
            return
        per_step = (now - then) / (step - done)
        if len(self._seconds) <= step:
            self._seconds.extend([0.0] * (step + 1 - len(self._seconds)))
        for s in range(done + 1, step + 1):
            self.productive_s += per_step - self._seconds[s]
            self._seconds[s] = per_step
        self._last = (step, now)

    def ratio(self, now: float) -> float:
        """Productive over wall time since ``start`` (0 before any time has passed)."""
        wall = now - self.start
        return self.productive_s / wall if wall > 0 else 0.0
