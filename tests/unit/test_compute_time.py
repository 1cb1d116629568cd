"""``megascale.probes.compute_time.ComputeMeter`` on the host clock (the CPU path), driven as
megatron-core's schedule drives ``config.timers``; a fake clock gives hand-written expectations."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megascale.probes import compute_time


@pytest.fixture
def clock(monkeypatch):
    now = SimpleNamespace(ns=0)
    monkeypatch.setattr(compute_time.time, "monotonic_ns", lambda: now.ns)
    return now


class _Inner:
    """The timeline's timers: records what megatron-core asked for."""

    def __init__(self):
        self.calls = []

    def __call__(self, name, log_level=None):
        inner = self

        class Timer:
            def start(self, barrier=False):
                inner.calls.append(("start", name))

            def stop(self, barrier=False):
                inner.calls.append(("stop", name))

        return Timer()


def _span(config, clock, name, seconds, blocked=None, during=0.0):
    config.timers(name, log_level=2).start()
    if blocked is not None:
        blocked.s += during
    clock.ns += int(seconds * 1e9)
    config.timers(name).stop()


def test_forward_and_backward_compute_less_blocked_time_per_step(clock):
    blocked = SimpleNamespace(s=0.0)
    inner = _Inner()
    config = SimpleNamespace(timers=inner)
    meter = compute_time.ComputeMeter("cpu", blocked_s=lambda: blocked.s).install(config)
    assert config.timers is meter and meter.inner is inner
    meter.begin(1)
    _span(config, clock, "forward-compute", 0.3, blocked, during=0.1)  # 0.1 s in a TP all-reduce
    clock.ns += 5 * 10**8  # a pipeline receive (bubble): not compute
    config.timers("forward-recv").start()  # other names reach the timeline only
    config.timers("forward-recv").stop()
    _span(config, clock, "backward-compute", 0.4)
    assert meter.latest is None  # known at the step's end
    meter.end()
    assert meter.latest == (1, pytest.approx(0.6))  # 0.3 - 0.1 + 0.4
    assert [c for c in inner.calls if c[1] == "forward-recv"] == [
        ("start", "forward-recv"),
        ("stop", "forward-recv"),
    ]
    assert ("start", "backward-compute") in inner.calls
    _span(config, clock, "forward-compute", 9.0)  # an evaluation after the step: not counted
    meter.begin(2)
    _span(config, clock, "forward-compute", 0.2)
    meter.end()
    assert meter.latest == (2, pytest.approx(0.2))


def test_without_timeline_other_timers_are_no_ops_and_detach_keeps_the_meter(clock):
    from megascale.probes.timers import _set_timers

    config = SimpleNamespace(timers=None)
    meter = compute_time.ComputeMeter().install(config)
    config.timers("forward-backward", log_level=1).start(barrier=False)  # a null timer
    _set_timers(config, _Inner())  # the timeline attaches behind the meter
    assert config.timers is meter and isinstance(meter.inner, _Inner)
    _set_timers(config, None)
    assert config.timers is meter and meter.inner is None
    meter.begin(1)
    _span(config, clock, "backward-compute", 0.5)
    meter.end()
    assert meter.latest == (1, pytest.approx(0.5))


def test_stretch_makes_compute_factor_times_as_long(clock, monkeypatch):
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        clock.ns += int(seconds * 1e9)

    monkeypatch.setattr(compute_time.time, "sleep", sleep)
    config = SimpleNamespace(timers=None)
    meter = compute_time.ComputeMeter().install(config)
    meter.stretch(3.0)
    meter.begin(1)
    _span(config, clock, "forward-compute", 0.1)
    meter.end()
    assert slept == [pytest.approx(0.2)] and meter.latest == (1, pytest.approx(0.3))
