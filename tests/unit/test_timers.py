"""The per-rank timeline recorder, its file format, and the merge's pure parts (no process group)."""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import pytest

from megascale.messages import Event
from megascale.probes import timers
from megascale.probes.comm_timer import FlightComm
from megascale.probes.flight.format import OpKind
from megascale.probes.timeline_segments import (
    CATEGORIES,
    MEGATRON_SEGMENTS,
    classify_comm,
    comm_segments,
    megatron_segment,
)
from megascale.probes.timers import NULL_TIMELINE, NullTimeline, Timeline
from megascale.tools import timeline as tl

META = {
    "rank": 3,
    "world_size": 4,
    "layout": {"tp": 1, "pp": 2, "dp": 2},
    "coords": {"dp": 1, "pp": 1, "tp": 0},
    "node": "node-1",
    "device": "cpu",
    "device_name": "cpu",
}


def test_megatron_timer_names_map_to_megascale_spans():
    assert megatron_segment("forward-compute") == ("megascale::model::forward", "compute")
    assert megatron_segment("backward-compute") == ("megascale::model::backward", "compute")
    assert megatron_segment("forward-recv") == ("megascale::pp::forward_recv", "comm.pp")
    assert megatron_segment("all-grads-sync") == ("megascale::dp::grad_sync", "comm.dp")
    assert megatron_segment("optimizer-inner-step") == ("megascale::optim::inner_step", "optimizer")
    assert megatron_segment("something-new") == ("megascale::mcore::something_new", "other")
    for name, cat in MEGATRON_SEGMENTS.values():
        assert name.startswith("megascale::") and name.count("::") == 2, name
        assert cat in CATEGORIES


@pytest.mark.parametrize(
    "kind, coalesced, where, group",
    [
        ("all_reduce", False, "comm.dp", "dp"),  # inside megatron-core's DP grad sync
        ("all_reduce", False, "comm.tp", "tp"),  # the SP LayerNorm grads
        ("irecv", False, None, "pp"),
        ("isend", False, "compute", "pp"),
        ("reduce_scatter_tensor", True, None, "dp"),  # one DP bucket
        ("reduce_scatter_tensor", True, "compute", "dp"),
        ("all_gather_into_tensor", False, "compute", "tp"),  # TP/SP inside a layer
        ("all_reduce", False, "optimizer", "other"),  # grad norm
        ("all_reduce", False, None, "other"),  # the loss
    ],
)
def test_classify_comm(kind, coalesced, where, group):
    assert classify_comm(kind, coalesced, where) == group


def test_null_timeline_has_every_public_method_of_timeline():
    public = {n for n, v in vars(Timeline).items() if callable(v) and not n.startswith("_")}
    null = {n for n, v in vars(NullTimeline).items() if callable(v) and not n.startswith("_")}
    assert public == null
    for name in public:
        assert list(inspect.signature(getattr(Timeline, name)).parameters) == list(
            inspect.signature(getattr(NullTimeline, name)).parameters
        ), name
    with NULL_TIMELINE.span("megascale::data::load"):
        pass
    NULL_TIMELINE.step_begin(1)
    NULL_TIMELINE.step_end()
    NULL_TIMELINE.close()


def _timeline(tmp_path, flush=2) -> Timeline:
    timeline = Timeline(
        tmp_path / "timeline" / "rank_00003.jsonl", META, flush_interval_steps=flush, device="cpu"
    )
    timeline._trace_comm = False
    return timeline


