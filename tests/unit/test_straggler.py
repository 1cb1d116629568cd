"""Straggler verdicts and MFU from per-rank, per-step compute times (pure; synthetic inputs)."""

from __future__ import annotations

import json
import random

import pytest

from megascale.config import load, to_toml
from megascale.parallel.layout import Layout
from megascale.probes import flops
from megascale.tools import straggler

LAYOUT = Layout(world_size=8, tp=2, pp=2, dp=2)  # stage 0: ranks 0-3, stage 1: ranks 4-7
NODES = {r: f"node-{r // 4}" for r in range(8)}


def _compute(slow: dict[int, float] = (), stage_cost=(0.10, 0.10), steps=8, noise=0.03, seed=0):
    rng = random.Random(seed)
    slow = dict(slow)
    return {
        r: {
            s: stage_cost[LAYOUT.coords(r).pp] * slow.get(r, 1.0) * (1 + rng.uniform(-noise, noise))
            for s in range(1, steps + 1)
        }
        for r in range(8)
    }


def test_stage_peers_are_the_other_ranks_of_the_pipeline_stage():
    assert straggler.stage_peers(LAYOUT, 5) == [4, 6, 7]
    assert straggler.stage_peers(LAYOUT, 0) == [1, 2, 3]
    alone = Layout(world_size=2, tp=1, pp=2, dp=1)
    assert straggler.stage_peers(alone, 1) == []  # alone in its stage: no peer


def test_ranks_alone_in_their_stage_are_not_scored_against_other_stages():
    alone = Layout(world_size=2, tp=1, pp=2, dp=1)  # the last stage 2x the first: not a straggler
    compute = {0: {s: 0.1 for s in range(1, 6)}, 1: {s: 0.2 for s in range(1, 6)}}
    report = straggler.analyze(compute, alone, {0: "node-0", 1: "node-1"}, 1.10)
    assert report.flagged_ranks == [] and report.slowdown == {0: {}, 1: {}}


def test_a_host_ten_percent_slow_is_flagged_and_no_other():
    report = straggler.analyze(_compute({6: 1.2}), LAYOUT, NODES, 1.10)
    assert [v.rank for v in report.flagged_ranks] == [6]
    assert [n.node for n in report.flagged_nodes] == ["node-1"]
    (node,) = report.flagged_nodes
    assert node.flagged_ranks == (6,) and node.ranks == (4, 5, 6, 7)
    assert report.rank_verdicts[6].slowdown == pytest.approx(1.2, abs=0.05)
    assert report.analysed_steps == list(range(2, 9))  # the first step is warm-up
    text = "\n".join(report.describe())
    assert "rank 6 (dp=1, pp=1, tp=0) on node-1" in text and "node-1" in text


def test_a_heavier_pipeline_stage_is_not_a_straggler():
    # The last stage holds the LM head: every rank there is 1.5x the first stage, evenly.
    report = straggler.analyze(_compute(stage_cost=(0.10, 0.15)), LAYOUT, NODES, 1.10)
    assert report.flagged_ranks == [] and report.flagged_nodes == []
    assert "no straggler" in report.describe()[0]


def test_one_slow_step_is_not_persistent():
    compute = _compute()
    compute[2][5] *= 3.0  # a single hiccup (e.g. Python GC)
    report = straggler.analyze(compute, LAYOUT, NODES, 1.10)
    assert report.flagged_ranks == []
    assert report.slowdown[2][5] == pytest.approx(3.0, rel=0.1)  # visible in the heat map


def test_a_slow_first_step_alone_is_ignored():
    compute = _compute()
    compute[3][1] *= 4.0
    assert straggler.analyze(compute, LAYOUT, NODES).flagged_ranks == []


def test_missing_steps_and_ranks_are_tolerated():
    compute = _compute({1: 1.5})
    del compute[0][4]
    del compute[7]  # a rank whose file is missing
    report = straggler.analyze(compute, LAYOUT, NODES, 1.10)
    assert [v.rank for v in report.flagged_ranks] == [1]
    assert 4 not in report.slowdown[0]


