"""An 8-rank CPU run (TP2 x PP2 x DP2 + SP) with one rank slowed on purpose (the ``slow-rank``
fault injection): the merged trace is valid JSON with every rank and the named segments, the slowed
rank (and its machine) is the one flagged and no other, and recording the timeline does not change
the numbers. And on the same layout: the comm segments the timeline reads from the run's flight
recorder are those its own in-memory recorder gives for the same calls."""

from __future__ import annotations

import csv
import json
import os

import pytest
from harness import with_changes

from megascale import cli
from megascale.config import load, validate
from megascale.data.corpus import default_token_file
from megascale.launcher.local import run_local
from megascale.parallel import cpu_backend
from megascale.parallel.groups import build_groups, destroy_groups, init_distributed
from megascale.probes.comm_timer import FlightComm
from megascale.probes.flight.format import flight_path, read_records
from megascale.probes.flight.recorder import FlightRecorder
from megascale.probes.inject import ENV
from megascale.probes.timeline_segments import comm_segments
from megascale.probes.timers import build_timeline, rank_file
from megascale.tools import straggler
from megascale.train.run import run_rank, seed_everything
from megascale.train.trainer import Trainer

pytestmark = pytest.mark.slow

WORLD, SLOW_RANK, FACTOR, STEPS = 8, 5, 3.0, 6
# 8 ranks share 2 cores here and a step computes for only ~30 ms, so scheduling alone moves a
# rank's median slowdown up to ~1.3x (rank 0 also logs between steps); the slowed rank is ~5x.
# The unit tests hold the default 1.10 to synthetic data; MegaScale's 1.10 is for real machines.
THRESHOLD = 2.0


