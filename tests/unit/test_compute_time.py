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


class _DeviceClock:
    """A GPU's timeline for stand-in CUDA events (no GPU here): an event recorded now is stamped
    with the device's time, which the test moves as the device computes."""

    def __init__(self) -> None:
        self.ms = 0.0
        self.synchronized = 0

    def event_class(self):
        device = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.ms: float | None = None

            def record(self) -> None:
                self.ms = device.ms

            def query(self) -> bool:
                return self.ms is not None

            def synchronize(self) -> None:
                device.synchronized += 1

            def elapsed_time(self, end) -> float:
                return end.ms - self.ms

        return Event


def test_on_a_gpu_stretch_sleeps_for_the_compute_the_device_timed(monkeypatch):
    import torch

    device = _DeviceClock()
    monkeypatch.setattr(torch.cuda, "Event", device.event_class())
    slept = []

    def sleep(seconds):  # the host sleeps after the span's work, the device idles meanwhile
        slept.append(seconds)
        device.ms += seconds * 1e3

    monkeypatch.setattr(compute_time, "time", SimpleNamespace(sleep=sleep))
    config = SimpleNamespace(timers=None)
    meter = compute_time.ComputeMeter("cuda").install(config)
    meter.stretch(3.0)
    meter.begin(1)
    config.timers("forward-compute").start()
    device.ms += 40.0  # the device runs the forward's kernels for 40 ms
    config.timers("forward-compute").stop()
    meter.end()
    assert slept == [pytest.approx(0.08)]  # (3 - 1) x 40 ms
    assert device.synchronized == 1  # only to know how long to sleep: a stretched span
    assert meter.latest == (1, pytest.approx(0.12))  # the device's span holds the slowdown


def test_on_a_gpu_an_unstretched_span_never_waits_for_the_device(monkeypatch):
    import torch

    device = _DeviceClock()
    monkeypatch.setattr(torch.cuda, "Event", device.event_class())
    config = SimpleNamespace(timers=None)
    meter = compute_time.ComputeMeter("cuda").install(config)
    meter.begin(1)
    config.timers("backward-compute").start()
    device.ms += 25.0
    config.timers("backward-compute").stop()
    meter.end()
    assert device.synchronized == 0 and meter.latest == (1, pytest.approx(0.025))
