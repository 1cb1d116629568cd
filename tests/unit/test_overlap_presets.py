"""The overlap benchmark's 175B presets keep megascale-175b's ratios (pure arithmetic)."""

from __future__ import annotations

import pytest
from script_loader import load_script

from megascale.config import load


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/overlap.py", "overlap_benchmark")


def _sets(changes: list[str]) -> dict[str, str]:
    return dict(c.split("=", 1) for c in changes)


def test_175b_preset_keeps_tp_ratios_layers_microbatches_per_stage_and_buckets(bench):
    reference, small = load("megascale-175b"), load("tiny", bench.DEFAULT_SETS)
    assert bench.chunk_params(reference) == pytest.approx(453e6, rel=1e-3)
    sets = _sets(bench.preset_175b_sets(small, reference, dp=2))
    job = load("tiny", [*bench.DEFAULT_SETS, *(f"{k}={v}" for k, v in sets.items())])
    assert bench.tp_bytes_per_flop(job) == pytest.approx(
        bench.tp_bytes_per_flop(reference), rel=0.05
    )
    assert bench.output_bytes_per_flop(job) == pytest.approx(
        bench.output_bytes_per_flop(reference), rel=0.05
    )
    assert bench.layers_per_chunk(job) == bench.layers_per_chunk(reference) == 2
    assert bench.microbatches_per_stage(job, 2) == 4  # 32 per DP rank over PP8 at 175B
    buckets = bench.chunk_params(job) / job.overlap.bucket_size
    assert buckets == pytest.approx(453e6 / 192e6, rel=1e-3)  # megatron's bucket at DP192
    assert job.overlap.tp_chunks == 8


def test_175b_dp_preset_gives_each_dp_rank_175bs_tokens_per_step(bench):
    reference, small = load("megascale-175b"), load("tiny", bench.DEFAULT_SETS)
    job = load("tiny", [*bench.DEFAULT_SETS, *bench.preset_175b_dp_sets(small, reference, dp=2)])
    tokens = job.train.global_batch_size // 2 * job.model.seq_length
    assert tokens == 6144 // 192 * 2048 == 65536
    assert bench.microbatches_per_stage(job, 2) == 4


def _summary(bench) -> dict:
    link = {"comm_s": 0.0, "exposed_comm_s": 0.0, "hidden": None, "by_call": {}}
    pp = {**link, "exposed_bound_s": 0.0, "hidden_bound": None}
    row = {"step_time_s": 1.5, "vs_off": 1.0, "max_loss_diff_vs_off": 0.0}
    row |= {"tp": link, "pp": pp, "dp": link}
    return {"cost_model": {"kind": "fixed"}, "blocks": {"all": {"off": row}}}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_table_shows_comm_and_exposure_only_where_they_are_modelled(bench, device):
    import argparse

    args = argparse.Namespace(
        device=device, nproc=2, breakdown=False, shapes="small", overrides=[], steps=1
    )
    table = bench.report(args, load("tiny", bench.DEFAULT_SETS), _summary(bench))
    row = table.splitlines()[-1]
    if device == "cuda":
        assert "not measured over NCCL" in table and row.count("n/a") == 8, row
        assert "| 1.500 |" in row
    else:
        assert "n/a" not in table and "0.000 / 0.000" in row
