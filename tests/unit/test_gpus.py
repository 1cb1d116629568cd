"""GPU counting without CUDA initialisation (``megascale.gpus``), on a CPU machine: a
CUDA build of torch is simulated and every call that would initialise CUDA is a trap."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from megascale import gpus
from megascale.train.run import resolve_device


def _trap(*args, **kwargs):
    raise AssertionError("CUDA initialised (cudaGetDeviceCount / lazy init) in a pre-fork process")


@pytest.fixture
def cuda_build(monkeypatch):
    """torch looks CUDA-built; initialising CUDA raises. Returns a setter for NVML's count."""
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", _trap, raising=False)
    monkeypatch.setattr(torch.cuda, "_lazy_init", _trap)
    monkeypatch.setattr(torch.cuda, "init", _trap)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def set_nvml(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: count)

    set_nvml(0)
    return set_nvml


def test_resolve_device_counts_gpus_through_nvml_only(cuda_build):
    cuda_build(0)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="train.device='cuda'"):
        resolve_device("cuda")
    cuda_build(2)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cuda") == "cuda"
    assert not torch.cuda.is_initialized()


def test_nvidia_smi_fallback_honours_cuda_visible_devices(cuda_build, monkeypatch, tmp_path):
    cuda_build(-1)  # NVML cannot be loaded through torch
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(4))
    )
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert gpus.visible_gpu_count() == 4
    assert gpus.physical_gpu_count() == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert gpus.visible_gpu_count() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,7,3")  # CUDA stops at the first invalid entry
    assert gpus.visible_gpu_count() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus.visible_gpu_count() == 0
    assert gpus.physical_gpu_count() == 4


def test_no_gpu_without_a_cuda_build_or_a_driver(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: False)
    assert gpus.visible_gpu_count() == 0
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert gpus.physical_gpu_count() == 0


def test_prefer_nvml_checks_keeps_a_users_setting(monkeypatch):
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    gpus.prefer_nvml_checks()
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")
    gpus.prefer_nvml_checks()
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"


def test_is_available_through_nvml_does_not_initialise_cuda(cuda_build, monkeypatch):
    """What megatron-core / TE's import-time probes do once ``prefer_nvml_checks`` ran."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    cuda_build(8)
    assert torch.cuda.is_available()
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")
    with pytest.raises(AssertionError, match="CUDA initialised"):
        torch.cuda.is_available()  # the default check: cudaGetDeviceCount, fork poisoned


def test_check_fork_safe_warns_after_cuda_init(monkeypatch, caplog):
    assert gpus.check_fork_safe("2 rank(s)")  # nothing initialised here
    assert not caplog.records
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert not gpus.check_fork_safe("2 rank(s)")
    assert "CUDA was initialised" in caplog.text and "before forking 2 rank(s)" in caplog.text
