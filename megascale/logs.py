"""Logging: rank-prefixed lines, and megatron-core's expected noise kept out of the user's way."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

from megascale import runfiles

# Warnings megatron-core and torch emit on every CPU run that say nothing actionable.
_EXPECTED_WARNINGS = (
    "Transformer Engine and Apex are not installed",  # CPU: TE/apex are GPU-only extras
    "Apex is not installed",
    # The distributed optimizer's fp32 shards are views of the parameters and its zero_grad probes
    # their .grad: torch warns on every step.
    "The .grad attribute of a Tensor that is not a leaf",
    ".*all_gather_into_tensor. is deprecated",  # megatron-core's calls, not ours
    ".*reduce_scatter_tensor. is deprecated",
)


def quiet_expected_noise() -> None:
    """Filter the warnings above and megatron-core's per-parameter INFO logging (warnings stay)."""
    for message in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("megatron").setLevel(logging.WARNING)


def setup_logging(rank: int, run_dir: Path) -> None:
    """Rank-prefixed lines to stderr (rank 0 at INFO, others WARNING) and to logs/rank_NNNNN.log."""
    log_dir = run_dir / "logs"
    runfiles.make_dir(log_dir)
    fmt = logging.Formatter(f"[rank {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.setFormatter(fmt)
    to_file = runfiles.LogFileHandler(log_dir / f"rank_{rank:05d}.log")
    to_file.setFormatter(fmt)
    root.addHandler(console)
    root.addHandler(to_file)
    quiet_expected_noise()
