"""The flight recorder's watcher: what it writes and when it polls, decided without a clock.

The polled path is driven one pass at a time (``Poller.poll``) with trackers the test completes by
hand; the notified path with the NCCL-like mode's real ``CommOp`` and the recorder's real ``device``
writes into a real file, read back with the agent's reader."""

from __future__ import annotations

import threading

import pytest
import torch

from megascale.parallel.async_comm import CommOp
from megascale.probes.flight.format import DeviceState, OpKind, flight_path, read_records
from megascale.probes.flight.recorder import FlightRecorder
from megascale.probes.flight.watcher import (
    MAX_INTERVAL_S,
    MIN_INTERVAL_S,
    Backoff,
    CompletionWatcher,
    DeviceSpan,
    EventPool,
    Poller,
    device_interval,
)

Q, S, C, F = DeviceState.QUEUED, DeviceState.STARTED, DeviceState.COMPLETED, DeviceState.FAILED


class Tracker:
    """A handle completed by the test; ``started`` like the NCCL-like mode's op."""

    def __init__(self) -> None:
        self.started = self.completed = 0.0
        self.error = False

    def is_completed(self) -> bool:
        if self.error:
            raise RuntimeError("op failed")
        return bool(self.completed)


def poller():
    writes: list[tuple] = []
    return Poller(lambda index, state, start=0.0, done=0.0: writes.append((index, state))), writes


def test_completed_op_is_written_once_and_a_hung_op_keeps_its_state():
    p, writes = poller()
    done, hung, never_started = Tracker(), Tracker(), Tracker()
    for index, tracker in enumerate((done, hung, never_started)):
        p.add(index, tracker, queued=True)
    assert p.poll() is False and writes == []  # nothing moved: nothing written
    done.started = hung.started = 1.0
    assert p.poll() is True
    assert writes == [(0, S), (1, S)]
    done.completed = 2.0
    assert p.poll() is True
    assert writes[2:] == [(0, C)]
    for _ in range(5):  # the hung op is never rewritten, the queued one never leaves QUEUED
        assert p.poll() is False
    assert writes[3:] == [] and p.in_flight() == [1, 2]


def test_failed_op_is_written_failed_and_dropped():
    p, writes = poller()
    t = Tracker()
    p.add(7, t, queued=False)
    t.error = True
    assert p.poll() is True and writes == [(7, F)] and p.in_flight() == []


def test_a_lane_is_queried_from_its_oldest_op_only():
    """Ops of one key complete in order: those behind an op in flight are not queried."""
    p, writes = poller()
    first, second, alone = Tracker(), Tracker(), Tracker()
    p.add(0, first, queued=False, key="tp")
    p.add(1, second, queued=False, key="tp")
    p.add(2, alone, queued=False)
    second.completed = alone.completed = 1.0
    assert p.poll() is True
    assert writes == [(2, C)] and p.in_flight() == [0, 1]  # 1 waits behind 0
    first.completed = 2.0
    assert p.poll() is True
    assert writes[1:] == [(0, C), (1, C)] and p.in_flight() == []


def test_backoff_doubles_while_nothing_changes_and_resets_on_a_change_or_a_new_op():
    b = Backoff(0.001, 0.02)
    assert [b.polled(False) for _ in range(6)] == [0.002, 0.004, 0.008, 0.016, 0.02, 0.02]
    assert b.polled(True) == 0.001
    b.polled(False)
    assert b.added() is True and b.interval == 0.001  # in a backed-off wait: wake the thread
    assert b.added() is False  # already polling at the shortest interval
    assert MIN_INTERVAL_S < MAX_INTERVAL_S


def test_poller_backoff_follows_its_polls_and_adds():
    p, _ = poller()
    t = Tracker()
    p.add(0, t, queued=True)
    for _ in range(8):
        p.backoff.polled(p.poll())
    assert p.backoff.interval == MAX_INTERVAL_S  # an op stuck in flight: polled rarely
    assert p.add(1, Tracker(), queued=True) is True
    assert p.backoff.interval == MIN_INTERVAL_S
    t.started = 1.0
    assert p.backoff.polled(p.poll()) == MIN_INTERVAL_S


def _recorder(tmp_path):
    """A recorder with one group (no process group needed: records are entered by hand)."""
    recorder = FlightRecorder(flight_path(tmp_path, 0), 0, 2, capacity=8)
    return recorder, recorder.add_group(0x10, (0, 1), "TENSOR_MODEL_PARALLEL_GROUP")


def _enter(recorder, channel) -> int:
    return recorder.enter(OpKind.ALL_REDUCE, channel, 4, 0)


def _device_states(path) -> list[DeviceState]:
    return [r.device for r in read_records(path)]


