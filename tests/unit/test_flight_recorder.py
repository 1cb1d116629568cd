"""Flight recorder and progress file: the byte layout, the ring, the readers, the stall analysis.

No process group here: records are written through ``FlightRecorder.add_group``/``enter``/``mark``
(what the torch.distributed wrappers call), and the stall analysis runs on crafted ``RankState``s.
"""

from __future__ import annotations

import json
import os
import struct

import pytest

from megascale.probes.flight.culprits import stall_suspects
from megascale.probes.flight.format import (
    ASYNC,
    HEADER,
    FlightFileError,
    GroupInfo,
    OpKind,
    OpRecord,
    OpState,
    RankState,
    flight_path,
    last_state,
    read_flight,
    read_records,
    runs_of,
)
from megascale.probes.flight.recorder import FlightRecorder, NullFlightRecorder
from megascale.probes.progress import (
    NullProgressFile,
    ProgressFile,
    WorkerSignals,
    progress_path,
    read_progress,
)

TABLE = 256  # group table bytes in these tests
RING = HEADER.size + TABLE


def _recorder(tmp_path, capacity=8, rank=3, world=8) -> FlightRecorder:
    return FlightRecorder(
        flight_path(tmp_path, rank), rank, world, capacity=capacity, group_table_bytes=TABLE
    )


# -- layout ----------------------------------------------------------------------------------------


def test_header_layout_byte_by_byte(tmp_path):
    rec = _recorder(tmp_path)
    rec.set_step(7)
    rec.set_section("step")
    data = rec.path.read_bytes()
    assert len(data) == 128 + TABLE + 8 * 96
    assert data[0:8] == b"MSFLIGHT"
    u32 = lambda off: struct.unpack_from("<I", data, off)[0]  # noqa: E731
    i32 = lambda off: struct.unpack_from("<i", data, off)[0]  # noqa: E731
    assert (u32(8), u32(12), u32(16), u32(20), u32(24)) == (2, 128, 96, 8, TABLE)
    assert (i32(28), i32(32), i32(36)) == (3, 8, os.getpid())
    assert struct.unpack_from("<Q", data, 40)[0] > 0  # /proc start time of this process
    assert struct.unpack_from("<Q", data, 56)[0] == 0  # nothing written yet
    assert struct.unpack_from("<q", data, 72)[0] == 7
    assert data[96:112] == b"step".ljust(16, b"\0")
    assert data[112:128] == bytes(16)


def test_record_and_group_layout_byte_by_byte(tmp_path):
    rec = _recorder(tmp_path)
    rec.set_step(5)
    tp = rec.add_group(0xABCDEF, (4, 5, 6, 7), "TENSOR_MODEL_PARALLEL_GROUP")
    index = rec.enter(OpKind.ALL_REDUCE, tp, 4096, ASYNC)
    data = rec.path.read_bytes()
    # the group table entry at 128
    gid, last_seq, nranks, nruns, p2p, _, label = struct.unpack_from("<QQIHBB32s", data, 128)
    assert (gid, last_seq, nranks, nruns, p2p) == (0xABCDEF, 1, 4, 1, 0)
    assert label.rstrip(b"\0") == b"TENSOR_MODEL_PARALLEL_GROUP"
    assert struct.unpack_from("<IiI", data, 128 + 56) == (4, 1, 4)
    assert struct.unpack_from("<Q", data, 64)[0] == 72  # groups_used: 56 + 12, padded to 8
    # the record in slot 0 of the ring
    assert struct.unpack_from("<Q", data, 56)[0] == 1  # write_index
    off = RING + index * 96
    assert struct.unpack_from("<QQQQq", data, off) == (0, 1, 0xABCDEF, 4096, 5)
    assert struct.unpack_from("<d", data, off + 56)[0] == 0.0  # not left
    assert struct.unpack_from("<IHBBI", data, off + 64) == (0xFFFFFFFF, 1, 1, ASYNC, 1)
    rec.mark([index], OpState.WAITING)
    assert rec.path.read_bytes()[off + 70] == OpState.WAITING
    rec.mark([index], OpState.LEFT)
    data = rec.path.read_bytes()
    enter_mono, _, leave_mono = struct.unpack_from("<ddd", data, off + 40)
    assert data[off + 70] == OpState.LEFT and leave_mono >= enter_mono > 0


