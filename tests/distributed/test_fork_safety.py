"""No process that forks CUDA workers initialises CUDA first: ``megascale train --nproc-per-node N``
(resolve the device, validate, fork the ranks) and the agent's zygote (preload, then fork).

The machine is what a machine without an NVIDIA driver really is: NVML cannot be loaded
(``torch.cuda._raw_device_count_nvml()`` is -1), so torch's ``device_count()`` would fall back to
``cudaGetDeviceCount``. With a CUDA build of torch (the one ``pip install torch`` gives) that path
is the real one; with the CPU build, the build is made to say it has CUDA and NVML to say -1. Every
call that initialises CUDA or marks the process as having asked (``cudaGetDeviceCount``, lazy init)
is a trap that raises; forked children inherit the traps.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from megascale import cli
from megascale.agent import workers
from megascale.agent.zygote import Zygote
from megascale.launcher import local
from megascale.train import run as train_run


def _trap(*args, **kwargs):
    raise AssertionError("CUDA initialised in a process that forks CUDA workers")


def _no_nvml() -> int:
    raise OSError("libnvidia-ml.so.1: cannot open shared object file: No such file or directory")


@pytest.fixture
def cuda_traps(monkeypatch):
    # The environment a user has; whatever megascale sets is undone afterwards.
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if not torch.cuda._is_compiled():  # the CPU build: make it look like the CUDA one
        monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
        monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", _no_nvml)  # what CDLL raises
    assert torch.cuda._device_count_nvml() == -1, "this test needs a machine without a driver"
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", _trap, raising=False)
    monkeypatch.setattr(torch.cuda, "_lazy_init", _trap)
    monkeypatch.setattr(torch.cuda, "init", _trap)


def _probe_cuda_like_an_import(run_local):
    """``run_local`` after asking ``torch.cuda.is_available()``, as the parent's
    ``import megatron.core`` does (through ``torch.utils.cpp_extension``) in a fresh process."""

    def probing(*args, **kwargs):
        assert torch.cuda.is_available() is False
        return run_local(*args, **kwargs)

    return probing


def _stub_rank(job, run_dir: Path) -> None:
    """In each forked rank: record that it started with CUDA untouched by its parent."""
    rank = int(os.environ["RANK"])
    (run_dir / f"rank{rank}.ok").write_text(str(torch.cuda.is_initialized()))


def test_train_parent_never_initialises_cuda_before_forking_ranks(
    cuda_traps, monkeypatch, tmp_path
):
    monkeypatch.setattr(train_run, "run_rank", _stub_rank)
    monkeypatch.setattr(local, "run_local", _probe_cuda_like_an_import(local.run_local))
    argv = ["train", "tiny", "--set", "train.device=auto", "--nproc-per-node", "2"]
    code = cli.main([*argv, "--run-dir", str(tmp_path)])
    assert code == 0
    assert not torch.cuda.is_initialized()
    assert [(tmp_path / f"rank{r}.ok").read_text() for r in range(2)] == ["False", "False"]


def test_zygote_preload_leaves_cuda_uninitialised(cuda_traps, monkeypatch, caplog):
    """A preloaded module that probes ``torch.cuda.is_available()`` at import (as megatron-core and
    TE do) goes through NVML in the zygote, so the zygote stays fork-safe."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    with caplog.at_level(logging.WARNING, logger=workers.__name__):
        zygote = Zygote(preload=("cuda_probe_at_import",))
        zygote.close()
        zygote._reader.join(10)
    assert not [r for r in caplog.records if "zygote" in r.getMessage()], caplog.text


def test_zygote_reports_a_preload_that_initialised_cuda(monkeypatch, caplog):
    """The warning the agent logs when a preloaded library did initialise CUDA anyway."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with caplog.at_level(logging.WARNING, logger=workers.__name__):
        zygote = Zygote(preload=())
        zygote.close()
        zygote._reader.join(10)
    assert "CUDA was initialised while preloading" in caplog.text