def _job(data_dir, **diagnostics):
    job = with_changes(
        load("tiny"),
        parallel={"tp": 2, "pp": 2, "sequence_parallel": True},
        model={"num_layers": 4, "hidden_size": 32, "num_heads": 4, "seq_length": 32},
        train={"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 1},
        optim={"warmup_steps": 1},
        data={"path": str(default_token_file(data_dir))},
        checkpoint={"interval": 3},
        diagnostics={"straggler_threshold": THRESHOLD, **diagnostics},
    )
    return validate(job, WORLD, "gloo")


def _rank(job, run_dir, inject):
    """One rank on machine ``node-<rank // 4>``, with the fault injection spec ``inject`` (the
    same for every rank, as the launcher passes it)."""
    os.environ["MEGASCALE_NODE"] = f"node-{int(os.environ['RANK']) // 4}"
    os.environ[ENV] = inject
    return [(m.step, m.loss, m.grad_norm) for m in run_rank(job, run_dir)]


@pytest.fixture(scope="module")
def slowed_run(tmp_path_factory, data_dir):
    run_dir = tmp_path_factory.mktemp("slowed")
    slow = f"slow-rank:rank={SLOW_RANK},factor={FACTOR}"  # its compute takes factor x as long
    losses = run_local(_rank, WORLD, (_job(data_dir), run_dir, slow), timeout_s=300)[0]
    return run_dir, losses


def test_merged_trace_has_every_rank_and_the_named_segments(slowed_run, tmp_path):
    run_dir, _ = slowed_run
    out = tmp_path / "trace.json"
    assert cli.main(["timeline", str(run_dir), "--out", str(out)]) == 0
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names) == list(range(WORLD))
    assert names[5] == "rank 5 (dp=0, pp=1, tp=1) on node-1"
    spans = [e for e in events if e["ph"] == "X"]
    for rank in range(WORLD):
        mine = {e["name"] for e in spans if e["pid"] == rank}
        for segment in (
            "megascale::train::step",
            "megascale::data::wait",
            "megascale::schedule::forward_backward",
            "megascale::model::forward",
            "megascale::model::backward",
            "megascale::optim::step",
            "megascale::dp::grad_sync",
            "megascale::checkpoint::save",
        ):
            assert segment in mine, (rank, segment)
        assert any(n.startswith("megascale::pp::") for n in mine), rank
        assert any(n.startswith("megascale::tp::") for n in mine), rank
        steps = {e["args"]["step"] for e in spans if e["pid"] == rank}
        assert set(range(1, STEPS + 1)) <= steps, rank
        forwards = [
            e for e in spans if e["pid"] == rank and e["name"] == "megascale::model::forward"
        ]
        assert len(forwards) == STEPS * 4  # 4 micro-batches per step on every rank
    # Clocks aligned: every rank's step 2 starts within a fraction of a step of the others'.
    starts = [
        e["ts"] for e in spans if e["name"] == "megascale::train::step" and e["args"]["step"] == 2
    ]
    durations = [e["dur"] for e in spans if e["name"] == "megascale::train::step"]
    assert max(starts) - min(starts) < max(durations)
    with open(tmp_path / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == WORLD * STEPS
    assert all(float(r["compute_s"]) > 0 and float(r["period_s"]) > 0 for r in rows)
    assert (tmp_path / "segments.csv").read_text().count("megascale::model::backward") == 48


def test_the_slowed_rank_and_its_machine_are_flagged_and_no_other(slowed_run):
    run_dir, _ = slowed_run
    report = straggler.analyze_run(run_dir)
    assert report.threshold == THRESHOLD
    assert [v.rank for v in report.flagged_ranks] == [SLOW_RANK], report.describe()
    assert [n.node for n in report.flagged_nodes] == ["node-1"]
    assert report.rank_verdicts[SLOW_RANK].slowdown > 1.5
    # Its TP peer waits for it in every TP collective inside forward and backward: not compute.
    assert report.rank_verdicts[SLOW_RANK - 1].slowdown < 1.5, report.describe()
    assert report.mfu and all(0 < m.mfu < 1 for m in report.mfu)  # against the measured peak
    assert "measured:cpu" in report.peak and "recorded by the run" in report.peak


def test_the_timeline_does_not_change_the_numbers(slowed_run, tmp_path, data_dir):
    _, losses = slowed_run
    job = _job(data_dir, timeline=False)
    plain = run_local(_rank, WORLD, (job, tmp_path, ""), timeout_s=300)[0]
    assert plain == losses  # exact: same loss and grad norm at every step
    assert not (tmp_path / "timeline").exists()


def _both_sources(job, run_dir, data_dir, steps):
    """Train ``steps`` steps with the run's flight recorder installed (the timeline reads it) and
    an in-memory recorder (what the timeline installs where none is) stacked on top of it, timing
    the same calls; per step: the timeline's spans, the records it took and the in-memory
    recorder's."""
    rank, world = init_distributed("cpu")
    recorder = FlightRecorder(flight_path(run_dir, rank), rank, world).install()
    cpu_backend.activate()
    groups = build_groups(job.parallel)
    seed_everything(job.train.seed, groups.tp_rank, "cpu")
    timeline = build_timeline(job.diagnostics, run_dir, groups, "cpu")
    trainer = Trainer(job, groups, "cpu", data_cache_dir=data_dir, timeline=timeline)
    assert isinstance(timeline._comm, FlightComm)  # no wrapper of the timeline's own
    timer = FlightComm(FlightRecorder(None, rank, world).install(), owned=True)
    timed = []
    for _ in range(steps):
        trainer.step()
        timed.append(timer.take().records())
    timer.uninstall()
    timeline.step_begin(steps + 1)  # queues the last step's records (flushed every 100 steps)
    per_step = [
        (batch.spans, [r for chunk in batch.comm for r in chunk.records()], records)
        for batch, records in zip(timeline._pending, timed, strict=True)
    ]
    timeline.close()
    recorder.close()
    destroy_groups()
    return per_step


def test_comm_segments_from_the_run_recorder_are_the_in_memory_recorders(tmp_path, data_dir):
    job = _job(data_dir, flush_interval_steps=100)
    per_rank = run_local(_both_sources, WORLD, (job, tmp_path, data_dir, 2), timeout_s=300)
    groups = set()
    for rank, steps in enumerate(per_rank):
        for spans, flight, timed in steps:
            assert [r[1:3] for r in flight] == [r[1:3] for r in timed], rank  # kind, coalesced
            # The in-memory recorder's records carry its own indices; the spans noted the run's.
            timed = [(f[0], *t[1:]) for f, t in zip(flight, timed, strict=True)]
            for ours, theirs in zip(
                comm_segments(flight, spans), comm_segments(timed, spans), strict=True
            ):
                assert [s[:2] for s in ours] == [s[:2] for s in theirs], rank  # names, categories
                gaps = []
                for (_, _, start, dur), (_, _, t_start, t_dur) in zip(ours, theirs, strict=True):
                    # The in-memory recorder's wrapper is outside: its interval holds the other.
                    assert t_start <= start and start + dur <= t_start + t_dur, rank
                    gaps.append(t_dur - dur)
                if gaps:  # a few us apart: two clock reads and the recorder's wrapper
                    assert sorted(gaps)[len(gaps) // 2] < 1_000_000, rank
            groups |= {s[1] for s in comm_segments(flight, spans)[0]}
    assert groups == {"comm.dp", "comm.pp", "comm.tp", "comm.other"}


def test_nccl_like_mode_has_a_segment_per_collective_where_it_ran(tmp_path, data_dir):
    """TP2 + SP in the NCCL-like mode: each TP collective is a segment from its start to its
    completion on the communication thread, as the flight recorder's watcher saw them, not the
    host call (which returns at once)."""
    job = with_changes(
        load("tiny"),
        parallel={"tp": 2, "sequence_parallel": True, "async_collectives": True},
        model={"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 32},
        train={"steps": 2, "global_batch_size": 2, "micro_batch_size": 1},
        optim={"warmup_steps": 1},
        data={"path": str(default_token_file(data_dir))},
        checkpoint={"interval": 0},
    )
    run_local(_rank, 2, (validate(job, 2, "gloo"), tmp_path, ""), timeout_s=300)
    for rank in range(2):
        device = {  # (start ns, duration ns) of every op seen to run, from the flight file
            (round(r.start_mono * 1e9), round(r.done_mono * 1e9) - round(r.start_mono * 1e9))
            for r in read_records(flight_path(tmp_path, rank))
            if r.start_mono and r.done_mono
        }
        lines = (json.loads(line) for line in rank_file(tmp_path, rank).read_text().splitlines())
        spans = [s for rec in lines if rec["type"] == "step" for s in rec["spans"]]
        tp = [s for s in spans if s[1] == "comm.tp"]
        names = {s[0] for s in tp}
        assert "megascale::tp::all_gather_into_tensor" in names, names
        assert "megascale::tp::reduce_scatter_tensor" in names, names
        on_device = [s for s in tp if (s[2], s[3]) in device]
        assert all(dur >= 0 for _, _, _, dur in on_device)  # start <= done
        # Nearly all from their run on the comm thread: ops not yet seen complete at the step
        # boundary (at most the last few of a step) keep their host interval.
        assert len(on_device) >= 0.8 * len(tp), (rank, len(on_device), len(tp))
        assert sum(s[3] for s in on_device) > 0, rank
