"""Overlap in DP, PP and TP: same numbers as without it, and the communication really is issued
early (observed from a ``CommTrace`` of every collective plus marks at step boundaries)."""

from __future__ import annotations

import functools
import math

import pytest
from harness import with_changes

from megascale.config import load, validate
from megascale.launcher.local import run_local
from megascale.overlap.measure import measure_rank, with_overlap

pytestmark = pytest.mark.slow

ALL_OFF = {"dp": False, "pp": False, "tp": False}
VARIANTS = {
    "off": ALL_OFF,
    "dp": {**ALL_OFF, "dp": True},
    "pp": {**ALL_OFF, "pp": True},
    "tp": {**ALL_OFF, "tp": True},
    "on": {"dp": True, "pp": True, "tp": True},
}
LAYOUTS = {
    # 8 ranks: TP2 x PP2 x DP2 + SP, interleaved (VPP2) so that the PP overlap applies.
    "tp2-pp2-dp2-sp-vpp2": (
        8,
        {"tp": 2, "pp": 2, "vpp": 2, "sequence_parallel": True, "batch_p2p_comm": False},
    ),
    "pp4-vpp2": (4, {"pp": 4, "vpp": 2, "batch_p2p_comm": False}),
    # Plain 1F1B (vpp 1): megascale.overlap.pp's decoupled, posted-ahead p2p.
    "pp2": (2, {"pp": 2}),
}


def _job(parallel: dict, parallel_block: bool = False):
    return with_changes(
        load("tiny"),
        parallel=parallel,
        model={
            "num_layers": 8,
            "hidden_size": 32,
            "num_heads": 4,
            "seq_length": 32,
            "parallel_block": parallel_block,
        },
        train={"global_batch_size": 8, "micro_batch_size": 1},
        optim={"warmup_steps": 0, "lr": 3e-3},
        # Small buckets: several per chunk, so bucket-by-bucket overlap is exercised.
        overlap={"bucket_size": 2000, "tp_chunks": 4},
    )


def _measure(world, parallel, variants, *, steps, keep_events=False, parallel_block=False):
    jobs = {
        n: validate(with_overlap(_job(parallel, parallel_block), **v), world, "gloo")
        for n, v in variants.items()
    }
    fn = functools.partial(
        measure_rank, steps=steps, warmup=0, rounds=1, latency_s=0.0, keep_events=keep_events
    )
    return fn, jobs


