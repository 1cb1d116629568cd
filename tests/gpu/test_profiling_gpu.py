"""``train.nvtx`` and the memory snapshot on a real CUDA out-of-memory error, one GPU: the step,
its schedule and its optimizer step are NVTX ranges named as the timeline's spans, and a rank that
runs out of memory while recording the allocator's history dumps it before the error ends it."""

from __future__ import annotations

import pickle

import pytest
import torch
from gpu_jobs import in_child, small_job

from megascale.launcher.local import RankFailed
from megascale.probes.profiling import snapshot_path
from megascale.train.run import run_rank
from megascale.train.trainer import Trainer

pytestmark = pytest.mark.gpu

RANGES = ["megascale::train::step", "megascale::schedule::forward_backward"]


def test_nvtx_ranges_and_a_real_oom_dumps_the_memory_history(tmp_path, monkeypatch):
    pushed = tmp_path / "nvtx.txt"
    real_push, real_step = torch.cuda.nvtx.range_push, Trainer.step

    def push(name):  # the forked rank appends what it pushes
        with open(pushed, "a") as f:
            f.write(name + "\n")
        return real_push(name)

    def step(self):
        if self.step_num == 1:  # step 2 asks for a PiB: a real CUDA OOM
            torch.empty(2**50, dtype=torch.uint8, device="cuda")
        return real_step(self)

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", push)
    monkeypatch.setattr(Trainer, "step", step)
    job = small_job(train={"steps": 4, "log_interval": 100, "nvtx": True, "memory_history": True})
    run_dir = tmp_path / "run"
    with pytest.raises(RankFailed, match="OutOfMemoryError"):
        in_child(run_rank, job, run_dir)
    names = [n for n in pushed.read_text().splitlines() if n.startswith("megascale::")]
    assert names == [*RANGES, "megascale::optim::step", "megascale::train::step"], names
    with open(snapshot_path(run_dir, 0, oom=True), "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"] and any(snapshot["device_traces"]), snapshot.keys()
    assert not snapshot_path(run_dir, 0).exists()  # dumped once, at the OOM
