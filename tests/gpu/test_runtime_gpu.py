"""A real training run on one GPU (``megascale.train.run.run_rank``): the CUDA-event timeline, the
two-stage checkpoint copied out of GPU memory while training goes on, the per-step peak memory,
the torch profiler window and the allocator's memory snapshot."""

from __future__ import annotations

import json
import math
import pickle
import shutil
from collections import defaultdict

import pytest
from gpu_jobs import in_child, small_job

from megascale.probes.progress import progress_path, read_progress
from megascale.train.checkpoint.storage import step_name
from megascale.train.run import run_rank

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """4 steps on one GPU, a two-stage checkpoint every 2 steps, the timeline on, steps 2 and 3
    profiled, the allocator's history recorded."""
    run_dir = tmp_path_factory.mktemp("run-a")
    job = small_job(
        train={"steps": 4, "profile_steps": [2, 3], "memory_history": True},
        checkpoint={"interval": 2, "async_save": True, "keep": 2},
        diagnostics={"timeline": True, "flush_interval_steps": 2},
    )
    history = in_child(run_rank, job, run_dir)
    return job, run_dir, history


def test_cuda_event_timeline_has_device_segments_within_each_step(run_a):
    _job, run_dir, history = run_a
    text = (run_dir / "timeline" / "rank_00000.jsonl").read_text()
    # step 0 holds what ran before the first step (setup collectives)
    steps = [x for x in map(json.loads, text.splitlines()) if x["type"] == "step" and x["step"]]
    assert [s["step"] for s in steps] == [m.step for m in history]
    for record in steps:
        durations = defaultdict(int)
        for name, _cat, _start, dur in record["spans"]:
            durations[name] += dur
        for name in ("megascale::model::forward", "megascale::model::backward"):
            assert durations[name] > 0, (record["step"], name, dict(durations))
        # The host's step span ends with float(loss), which waits for the GPU: the device's
        # forward and backward (CUDA events) fit inside it.
        device = durations["megascale::model::forward"] + durations["megascale::model::backward"]
        assert device <= durations["megascale::train::step"], dict(durations)


def test_every_step_reports_its_peak_cuda_memory(run_a):
    _job, run_dir, history = run_a
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [m.step for m in history]
    for line in lines:
        allocated, reserved = line["mem_max_allocated_gib"], line["mem_max_reserved_gib"]
        assert 0 < allocated <= reserved < 80, line


def test_the_profile_window_holds_its_steps_gpu_kernels(run_a):
    _job, run_dir, _history = run_a
    trace = json.loads((run_dir / "profile" / "rank_00000.json").read_text())
    events = trace["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("megascale::train::step#")}
    assert steps == {"megascale::train::step#2", "megascale::train::step#3"}, steps
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels, sorted({e.get("cat") for e in events})
    assert any("gemm" in e["name"].lower() or "cutlass" in e["name"].lower() for e in kernels)


def test_the_memory_snapshot_is_the_allocators(run_a):
    _job, run_dir, _history = run_a
    with open(run_dir / "profile" / "memory_rank_00000.pickle", "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"], snapshot.keys()
    assert any(trace for trace in snapshot["device_traces"]), "no allocator events recorded"


def test_progress_carries_a_steps_compute_time_from_cuda_events(run_a):
    """The straggler signal on a GPU: forward and backward compute of a finished step, read from
    CUDA events without a sync; it fits inside that step's host time."""
    _job, run_dir, history = run_a
    state = read_progress(progress_path(run_dir, 0))
    step_time = {m.step: m.step_time_s for m in history}
    assert state.stage == 0 and state.compute_step in step_time, state
    assert 0 < state.compute_time_s <= step_time[state.compute_step], state


def test_two_stage_checkpoint_from_gpu_memory_resumes_exactly(run_a, tmp_path):
    """The step-2 checkpoint was copied to host memory and written while steps 3-4 trained on the
    GPU; resuming from it must redo steps 3-4 with the same numbers."""
    job, run_dir, history = run_a
    copy = tmp_path / "run-b"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / step_name(4))
    resumed = in_child(run_rank, job, copy)
    assert [m.step for m in resumed] == [3, 4]
    for got, want in zip(resumed, history[2:], strict=True):
        assert math.isclose(got.loss, want.loss, rel_tol=1e-5), (got, want)
        assert math.isclose(got.grad_norm, want.grad_norm, rel_tol=1e-4), (got, want)


def _copy_behind_queued_work() -> tuple[bool, bool, bool]:
    import torch

    from megascale.train.checkpoint.storage import HostCopier

    n = 1 << 24  # 64 MB of fp32
    source = torch.arange(n, dtype=torch.float32, device="cuda")
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of work queued ahead on the compute stream
    host, copied = HostCopier().copy({"state": source})
    returned_early = not copied.query()  # the host did not wait for the copy
    torch.cuda.current_stream().wait_event(copied)  # what the next update does
    source.add_(1.0)
    copied.synchronize()
    expected = torch.arange(n, dtype=torch.float32)
    return returned_early, host["state"].is_pinned(), torch.equal(host["state"], expected)


def test_stage_one_copies_out_of_gpu_memory_without_stalling_and_before_the_next_update():
    """Stage 1 from a GPU: the copy runs on a stream of its own, after the work already queued on
    the compute stream (it sees the finished values), while the host goes on; an update that
    waits for its event cannot change what was copied."""
    returned_early, pinned, equal = in_child(_copy_behind_queued_work)
    assert returned_early and pinned and equal, (returned_early, pinned, equal)
