"""The names of the node self-check's checks, in the order they run, and how a selection
(``fault_tolerance.selfcheck_tests``, ``megascale selfcheck --only``) picks among them. Pure: the
configuration's validation reads it without importing the checks themselves."""

from __future__ import annotations

import fnmatch

GPU_NVML_CHECKS = (
    "gpu.count",
    "gpu.model",
    "gpu.ecc_errors",
    "gpu.retired_pages",
    "gpu.temperature",
    "gpu.clocks",
    "gpu.pcie_width",
    "gpu.pcie_gen",
    "gpu.nvlink",
)
GPU_BENCH_CHECKS = ("gpu.matmul", "gpu.memory_bandwidth")
CHECK_NAMES: tuple[tuple[str, ...], ...] = (
    GPU_NVML_CHECKS,
    GPU_BENCH_CHECKS,
    ("host.memory_bandwidth",),
    ("host.disk_write",),
    ("host.disk_free",),
    ("net.loopback_tcp",),
    ("net.intranode_alltoall",),
    ("net.neighbour_allreduce",),
)
"""The names each check function reports, in the order the checks run (``selfcheck.CHECKS``)."""

CHECK_GROUPS = {"gpu": "gpu.*", "host": "host.*", "net": "net.*", "network": "net.*"}
"""Group names accepted wherever checks are selected (``fault_tolerance.selfcheck_tests``)."""


def check_patterns(tests: list[str]) -> list[str]:
    """Shell patterns over check names for ``tests``: a group (``CHECK_GROUPS``) becomes all of
    its checks; a name or pattern is kept."""
    return [CHECK_GROUPS.get(t, t) for t in tests]


def selected_checks(tests: list[str]) -> list[str]:
    """The names of the checks ``tests`` selects (``check_patterns``), in order; empty: all."""
    patterns = check_patterns(tests)
    return [n for names in CHECK_NAMES for n in names if selected((n,), patterns)]


def selected(names: tuple[str, ...], patterns: list[str]) -> bool:
    """Whether a check reporting ``names`` runs under ``patterns`` (empty: every check)."""
    return not patterns or any(fnmatch.fnmatch(n, p) for n in names for p in patterns)