def test_comm_op_notifies_start_and_completion_into_the_file(tmp_path):
    """The NCCL-like mode's op writes its own state, exact times, no polling thread."""
    recorder, channel = _recorder(tmp_path)
    gate, ran = threading.Event(), threading.Event()
    ops = []
    for name in ("done", "hung", "queued"):
        op = CommOp(name, gate.wait if name == "hung" else (lambda: None), [])
        recorder.track(_enter(recorder, channel), op)
        ops.append(op)
    assert _device_states(recorder.path) == [Q, Q, Q]
    ops[0].execute()
    worker = threading.Thread(target=lambda: (ran.set(), ops[1].execute()), daemon=True)
    worker.start()
    ran.wait()
    while not ops[1].started:
        threading.Event().wait(0.001)
    states = _device_states(recorder.path)
    assert states == [C, S, Q]  # a stall seen from outside: started, never completed; queued
    first = read_records(recorder.path)[0]
    assert (first.start_mono, first.done_mono) == (ops[0].started, ops[0].completed)
    assert recorder._watcher.thread is None  # nothing was polled
    gate.set()
    ops[1].wait()
    assert _device_states(recorder.path)[1] == C  # written before wait() returned
    recorder.close()


def test_a_late_notification_cannot_move_a_state_back(tmp_path):
    recorder, channel = _recorder(tmp_path)
    index = _enter(recorder, channel)
    recorder.device(index, C, 1.0, 2.0)
    recorder.device(index, S, 1.0)
    recorder.device(index, F)
    assert _device_states(recorder.path) == [C]
    recorder.close()


def test_work_future_callback_marks_completion(tmp_path):
    """A torch future (what a CPU ``Work.get_future()`` returns) completes the record."""

    class Work:
        def __init__(self) -> None:
            self.future = torch.futures.Future()

        def get_future(self):
            return self.future

        def is_completed(self) -> bool:
            return self.future.done()

    recorder, channel = _recorder(tmp_path)
    ok, bad = Work(), Work()
    for work in (ok, bad):
        recorder.track(_enter(recorder, channel), work)
    assert _device_states(recorder.path) == [S, S]
    ok.future.set_result(None)
    bad.future.set_exception(RuntimeError("peer gone"))
    assert _device_states(recorder.path) == [C, F]
    assert recorder._watcher.thread is None
    recorder.close()


def test_device_interval_from_either_source():
    """One rule for the NCCL-like mode's exact notifications and CUDA's polled events."""
    # exact observations (the NCCL-like mode): kept as they are
    assert device_interval(1.0, 1.25, 0.25) == (1.0, 1.25)
    assert device_interval(1.0, 1.25, None) == (1.0, 1.25)
    # start seen on time, completion seen late by a coarse poll: the device's duration wins
    assert device_interval(1.0, 1.5, 0.125) == (1.0, 1.125)
    # start first seen in the same poll as the completion: placed back by the duration
    assert device_interval(1.5, 1.5, 0.25) == (1.25, 1.5)
    assert device_interval(0.0, 2.0, 0.5) == (1.5, 2.0)  # start never seen


class FakeEvent:
    """A CUDA event the test completes by hand; times in ms as ``elapsed_time`` gives them."""

    def __init__(self, ms: float = 0.0) -> None:
        self.ms, self.done = ms, False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other) -> float:
        return other.ms - self.ms


def test_device_span_is_polled_into_start_and_exact_duration_and_its_events_reused(monkeypatch):
    from types import SimpleNamespace

    from megascale.probes.flight import watcher as flight_watcher

    now = [100.0]  # the watcher's clock, moved by the test
    monkeypatch.setattr(flight_watcher, "time", SimpleNamespace(monotonic=lambda: now[0]))
    writes: list[tuple] = []
    p = Poller(lambda index, state, start=0.0, done=0.0: writes.append((index, state, start, done)))
    pool = EventPool(FakeEvent)
    start, done = pool.get(), pool.get()
    start.ms, done.ms = 10.0, 35.0  # the op ran 25 ms on the device
    span = DeviceSpan(start, done, pool)
    p.add(3, span, queued=True)
    assert p.poll() is False and writes == []  # queued: the stream has not reached the op
    start.done = True
    assert p.poll() is True
    assert writes == [(3, S, 100.0, 0.0)]  # first seen started at 100 s
    now[0], done.done = 100.5, True  # its completion seen by a poll 0.5 s later
    assert p.poll() is True
    index, state, begin, end = writes[1]
    assert (index, state, begin) == (3, C, 100.0) and end == pytest.approx(100.025)  # 25 ms
    assert p.in_flight() == [] and sorted(pool._free, key=id) == sorted([start, done], key=id)
    assert pool.get() in (start, done)  # reused, not allocated


def test_device_span_seen_started_and_done_in_one_poll_is_placed_back(monkeypatch):
    from types import SimpleNamespace

    from megascale.probes.flight import watcher as flight_watcher

    monkeypatch.setattr(flight_watcher, "time", SimpleNamespace(monotonic=lambda: 7.0))
    writes: list[tuple] = []
    p = Poller(lambda index, state, start=0.0, done=0.0: writes.append((index, state, start, done)))
    start, done = FakeEvent(0.0), FakeEvent(500.0)
    start.done = done.done = True
    p.add(0, DeviceSpan(start, done), queued=True)
    assert p.poll() is True and writes == [(0, C, 6.5, 7.0)]  # 500 ms, ending when seen