def test_steps_are_recorded_and_written_in_the_background(tmp_path):
    timeline = _timeline(tmp_path)
    timeline.open(ref_wall_ns=1_000_000_000_000, mono_ns=500)
    recorder = _memory_recorder()  # not installed: the test writes its records
    group = recorder.add_group(7, (0, 1), "g")
    comm = timeline._comm = FlightComm(recorder, owned=True)
    config, inner = SimpleNamespace(timers=None), SimpleNamespace(config=SimpleNamespace())
    optimizer = SimpleNamespace(chained_optimizers=[inner])
    timeline.attach(config, optimizer)
    for step in (1, 2, 3):
        timeline.step_begin(step)
        with timeline.span("megascale::data::load"):
            pass
        config.timers("forward-backward", log_level=1).start(barrier=True)
        for _ in range(2):  # two micro-batches, as megatron-core's schedule calls them
            config.timers("forward-compute", log_level=2).start()
            recorder.leave(recorder.enter(OpKind.ALL_REDUCE, group, 8, 0))  # TP: in a forward
            config.timers("forward-compute").stop()
            config.timers("backward-compute", log_level=2).start()
            config.timers("backward-compute").stop()
        config.timers("forward-backward").stop()
        with timeline.span("megascale::optim::step"):
            inner.config.timers("optimizer-inner-step", log_level=1).start()
            inner.config.timers("optimizer-inner-step").stop()
        timeline.step_end()
    timeline.step_begin(4)  # step 3's records are queued; steps 1-2 already went to the writer
    assert [b.step for b in timeline._pending] == [3]
    timeline.flush()  # written when flush returns
    text = (tmp_path / "timeline" / "rank_00003.jsonl").read_text()
    assert [json.loads(line)["type"] for line in text.splitlines()].count("step") == 3
    timeline.close()
    assert config.timers is None and inner.config.timers is None  # detached
    assert timeline._comm is timers._NO_COMM and comm.count() == 6  # taken, then dropped
    assert recorder._mm.closed  # the timeline's own recorder is closed with it

    lines = [json.loads(line) for line in (tmp_path / "timeline" / "rank_00003.jsonl").open()]
    assert [line["type"] for line in lines] == ["meta", "clock", "step", "step", "step"]
    assert lines[0]["node"] == "node-1" and lines[0]["format"] == timers.FORMAT_VERSION
    names = [s[0] for s in lines[2]["spans"]]
    assert names.count("megascale::model::forward") == 2
    assert names.count("megascale::model::backward") == 2
    for expected in (
        "megascale::train::step",
        "megascale::data::load",
        "megascale::schedule::forward_backward",
        "megascale::optim::step",
        "megascale::optim::inner_step",
        "megascale::tp::all_reduce",  # issued inside a forward: tensor parallel
    ):
        assert expected in names, expected
    spans = {s[0]: s for s in lines[2]["spans"]}
    step, data = spans["megascale::train::step"], spans["megascale::data::load"]
    assert step[2] <= data[2] and data[2] + data[3] <= step[2] + step[3]  # data inside the step

    # The merge aligns the rank's clock: ref_wall + (t - mono).
    rank = tl.load_rank(tmp_path / "timeline" / "rank_00003.jsonl")
    assert rank.rank == 3 and rank.coords == (1, 1, 0) and sorted(rank.steps) == [1, 2, 3]
    merged = {s[0]: s for s in rank.steps[1].spans}
    assert merged["megascale::train::step"][2] == step[2] + 1_000_000_000_000 - 500


def test_close_is_idempotent_and_safe_before_open(tmp_path):
    timeline = _timeline(tmp_path)
    timeline.close()
    timeline.open(0, 0)
    timeline.close()
    timeline.close()


class _FakeEvent:
    """A CUDA event as the writer thread sees it: elapsed_time in ms from the anchor."""

    def __init__(self, ms: float) -> None:
        self.ms, self.synced = ms, False

    def synchronize(self) -> None:
        self.synced = True

    def elapsed_time(self, other: _FakeEvent) -> float:
        return other.ms - self.ms


def test_device_spans_are_placed_from_the_anchor_event_when_resolved():
    clock = timers._CudaClock.__new__(timers._CudaClock)  # no torch.cuda needed to resolve
    anchor, start, end = _FakeEvent(0.0), _FakeEvent(2.0), _FakeEvent(5.5)
    batch = timers._Batch(step=7, anchor=anchor, anchor_ns=10_000_000)
    batch.spans.append(("megascale::model::forward", "compute", start, end, 0, 0))
    batch.spans.append(("megascale::data::load", "data", 10_000_100, 10_000_400, 0, 0))  # host
    record = timers.resolve_batch(batch, clock)
    assert start.synced and end.synced  # waited for on the writer thread, not the trainer's
    assert record["step"] == 7
    assert record["spans"][0] == ["megascale::model::forward", "compute", 12_000_000, 3_500_000]
    assert record["spans"][1] == ["megascale::data::load", "data", 10_000_100, 300]


