"""The tensors the overlap benchmark's cost calibration and the checkpoint benchmark all-reduce are
made on the device the group's backend takes (``groups.collective_device``): NCCL refuses host
tensors. No GPU here: ``collective_device`` is replaced by one answering ``meta``, and the
all-reduce records where its tensor is, then stops the caller."""

from __future__ import annotations

import pytest
import torch
from script_loader import load_script

from megascale.overlap import measure

checkpoint_bench = load_script("benchmarks/checkpoint.py", "checkpoint_bench")


class _Stop(Exception):
    pass


@pytest.fixture
def reduced(monkeypatch):
    """The devices of the tensors given to ``dist.all_reduce`` (which then stops the caller)."""
    devices: list[torch.device] = []

    def all_reduce(tensor, *args, **kwargs):
        devices.append(tensor.device)
        raise _Stop

    for module in (measure, checkpoint_bench):
        monkeypatch.setattr(module, "collective_device", lambda group=None: torch.device("meta"))
        monkeypatch.setattr(module.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(measure.dist, "barrier", lambda *args, **kwargs: None)
    monkeypatch.setattr(measure, "measure_gemm_flops", lambda: 1e9)
    return devices


def test_the_cost_calibration_reduces_on_the_groups_device(reduced):
    with pytest.raises(_Stop):
        measure.calibrated_cost("h100-nvlink4-8x400g", 0.5, 1.0)
    assert reduced == [torch.device("meta")]


def test_the_checkpoint_benchmark_reduces_on_the_groups_device(reduced):
    with pytest.raises(_Stop):
        checkpoint_bench._slowest(1.5)
    with pytest.raises(_Stop):
        checkpoint_bench._anyone(True)
    assert reduced == [torch.device("meta")] * 2


def test_the_overlap_benchmark_refuses_the_cpu_cost_model_on_gpus(monkeypatch):
    overlap_bench = load_script("benchmarks/overlap.py", "overlap_bench")

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks started")

    monkeypatch.setattr(overlap_bench, "run_local", no_ranks)
    with pytest.raises(SystemExit, match="--cost bytes with --device cuda.*use --cost fixed"):
        overlap_bench.main(["--device", "cuda", "--latency-ms", "0"])