def test_ring_wraps_and_keeps_the_newest(tmp_path):
    rec = _recorder(tmp_path, capacity=4)
    dp = rec.add_group(0x10, (0, 8, 16), "DATA_PARALLEL_GROUP")
    indices = [rec.enter(OpKind.REDUCE_SCATTER_TENSOR, dp, 100 + i, 0) for i in range(10)]
    for index in indices:
        rec.mark([index], OpState.LEFT)  # marks of overwritten records are dropped
    records = read_records(rec.path)
    assert [r.index for r in records] == [6, 7, 8, 9]
    assert [r.seq for r in records] == [7, 8, 9, 10]
    assert [r.nbytes for r in records] == [106, 107, 108, 109]
    assert all(r.state == OpState.LEFT for r in records)
    assert read_flight(rec.path).groups[0x10].last_seq == 10  # the table never wraps


def test_reader_skips_a_slot_being_overwritten(tmp_path):
    rec = _recorder(tmp_path, capacity=4)
    g = rec.add_group(0x10, (0, 1), "")
    for _ in range(3):
        rec.enter(OpKind.ALL_REDUCE, g, 0, 0)
    with open(rec.path, "r+b") as f:  # slot 1 now claims to be record 5: a newer, torn write
        f.seek(RING + 1 * 96)
        f.write(struct.pack("<Q", 5))
    assert [r.index for r in read_records(rec.path)] == [0, 2]


def test_group_table_full_keeps_recording(tmp_path, caplog):
    rec = _recorder(tmp_path)
    groups = [rec.add_group(i + 1, tuple(range(0, 2 * i + 2, 2 + i % 2)), "g") for i in range(6)]
    assert groups[-1].offset == -1 and "group table full" in caplog.text
    rec.enter(OpKind.BARRIER, groups[-1], 0, 0)
    assert read_records(rec.path)[-1].group == groups[-1].gid


@pytest.mark.parametrize(
    "ranks",
    [(0,), (0, 1, 2, 3), (0, 8, 16, 24), (3, 2, 1), (0, 2, 4, 5, 9, 13), tuple(range(4096))],
)
def test_rank_runs_round_trip(ranks):
    runs = runs_of(ranks)
    assert tuple(r for s, d, n in runs for r in range(s, s + d * n, d)) == ranks
    if ranks == tuple(range(4096)):
        assert runs == [(0, 1, 4096)]


# -- reader errors ---------------------------------------------------------------------------------


