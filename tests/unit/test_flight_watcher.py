"""The flight recorder's watcher: what it writes and when it polls, decided without a clock.

The polled path is driven one pass at a time (``Poller.poll``) with trackers the test completes by
hand; the notified path with the NCCL-like mode's real ``CommOp`` and the recorder's real ``device``
writes into a real file, read back with the agent's reader."""

from __future__ import annotations

import threading

import torch

from megascale.parallel.async_comm import CommOp
from megascale.robustness.flight_format import DeviceState, OpKind, flight_path, read_records
from megascale.robustness.flight_recorder import FlightRecorder
from megascale.robustness.flight_watcher import MAX_INTERVAL_S, MIN_INTERVAL_S, Backoff, Poller

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