def test_device_span_over_a_work_has_a_start_and_no_duration():
    class Work:
        completed = False

        def is_completed(self) -> bool:
            return self.completed

    pool, work = EventPool(FakeEvent), Work()
    span = DeviceSpan(pool.get(), work, pool)
    assert span.started == 0.0  # the stream has not reached it
    span.start.done = True
    assert span.started > 0 and not span.is_completed() and span.duration is None
    work.completed = True
    assert span.is_completed()
    span.release()
    assert len(pool._free) == 1  # the start event back; the Work is not an event


def test_on_cuda_a_synchronous_op_is_followed_from_its_start_event_to_its_done_event(tmp_path):
    """The recorder's CUDA path with events the test completes: the start event taken before the
    op, the done event after it, both from the pool; the watcher writes start and completion."""

    class Event(FakeEvent):
        recorded = 0

        def record(self) -> None:
            Event.recorded += 1

    recorder, channel = _recorder(tmp_path)
    recorder._cuda, recorder._watcher.notify = True, False  # as install() sets them on a GPU
    recorder._events = pool = EventPool(Event)
    start = recorder.start_event()  # before the op, on its stream
    index = _enter(recorder, channel)
    recorder.track(index, None, channel.gid, start)  # a synchronous NCCL call returned None
    assert Event.recorded == 2 and _device_states(recorder.path) == [Q]
    (span,) = [entry[1] for lane in recorder._watcher._poller.lanes.values() for entry in lane]
    span.done.ms = span.start.ms + 4.0
    span.start.done = span.done.done = True
    while recorder._watcher._poller.in_flight():  # the watcher thread's next poll
        threading.Event().wait(0.001)
    (record,) = read_records(recorder.path)
    assert record.device == C and record.done_mono - record.start_mono == pytest.approx(0.004)
    assert len(pool._free) == 2  # both events back for the next op
    recorder.close()
    recorder._watcher.thread.join(timeout=60)
    assert not recorder._watcher.thread.is_alive()  # closing the recorder ends its watcher


class _DeviceLog:
    """Stands in for ``torch.cuda.set_device``: which thread made which device current, and when
    relative to the trackers' queries (a new thread starts on GPU 0, whatever its process uses)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def set_device(self, device) -> None:
        self.calls.append((threading.current_thread().name, device))


class _LoggedTracker(Tracker):
    def __init__(self, log: _DeviceLog) -> None:
        super().__init__()
        self.log = log

    def is_completed(self) -> bool:
        self.log.calls.append((threading.current_thread().name, "query"))
        return super().is_completed()


@pytest.mark.parametrize("device", [3, None], ids=["cuda:3", "no device"])
def test_the_polling_thread_makes_its_device_current_before_its_first_query(monkeypatch, device):
    log = _DeviceLog()
    monkeypatch.setattr(torch.cuda, "set_device", log.set_device)
    watcher = CompletionWatcher(lambda *args, **kwargs: None, notify=False, device=device)
    tracker = _LoggedTracker(log)
    tracker.completed = 1.0
    watcher.add(0, tracker, queued=False)
    while watcher._poller.in_flight():
        threading.Event().wait(0.001)
    watcher.stop()
    watcher.thread.join(timeout=60)
    first_query = log.calls.index(("flight-watcher", "query"))
    expected = [] if device is None else [("flight-watcher", device)]
    assert log.calls[:first_query] == expected  # on the watcher's own thread, before it queries


def test_on_cuda_the_recorder_gives_its_watcher_this_ranks_gpu(tmp_path, monkeypatch):
    """``install`` runs before ``init_distributed`` makes LOCAL_RANK's GPU current, so the
    recorder names that GPU to its watcher rather than reading the current one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "5")
    recorder, _channel = _recorder(tmp_path)
    recorder.install()
    try:
        assert recorder._watcher.device == 5 and recorder._watcher.notify is False
    finally:
        recorder.close()


def test_a_coalescing_blocks_handle_stays_queued_until_its_op_starts(tmp_path):
    """The distributed optimizer's overlapped gathers are coalescing blocks: their record must
    say queued while the op waits on a halted communication thread, not started when issued."""
    from megascale.parallel.async_comm import _CoalescedHandle

    recorder, channel = _recorder(tmp_path)
    handle = _CoalescedHandle()
    handle.op = CommOp("coalesced", lambda: None, [])
    recorder.track(_enter(recorder, channel), handle)
    assert _device_states(recorder.path) == [Q]
    handle.op.execute()
    assert _device_states(recorder.path) == [C]
    recorder.close()