def test_comm_records_become_blocked_and_in_flight_segments():
    s = 1_000_000_000
    records = [
        (4, "reduce_scatter_tensor", True, 1 * s, 1.5 * s, 1.6 * s),  # async bucket, waited later
        (5, "all_reduce", False, 2 * s, 2 * s, 2.25 * s),  # synchronous
        (7, "irecv", False, 3 * s, None, None),  # never waited on: nothing blocked
        (8, "all_gather_into_tensor", False, 4 * s, 4 * s, 4.5 * s),
    ]
    spans = [
        ("megascale::model::backward", "compute", 0, 0, 4, 6),  # records 4-5 inside backward
        ("megascale::model::forward", "compute", 0, 0, 8, 9),
        ("megascale::pp::forward_recv", "comm.pp", 0, 0, 6, 9),  # wider: forward is innermost
    ]
    blocked, inflight = comm_segments(records, spans)
    assert blocked == [
        ["megascale::dp::reduce_scatter_tensor", "comm.dp", 1_500_000_000, 100_000_000],
        ["megascale::tp::all_reduce", "comm.tp", 2_000_000_000, 250_000_000],
        ["megascale::tp::all_gather_into_tensor", "comm.tp", 4_000_000_000, 500_000_000],
    ]
    assert inflight == [
        ["megascale::dp::reduce_scatter_tensor", "comm.dp", 1_000_000_000, 600_000_000]
    ]
    # On a GPU a host interval says nothing: only records timed on the device are drawn.
    timed = (9, "all_reduce", False, 5 * s, 5 * s, 5 * s + 10, 5 * s + 2, 5 * s + 7)
    assert comm_segments([*records, timed], spans, host=False) == (
        [["megascale::other::all_reduce", "comm.other", 5 * s + 2, 5]],
        [["megascale::other::all_reduce", "comm.other", 5 * s, 10]],
    )


def test_union_ns_clips_and_merges():
    assert tl.union_ns([(0, 10), (5, 15), (20, 30)], 0, 100) == 25
    assert tl.union_ns([(0, 10), (5, 15), (20, 30)], 8, 25) == 12
    assert tl.union_ns([], 0, 10) == 0


def _write_rank(path, rank, steps, *, torn=False, restart_at=None):
    lines = [
        {"type": "meta", **META, "rank": rank},
        {"type": "clock", "ref_wall_ns": 10**12, "mono_ns": 0},
    ]
    for step, spans in steps:
        if step == restart_at:
            lines.append({"type": "meta", **META, "rank": rank, "node": "node-9"})
            lines.append({"type": "clock", "ref_wall_ns": 2 * 10**12, "mono_ns": 0})
        lines.append({"type": "step", "step": step, "spans": spans, "inflight": []})
    text = "".join(json.dumps(line) + "\n" for line in lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + ('{"type": "step", "st' if torn else ""))


def _step_spans(start, compute_ms, wait_ms):
    ms = 1_000_000
    return [
        ["megascale::train::step", "step", start, (compute_ms + wait_ms) * ms],
        ["megascale::model::forward", "compute", start, compute_ms * ms],
        ["megascale::pp::forward_recv", "comm.pp", start + compute_ms * ms, wait_ms * ms],
    ]


def test_load_run_survives_a_torn_line_and_a_restart(tmp_path):
    path = tmp_path / "timeline" / "rank_00000.jsonl"
    steps = [(1, _step_spans(0, 10, 5)), (2, _step_spans(10**8, 10, 5)), (2, _step_spans(0, 30, 5))]
    _write_rank(path, 0, steps, torn=True, restart_at=None)
    rank = tl.load_rank(path)
    assert sorted(rank.steps) == [1, 2]
    b = tl.breakdowns(rank)
    assert b[2].compute_s == pytest.approx(0.030)  # the replayed step's last record wins
    _write_rank(path, 0, steps[:2] + [(3, _step_spans(0, 10, 5))], restart_at=3)
    rank = tl.load_rank(path)
    assert rank.node == "node-9"  # the restarted process's meta
    assert rank.steps[3].spans[0][2] == 2 * 10**12  # placed with the new clock


def test_breakdown_period_runs_to_the_next_step():
    ms = 1_000_000
    first = tl.StepRecord(1, [tuple(s) for s in _step_spans(0, 10, 5)], [])
    b = tl.breakdown(first, next_start=40 * ms)  # 25 ms between steps (e.g. an injected sleep)
    assert b.step_s == pytest.approx(0.015)
    assert b.period_s == pytest.approx(0.040)
    assert b.comm_wait_s == pytest.approx(0.005) and b.comm_pp_s == pytest.approx(0.005)
    assert b.compute_s == pytest.approx(0.035)
    assert b.forward_s == pytest.approx(0.010)
    assert tl.breakdown(tl.StepRecord(2, [], []), None) is None  # never finished