def test_threshold_must_exceed_one():
    with pytest.raises(ValueError, match="threshold = 1.0: must be > 1"):
        straggler.analyze(_compute(), LAYOUT, NODES, 1.0)


def test_step_mfu_with_and_without_a_peak():
    rows = straggler.step_mfu({1: [2.0, 2.2, 1.8], 2: [1.0]}, 1000, 6e9, 8, 989.0)
    assert [r.step for r in rows] == [1, 2]
    assert rows[0].step_time_s == 2.0 and rows[0].tokens_per_s == 500.0
    assert rows[0].mfu == pytest.approx(flops.mfu(500.0, 8, 6e9, 989.0))
    assert straggler.step_mfu({1: [1.0]}, 1000, 6e9, 8, None)[0].mfu is None


def test_peak_named_from_the_gpu_or_absent_on_cpu():
    assert straggler._peak("NVIDIA H100 80GB HBM3", None)[:2] == (
        989.0,
        "H100 SXM dense bf16 989 TFLOP/s",
    )
    value, name, note = straggler._peak("cpu", None)
    assert value is None and name is None and "CPU" in note
    assert straggler._peak("cpu", 100.0)[0] == 100.0  # an explicit peak always wins
    assert straggler._peak("Some GPU", None)[0] is None


def _write_run(run_dir, compute, device_name="cpu"):
    """A run directory as training leaves it: config.toml and one timeline file per rank."""
    job = load("tiny")
    (run_dir / "config.toml").write_text(to_toml(job))
    (run_dir / "timeline").mkdir(parents=True)
    for rank, steps in compute.items():
        c = LAYOUT.coords(rank)
        lines = [
            {
                "type": "meta",
                "rank": rank,
                "world_size": 8,
                "layout": {"tp": 2, "pp": 2, "dp": 2},
                "coords": {"dp": c.dp, "pp": c.pp, "tp": c.tp},
                "node": NODES[rank],
                "device_name": device_name,
            },
            {"type": "clock", "ref_wall_ns": 10**18, "mono_ns": 0},
        ]
        for step, seconds in steps.items():
            start, period = step * 10**9, 10**9  # every step lasts 1 s; the rest is waiting
            busy = int(seconds * 1e9)
            spans = [
                ["megascale::train::step", "step", start, period],
                ["megascale::model::forward", "compute", start, busy],
                ["megascale::dp::grad_sync", "comm.dp", start + busy, period - busy],
            ]
            lines.append({"type": "step", "step": step, "spans": spans, "inflight": []})
        path = run_dir / "timeline" / f"rank_{rank:05d}.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return job


def test_analyze_run_reads_the_timeline_and_config(tmp_path):
    job = _write_run(tmp_path, _compute({2: 1.5}))
    report = straggler.analyze_run(tmp_path)
    assert report.threshold == job.diagnostics.straggler_threshold
    assert [v.rank for v in report.flagged_ranks] == [2]
    assert report.labels[2] == "rank 2 (dp=1, pp=0, tp=0) on node-0"
    assert report.peak is None and "CPU" in report.mfu_note
    assert [m.step_time_s for m in report.mfu] == [1.0] * 8
    assert all(m.mfu is None for m in report.mfu)
    tokens = job.train.global_batch_size * job.model.seq_length
    assert report.mfu[0].tokens_per_s == pytest.approx(tokens)
    json.dumps(report.to_dict())  # what the controller would log or send


def test_analyze_run_mfu_against_the_gpus_peak(tmp_path):
    job = _write_run(tmp_path, _compute(), device_name="NVIDIA H100 80GB HBM3")
    report = straggler.analyze_run(tmp_path)
    per_token = flops.flops_per_token(job.model).total
    tokens = job.train.global_batch_size * job.model.seq_length
    assert report.peak == "H100 SXM dense bf16 989 TFLOP/s"
    assert report.mfu[0].mfu == pytest.approx(tokens * per_token / (8 * 989e12))
    assert "MFU: median" in report.describe()[-1]