@pytest.mark.parametrize("block", ["serial", "parallel"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_overlap_keeps_loss_and_grad_norm(layout, block, data_dir):
    world, parallel = LAYOUTS[layout]
    fn, jobs = _measure(world, parallel, VARIANTS, steps=3, parallel_block=block == "parallel")
    _assert_same_as_off(run_local(fn, world, (jobs, data_dir), timeout_s=600)[0], layout)


def _assert_same_as_off(results: dict, layout: str) -> None:
    off = results["off"]
    for name, rows in results.items():
        for step, (got, want) in enumerate(zip(rows, off, strict=True), 1):
            for key in ("loss", "grad_norm"):
                assert math.isclose(got[key], want[key], rel_tol=1e-6), (
                    f"{layout}: overlap {name} step {step} {key} {got[key]} != off {want[key]}"
                )
    assert off[0]["loss"] != off[-1]["loss"]  # it trained


@pytest.mark.parametrize("block", ["serial", "parallel"])
def test_tp_overlap_keeps_the_numbers_with_the_output_layer_tied_on_the_same_rank(block, data_dir):
    """PP1: the output layer multiplies by the embedding's own weight (passed in at forward), and
    its sequence gather is chunked too; the tied weight's two gradients still add up."""
    parallel = {"tp": 2, "sequence_parallel": True}
    variants = {"off": VARIANTS["off"], "tp": VARIANTS["tp"]}
    fn, jobs = _measure(2, parallel, variants, steps=3, parallel_block=block == "parallel")
    _assert_same_as_off(run_local(fn, 2, (jobs, data_dir), timeout_s=600)[0], f"tp2-sp {block}")


def _traced(layout, data_dir):
    """Two steps of ``layout`` with all overlap off and all on, with every comm event per rank."""
    world, parallel = LAYOUTS[layout]
    variants = {"off": VARIANTS["off"], "on": VARIANTS["on"]}
    fn, jobs = _measure(world, parallel, variants, steps=2, keep_events=True)
    return run_local(fn, world, (jobs, data_dir), timeout_s=600)


@pytest.fixture(scope="module")
def traced(data_dir):
    """The 8-rank layout (TP, interleaved PP, DP), traced."""
    return _traced("tp2-pp2-dp2-sp-vpp2", data_dir)


def _mark(row, name):
    return next(m["time"] for m in row["marks"] if m["name"] == name)


def _dp_ops(row, kinds):
    # Bucket collectives run inside megatron-core's coalescing manager; TP/SP ones do not.
    return [e for e in row["events"] if e["coalesced"] and e["kind"] in kinds]


REDUCE_SCATTER = ("reduce_scatter_tensor", "_reduce_scatter_base")
ALL_GATHER = ("all_gather_into_tensor", "_all_gather_base")


def test_bucket_reduce_scatter_is_issued_before_backward_ends(traced):
    for rank, result in enumerate(traced):
        on, off = result["on"][1], result["off"][1]
        done_on, done_off = _mark(on, "backward_done"), _mark(off, "backward_done")
        early = [e for e in _dp_ops(on, REDUCE_SCATTER) if e["issued"] < done_on]
        assert len(early) >= 2, f"rank {rank}: no bucket reduce-scatter during backward"
        # Without overlap every bucket is reduced after backward, in finalize_model_grads.
        assert _dp_ops(off, REDUCE_SCATTER)
        assert all(e["issued"] > done_off for e in _dp_ops(off, REDUCE_SCATTER)), rank


def test_first_param_all_gather_is_issued_before_data_loading_and_first_forward(traced):
    for rank, result in enumerate(traced):
        on = result["on"][1]  # step 2: parameters changed in step 1, so the gather matters
        gathers = _dp_ops(on, ALL_GATHER)
        assert gathers, f"rank {rank}: no param all-gather in step 2"
        first = min(e["issued"] for e in gathers)
        assert first < _mark(on, "data_loaded") < _mark(on, "forward_start"), rank
        # Interleaved: every chunk's gathers are dispatched before the first forward (the
        # schedule's param_sync_func), not by the chunk's own first forward pre-hook.
        assert max(e["issued"] for e in gathers) < _mark(on, "forward_start"), rank
        # Without overlap the gather happened inside the previous optimizer step instead.
        off = result["off"][1]
        assert not [
            e for e in _dp_ops(off, ALL_GATHER) if e["issued"] < _mark(off, "forward_start")
        ]


def test_tp_chunk_communication_is_interleaved_one_chunk_ahead_of_the_gemms(traced):
    for rank, result in enumerate(traced):
        row = result["on"][0]
        marks = {m["name"]: m["time"] for m in reversed(row["marks"])}  # first occurrence
        direct = [e for e in row["events"] if not e["coalesced"]]
        # The first chunked column-parallel linear (QKV): one chunk's all-gather in flight ahead
        # of the GEMMs. Chunks 0 and 1 are issued before GEMM 0; chunk j+1 after GEMM j-1 and
        # before GEMM j; none during a GEMM. (All k at once would queue GEMM 0 behind every
        # gather on a GPU's single hardware queue.)
        gathers = [e["issued"] for e in direct if e["kind"] in ALL_GATHER]

        def issued(start, end, gathers=gathers):
            return sum(start < t < end for t in gathers)

        k = 4
        starts = [marks[f"tp.ag.gemm_start.{j}"] for j in range(k)]
        dones = [marks[f"tp.ag.gemm_done.{j}"] for j in range(k)]
        assert issued(marks["tp.ag.start"], starts[0]) == 2, rank
        # The rows this rank holds need no gather: their GEMM runs first, beside chunk 0's gather
        # only (issued before it; chunk 1's after it).
        local_start, local_done = marks["tp.ag.local_gemm_start"], marks["tp.ag.local_gemm_done"]
        assert issued(marks["tp.ag.start"], local_start) == 1, rank
        assert issued(local_start, local_done) == 0, rank
        assert issued(local_done, starts[0]) == 1, rank
        for j in range(1, k):
            assert issued(dones[j - 1], starts[j]) == (1 if j + 1 < k else 0), (rank, j)
        assert not any(issued(starts[j], dones[j]) for j in range(k)), rank
        # The first row-parallel one (the output projection): chunk j's reduce-scatter is issued
        # after its GEMM and before chunk j+1's GEMM ends.
        for j in range(3):
            start, end = marks[f"tp.rs.gemm_done.{j}"], marks[f"tp.rs.gemm_done.{j + 1}"]
            assert any(e["kind"] in REDUCE_SCATTER and start < e["issued"] < end for e in direct), (
                rank,
                j,
            )
        # This rank's own rows: their GEMM after every chunk's reduce-scatter is issued, beside
        # the last.
        scatters = [e["issued"] for e in direct if e["kind"] in REDUCE_SCATTER]
        own = marks["tp.rs.local_gemm_start"]
        assert sum(marks["tp.rs.gemm_done.0"] < t < own for t in scatters) == k, rank
        assert not [m for m in result["off"][0]["marks"] if m["name"].startswith("tp.")]


@pytest.fixture(scope="module")
def traced_pp(data_dir):
    """Plain 1F1B over two stages (8 micro-batches), traced."""
    return _traced("pp2", data_dir)


def _p2p(row, kind):
    return [e for e in row["events"] if e["kind"] == kind]


def _posted_ahead(row, stage):
    """Whether each receive after the first was posted before the compute step before its use:
    stage 1 (activations in) before micro-batch k-1's forward; stage 0 (gradients in, one warm-up
    micro-batch) before micro-batch k+1's forward."""
    forwards = [m["time"] for m in row["marks"] if m["name"] == "microbatch_forward"]
    receives = sorted(e["issued"] for e in _p2p(row, "irecv"))
    assert len(receives) == len(forwards) == 8, (len(receives), len(forwards))
    before = [k - 1 if stage == 1 else k + 1 for k in range(1, 8)]
    return [receives[k] < forwards[b] for k, b in zip(range(1, 8), before, strict=True) if b < 8]


def test_pp_plain_1f1b_receives_are_posted_ahead_and_sends_are_not_waited(traced_pp):
    for stage, result in enumerate(traced_pp):
        on, off = result["on"][1], result["off"][1]
        assert all(_posted_ahead(on, stage)), (stage, _posted_ahead(on, stage))
        # Without overlap megatron-core receives each tensor only when it needs it.
        assert not any(_posted_ahead(off, stage)), (stage, _posted_ahead(off, stage))
        # Decoupled: no send is waited for until every receive of the step has been posted, so a
        # stage never waits for its own send to be taken before receiving or computing.
        sends, last_recv = _p2p(on, "isend"), max(e["issued"] for e in _p2p(on, "irecv"))
        assert len(sends) == 8 and all(e["wait_start"] > last_recv for e in sends), stage
        assert all(not e["coalesced"] for e in sends + _p2p(on, "irecv")), stage
        # Every send paired with its receive (same peers, order and bytes) on every rank.
        for row in (on, off):
            assert {e["peer"] for e in sends + _p2p(row, "irecv")} == {1 - stage}
            assert row["by_link"]["pp"]["exposed_paired_s"] == 0.0  # no modelled cost here


def test_nccl_like_mode_prices_calls_on_its_threads_and_keeps_the_numbers(data_dir):
    """With ``parallel.async_collectives`` the cost model's delays run on that mode's threads:
    calls are priced per link, the delays are waited out there (megatron-core's synchronous TP
    collectives expose them), and overlap on vs off keeps loss and grad norm (parallel block)."""
    world, parallel = LAYOUTS["tp2-pp2-dp2-sp-vpp2"]
    variants = {"off": VARIANTS["off"], "on": VARIANTS["on"]}
    job = _job({**parallel, "async_collectives": True}, parallel_block=True)
    jobs = {n: validate(with_overlap(job, **v), world, "gloo") for n, v in variants.items()}
    fn = functools.partial(measure_rank, steps=2, warmup=0, rounds=1, latency_s=0.002)
    results = run_local(fn, world, (jobs, data_dir), timeout_s=600)
    for rank, result in enumerate(results):
        for got, want in zip(result["on"], result["off"], strict=True):
            for key in ("loss", "grad_norm"):
                assert math.isclose(got[key], want[key], rel_tol=1e-6), (rank, key)
        for name, rows in result.items():
            for link in ("tp", "pp", "dp"):
                assert all(row["by_link"][link]["comm_s"] > 0 for row in rows), (rank, name, link)
        assert sum(row["by_link"]["tp"]["exposed_s"] for row in result["off"]) > 0, rank