def test_chrome_trace_names_ranks_and_threads(tmp_path):
    for rank in range(2):
        _write_rank(
            tmp_path / "timeline" / f"rank_{rank:05d}.jsonl",
            rank,
            [(1, _step_spans(0, 10, 5)), (2, _step_spans(20 * 10**6, 10, 5))],
        )
    ranks = tl.load_run(tmp_path)
    events = [Event(seq=0, time=1000.01, generation=0, kind="fault", node="node-1", rank=1)]
    trace = tl.chrome_trace(ranks, events, [{"step": 1, "loss": 5.0, "time": 1000.02}])
    json.dumps(trace)  # serialisable
    procs = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert procs == {
        0: "rank 0 (dp=1, pp=1, tp=0) on node-1",
        1: "rank 1 (dp=1, pp=1, tp=0) on node-1",
    }
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"step", "compute", "comm pp", "comm dp", "comm tp"} <= threads
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in spans) == 0 and len(spans) == 12
    (fault,) = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert fault["name"] == "fault (node node-1, rank 1, generation 0)"
    assert fault["ts"] == pytest.approx(10_000.0)  # 10 ms after the first segment
    steps_csv, segments_csv = tl.write_tables(ranks, tmp_path / "out")
    rows = steps_csv.read_text().splitlines()
    assert rows[0].startswith("rank,node,dp,pp,tp,step,step_s,period_s,compute_s,comm_wait_s")
    assert len(rows) == 1 + 4
    assert "megascale::pp::forward_recv" in segments_csv.read_text()


def _memory_recorder(capacity: int = 64):
    from megascale.probes.flight.recorder import FlightRecorder

    return FlightRecorder(None, rank=0, world_size=2, capacity=capacity)


def test_flight_recorder_wrappers_give_sync_async_coalesced_and_batched_records():
    """The recorder's own wrappers (as ``install`` stands them in front of torch.distributed),
    driven with stand-in functions: the timeline records each kind of call gives."""
    import contextlib

    import torch.distributed as dist

    from megascale.probes.flight.hooks import _OpWrapper

    recorder = _memory_recorder()
    channel = recorder.add_group(7, (0, 1), "g")
    recorder.group = recorder.pair = lambda *args: channel  # no process group needed
    recorder.active = True  # as install() leaves it, without patching torch.distributed
    comm = FlightComm(recorder, owned=True)

    class Work:
        def wait(self):
            return True

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return Work() if async_op else None

    def _reduce_scatter_base(output, input, op=None, group=None, async_op=False):
        return Work() if async_op else None

    wrapped = _OpWrapper("all_reduce", all_reduce, recorder)
    assert wrapped(1) is None
    work = wrapped(1, async_op=True)
    assert work.wait() is True and work.wait() is True  # the first wait is the one timed
    assert wrapped(1, None, None, True).wait() is True  # async_op given by position

    @contextlib.contextmanager
    def coalescing(group=None, device=None, async_ops=False):
        cm = SimpleNamespace(works=[], append=lambda w: None, wait=lambda: "waited")
        yield cm

    reduce_scatter = _OpWrapper("_reduce_scatter_base", _reduce_scatter_base, recorder)
    with recorder._coalescing(coalescing)(async_ops=True) as cm:
        reduce_scatter(1, 1, async_op=True)
        reduce_scatter(1, 1, async_op=True)
    assert cm.wait() == "waited" and cm.works == []
    with recorder._coalescing(coalescing)():
        pass  # no op inside: no record
    batch = recorder._batch(lambda ops: [Work() for _ in ops])
    ops = [
        SimpleNamespace(op=dist.isend, group=None, peer=1, tensor=None),
        SimpleNamespace(op=dist.irecv, group=None, peer=1, tensor=None),
    ]
    assert [w.wait() for w in batch(ops)] == [True, True]
    assert comm.count() == 6

    records = comm.take().records()
    assert len(comm.take()) == 0 and comm.count() == 6
    assert [r[:3] for r in records] == [
        (0, "all_reduce", False),
        (1, "all_reduce", False),
        (2, "all_reduce", False),
        (3, "reduce_scatter_tensor", True),  # one record per block
        (4, "isend", False),
        (5, "irecv", False),
    ]
    sync, async_, _, bucket, send, recv = records
    assert sync[3] == sync[4] <= sync[5]  # blocked from issue to return
    assert async_[3] <= async_[4] <= async_[5]  # blocked from its wait
    assert bucket[3] <= bucket[4] <= bucket[5]
    assert send[3] <= send[4] <= send[5] <= recv[4]  # each op of a batch waited on by itself
    recorder.active = False  # uninstalled or retired: calls pass straight through
    assert wrapped(1) is None and comm.count() == 6
    comm.uninstall()
    assert recorder._mm.closed and recorder.path is None


