"""Jobs and one-rank helpers shared by the GPU tests (not a test module)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness import with_changes

from megascale.config import JobConfig, load
from megascale.launcher.local import run_local


def small_job(device: str = "cuda", **sections: dict) -> JobConfig:
    """A small GPT that every layout up to 8 GPUs divides: 8 layers, 8 heads, 128-token samples,
    fp32 (tight comparisons) unless ``model.params_dtype`` says otherwise."""
    base = with_changes(
        load("tiny"),
        model={"num_layers": 8, "hidden_size": 128, "num_heads": 8, "seq_length": 128},
        train={"global_batch_size": 16, "micro_batch_size": 2, "device": device},
        optim={"warmup_steps": 0, "lr": 3e-3},
    )
    return with_changes(base, **sections)


def in_child(fn: Callable[..., Any], *args: Any, timeout_s: float = 900) -> Any:
    """``fn(*args)`` in one forked rank (CUDA is initialised there, never in pytest)."""
    return run_local(fn, 1, args, timeout_s=timeout_s)[0]
