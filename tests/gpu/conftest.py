"""The GPU tier (marker ``gpu``): runs where CUDA exists, skipped with the reason everywhere else.

The pytest process itself never initialises CUDA. Every test does its GPU work in ranks forked by
``megascale.launcher.local.run_local`` (one per GPU, NCCL between them), and a child cannot use CUDA
that its parent initialised; GPUs are counted through NVML (``megascale.gpus``).
``scripts/gpu-check`` runs this tier and the GPU benchmarks in one command.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megascale.gpus import cuda_initialised, prefer_nvml_checks, visible_gpu_count

prefer_nvml_checks()  # before megatron-core / TE are imported (they probe CUDA at import)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))  # harness.py

GPUS = visible_gpu_count()


def pytest_collection_modifyitems(config, items):
    """Skip every ``gpu``-marked test without a visible CUDA device, and a test marked
    ``gpu(n)`` where fewer than ``n`` GPUs are visible. Refuse to run at all if importing the
    test modules (megatron-core, Transformer Engine) initialised CUDA in this process."""
    if cuda_initialised():
        raise pytest.UsageError(
            "CUDA was initialised in the pytest process while collecting tests/gpu: the forked "
            "ranks could not use it (see megascale.gpus)"
        )
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.args[0] if marker.args else 1
        if GPUS < needed:
            reason = "no CUDA device visible" if not GPUS else f"needs {needed} GPUs, {GPUS} here"
            item.add_marker(pytest.mark.skip(reason=f"{reason} (tests/gpu)"))


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """The built-in corpus's token file, built once (on the host) for every GPU test."""
    from megascale.data.corpus import default_token_file

    directory = tmp_path_factory.mktemp("data")
    default_token_file(directory)
    return directory