def test_reader_names_the_problem_with_a_bad_file(tmp_path):
    rec = _recorder(tmp_path)
    rec.enter(OpKind.ALL_REDUCE, rec.add_group(1, (0, 1), ""), 0, 0)
    good = rec.path.read_bytes()
    bad = tmp_path / "bad.bin"
    cases = {
        b"": "shorter than the 128-byte",
        good[:100]: "shorter than the 128-byte",
        good[: len(good) // 2]: "truncated",
        b"GARBAGE!" + os.urandom(2000): "not a flight file",
        good[:8] + struct.pack("<I", 99) + good[12:]: "version 99",
        good[:16] + struct.pack("<I", 64) + good[20:]: "record_bytes=64",
    }
    for content, message in cases.items():
        bad.write_bytes(content)
        with pytest.raises(FlightFileError, match=message):
            read_records(bad)
    with pytest.raises(FileNotFoundError):
        last_state(tmp_path / "missing.bin")


def test_reader_rejects_a_corrupt_record(tmp_path):
    rec = _recorder(tmp_path)
    rec.enter(OpKind.ALL_REDUCE, rec.add_group(1, (0, 1), ""), 0, 0)
    with open(rec.path, "r+b") as f:
        f.seek(RING + 68)
        f.write(struct.pack("<H", 999))
    with pytest.raises(FlightFileError, match="record 0: 999 is not a valid OpKind"):
        read_records(rec.path)


# -- last_state ------------------------------------------------------------------------------------


def test_last_state_tells_blocked_from_in_flight(tmp_path):
    rec = _recorder(tmp_path)
    rec.set_step(12)
    dp, tp = rec.add_group(1, (3, 11), "DATA_PARALLEL_GROUP"), rec.add_group(2, (2, 3), "TP")
    prefetch = rec.enter(OpKind.ALL_GATHER_INTO_TENSOR, dp, 64, ASYNC)  # in flight
    state = last_state(rec.path)
    assert state.blocked == () and not state.last_left and state.step == 12
    assert state.process == "R" and state.pid == os.getpid() and not state.stopped
    sync = rec.enter(OpKind.ALL_REDUCE, tp, 4, 0)  # a synchronous op not returned: blocked
    state = last_state(rec.path)
    assert [op.index for op in state.blocked] == [sync] and state.last.kind == OpKind.ALL_REDUCE
    rec.mark([sync], OpState.LEFT)
    rec.mark([prefetch], OpState.WAITING)  # in the prefetch's wait()
    state = last_state(rec.path)
    assert [op.index for op in state.blocked] == [prefetch] and state.last_left
    assert state.seq(1) == 1 and state.seq(2) == 1 and state.seq(99) == 0
    assert state.groups[1].ranks == (3, 11) and state.groups[2].label == "TP"
    assert state.last_activity_mono >= state.last.enter_mono


def test_rank_state_json_round_trip_and_controller_summary(tmp_path):
    rec = _recorder(tmp_path)
    g = rec.add_group(0xFEDCBA9876543210, tuple(range(0, 64, 8)), "DATA_PARALLEL_GROUP")
    rec.enter(OpKind.ALL_REDUCE, g, 8, 0)
    state = last_state(rec.path)
    payload = json.loads(json.dumps(state.to_json()))
    assert RankState.from_json(payload) == state
    assert payload["groups"]["fedcba9876543210"]["runs"] == [[0, 8, 8]]
    # the keys megascale.controller.fsm.FlightRecord.from_json reads
    assert (payload["seq"], payload["kind"], payload["left"]) == (1, "all_reduce", False)
    assert payload["group"] == list(range(0, 64, 8))


def test_null_objects_have_the_real_methods():
    def public(cls):
        return {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}

    assert public(NullFlightRecorder) >= {"install", "set_step", "set_section", "close"}
    assert public(NullProgressFile) == public(ProgressFile)


# -- stall_suspects --------------------------------------------------------------------------------


def _op(gid: int, seq: int, state=OpState.ENTERED) -> OpRecord:
    return OpRecord(0, seq, gid, OpKind.ALL_REDUCE, state, 0, 0, 1, 1.0, 1.0, None, None, 1)


def _state(rank, seqs: dict[int, int], groups, blocked=(), process=None) -> RankState:
    """Rank ``rank`` whose last sequence number on group g is seqs[g], blocked in (g, seq) ops."""
    infos = {g: GroupInfo(g, f"g{g}", groups[g], s) for g, s in seqs.items()}
    ops = tuple(_op(g, s) for g, s in blocked)
    return RankState(rank, 8, 100 + rank, 1, "step", None, ops, infos, process=process)


WORLD = {1: (0, 1, 2, 3)}
TP_DP = {10: (0, 1), 11: (2, 3), 20: (0, 2), 21: (1, 3)}


def test_suspect_is_the_rank_that_never_entered():
    states = {r: _state(r, {1: 5}, WORLD, blocked=[(1, 5)]) for r in (0, 1, 3)}
    states[2] = _state(2, {1: 4}, WORLD)  # computing, or stopped before the all-reduce
    assert stall_suspects(states) == [2]


def test_two_suspects_in_different_groups():
    states = {
        0: _state(0, {10: 3}, TP_DP, blocked=[(10, 3)]),
        1: _state(1, {10: 2}, TP_DP),
        2: _state(2, {11: 3}, TP_DP, blocked=[(11, 3)]),
        3: _state(3, {11: 2}, TP_DP),
    }
    assert stall_suspects(states) == [1, 3]


def test_waits_are_followed_across_groups():
    # rank 3 stopped before a TP all-reduce rank 2 waits in; 0 and 1 wait in DP for 2 and 3
    states = {
        0: _state(0, {10: 4, 20: 7}, TP_DP, blocked=[(20, 7)]),
        1: _state(1, {10: 4, 21: 7}, TP_DP, blocked=[(21, 7)]),
        2: _state(2, {11: 4, 20: 6}, TP_DP, blocked=[(11, 4)]),
        3: _state(3, {11: 3, 21: 6}, TP_DP),
    }
    assert stall_suspects(states) == [3]


def test_nobody_stuck_means_no_suspects():
    assert stall_suspects({r: _state(r, {1: 5}, WORLD) for r in range(4)}) == []
    assert stall_suspects({}) == []


def test_all_entered_is_not_a_rank_fault_unless_one_is_stopped():
    states = {r: _state(r, {1: 5}, WORLD, blocked=[(1, 5)]) for r in range(4)}
    assert stall_suspects(states) == []
    states[1] = _state(1, {1: 5}, WORLD, blocked=[(1, 5)], process="T")  # SIGSTOP inside it
    assert stall_suspects(states) == [1]


def test_unreadable_rank_is_a_suspect():
    states = {r: _state(r, {1: 5}, WORLD, blocked=[(1, 5)]) for r in (0, 1, 2)}
    assert stall_suspects(states) == [3]  # rank 3's file could not be read


def test_a_chain_of_waits_ends_at_one_suspect():
    # 0 waits in TP for 1; 1 waits in DP for 3; 3 is computing (2 is idle, not involved)
    states = {
        0: _state(0, {10: 2, 20: 1}, TP_DP, blocked=[(10, 2)]),
        1: _state(1, {10: 1, 21: 1}, TP_DP, blocked=[(21, 1)]),
        2: _state(2, {11: 0, 20: 1}, TP_DP),
        3: _state(3, {11: 0, 21: 0}, TP_DP),
    }
    assert stall_suspects(states) == [3]


def test_ops_in_opposite_orders_form_a_cycle():
    # 0 entered g20 (seq 1) and waits for 2 there; 2 entered g11 (seq 1) and waits for 3;
    # 3 entered g21 (seq 1) and waits for 1; 1 entered g10 (seq 1) and waits for 0
    states = {
        0: _state(0, {10: 0, 20: 1}, TP_DP, blocked=[(20, 1)]),
        1: _state(1, {10: 1, 21: 0}, TP_DP, blocked=[(10, 1)]),
        2: _state(2, {11: 1, 20: 0}, TP_DP, blocked=[(11, 1)]),
        3: _state(3, {11: 0, 21: 1}, TP_DP, blocked=[(21, 1)]),
    }
    assert stall_suspects(states) == [0, 1, 2, 3]


def test_state_json_feeds_stall_suspects(tmp_path):
    states = {r: _state(r, {1: 5}, WORLD, blocked=[(1, 5)]) for r in (0, 1, 3)}
    states[2] = _state(2, {1: 4}, WORLD)
    through_json = {
        r: RankState.from_json(json.loads(json.dumps(s.to_json()))) for r, s in states.items()
    }
    assert stall_suspects(through_json) == [2]


# -- progress file ---------------------------------------------------------------------------------


def test_progress_file_sections_and_steps(tmp_path):
    progress = ProgressFile(progress_path(tmp_path, 2), 2)
    progress.enter("init")
    first = read_progress(progress.path)
    assert (first.section, first.step, first.rank, first.pid) == ("init", 0, 2, os.getpid())
    progress.enter("step")
    progress.step(1, 0.25, 1000.0)
    state = read_progress(progress.path)
    assert (state.section, state.step, state.step_time_s, state.tokens_per_s) == (
        "step",
        1,
        0.25,
        1000.0,
    )
    assert "init" in state.durations and state.heartbeat >= first.heartbeat
    assert state.val_loss is None  # no evaluation yet
    progress.step(2, 0.25, 1000.0, val_loss=2.5)
    progress.step(3, 0.25, 1000.0)
    assert read_progress(progress.path).val_loss == 2.5  # the last evaluation's, kept
    progress.close()
    assert read_progress(progress.path).section == "done"
    assert list(tmp_path.joinpath("progress").iterdir()) == [progress.path]  # no temp file left
    with pytest.raises(ValueError, match="section='warmup'; expected one of init"):
        progress.enter("warmup")


def test_progress_reader_names_a_bad_file(tmp_path):
    bad = tmp_path / "rank_00000.json"
    for content in ("", "{not json", json.dumps({"version": 1, "rank": 0}), "[]"):
        bad.write_text(content)
        with pytest.raises(ValueError, match="not a megascale progress file"):
            read_progress(bad)


def test_worker_signals_disabled_by_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_FLIGHT_RECORDER", "0")
    monkeypatch.setenv("MEGASCALE_PROGRESS", "0")
    signals = WorkerSignals.open(tmp_path, 0, 1)
    assert isinstance(signals.recorder, NullFlightRecorder)
    assert isinstance(signals.progress, NullProgressFile)
    signals.step_started(1)
    with signals.section("checkpoint"):
        pass
    signals.close()
    assert not (tmp_path / "flight").exists() and not (tmp_path / "progress").exists()


def test_a_recorder_of_the_hosts_view_follows_no_op_to_completion():
    """``follow_device=False``: records keep their host times; nothing is polled."""
    from megascale.probes.flight.format import DeviceState, OpKind

    class Pending:  # a handle that never completes: a followed op would be polled for ever
        def is_completed(self):
            return False

    followed, host = (FlightRecorder(None, 0, 1, follow_device=f) for f in (True, False))
    for recorder in (followed, host):
        group = recorder.add_group(7, (0,), "g")
        recorder.track(recorder.enter(OpKind.ALL_REDUCE, group, 8, 0), Pending())
    device_state = [next(r.copy(0, 1).records())[0][13] for r in (followed, host)]
    assert device_state == [int(DeviceState.STARTED), 0]
    assert followed._watcher.thread is not None and host._watcher.thread is None
    for recorder in (followed, host):
        recorder.close()