def test_timeline_installs_an_in_memory_recorder_only_where_none_is(tmp_path):
    import torch.distributed as dist

    from megascale.probes.comm_timer import timeline_comm
    from megascale.probes.flight.recorder import installed_recorder

    original = dist.all_reduce
    own = timeline_comm()  # no recorder installed: its own, in memory
    try:
        assert own.owned and own.recorder.path is None and installed_recorder() is own.recorder
        shared = timeline_comm()  # one is installed now: read it, never close it
        assert shared.recorder is own.recorder and not shared.owned
        shared.uninstall()
        assert not own.recorder._mm.closed
    finally:
        own.uninstall()
    assert dist.all_reduce is original and own.recorder._mm.closed
    assert not list(tmp_path.iterdir())  # no file anywhere it could be told of


def test_flight_records_decode_to_timeline_records(tmp_path):
    from megascale.probes.flight.format import ASYNC, COALESCED, P2P, OpKind, OpState
    from megascale.probes.flight.recorder import FlightRecorder

    recorder = FlightRecorder(tmp_path / "f.bin", rank=0, world_size=2, capacity=4)
    assert recorder.path.exists()  # the same records in a file as in memory
    group = recorder.add_group(7, (0, 1), "g")
    recorder.leave(recorder.enter(OpKind.ALL_REDUCE, group, 8, 0))  # before: not the timeline's
    comm = FlightComm(recorder)
    assert comm.count() == 1
    sync = recorder.enter(OpKind.ALL_REDUCE, group, 8, 0)
    recorder.leave(sync)
    bucket = recorder.enter(OpKind.REDUCE_SCATTER_TENSOR, group, 8, ASYNC | COALESCED, count=3)
    recorder.enter(OpKind.IRECV, group, 8, ASYNC | P2P, peer=1)  # never waited on
    recorder.mark((bucket,), OpState.WAITING)
    recorder.mark((bucket,), OpState.LEFT)
    assert comm.count() == 4
    records = comm.take().records()
    assert len(comm.take()) == 0
    assert [r[:3] for r in records] == [
        (1, "all_reduce", False),
        (2, "reduce_scatter_tensor", True),
        (3, "irecv", False),
    ]
    (_, _, _, issued, wait_start, wait_end), bucket_record, recv_record = records
    assert issued == wait_start <= wait_end  # synchronous: blocked from issue
    assert bucket_record[3] < bucket_record[4] <= bucket_record[5]  # blocked from its wait()
    assert recv_record[4:] == (None, None)

    for _ in range(5):  # more than the ring holds: the oldest are gone
        recorder.leave(recorder.enter(OpKind.BROADCAST, group, 8, 0))
    records = comm.take().records()
    assert [r[0] for r in records] == [5, 6, 7, 8] and {r[1] for r in records} == {"broadcast"}
    recorder.close()
    assert len(comm.take()) == 0


def test_comm_inside_a_checkpoint_is_not_subtracted_twice():
    ms = 1_000_000
    spans = [
        ("megascale::train::step", "step", 0, 10 * ms),
        ("megascale::checkpoint::save", "checkpoint", 10 * ms, 10 * ms),
        ("megascale::dp::all_gather_into_tensor", "comm.dp", 12 * ms, 5 * ms),  # inside it
    ]
    b = tl.breakdown(tl.StepRecord(1, spans, []), next_start=30 * ms)
    assert b.checkpoint_s == pytest.approx(0.010) and b.comm_wait_s == pytest.approx(0.005)
    assert b.compute_s == pytest.approx(0.020)  # 30 ms period - 10 ms of checkpoint
