"""Node self-check: is this machine fit to train? The tests MegaScale runs before a node (re)joins.

The parts: ``suite`` (the checks in order, ``run_selfcheck`` and ``megascale selfcheck``),
``names`` (the checks' names and selections), ``thresholds`` (every default and how it is
overridden), ``calibration`` (thresholds from a healthy node's figures), ``gpu`` (NVML facts and
the torch benchmarks) and ``net`` (loopback TCP, the intra-node all-to-all, the neighbour
all-reduce).
"""

from megascale.agent.selfcheck.suite import (
    FAIL,
    NO_CUDA,
    PASS,
    SKIPPED,
    CheckResult,
    SelfCheckOptions,
    SelfCheckReport,
    judged,
    run_selfcheck,
    selected_checks,
)

__all__ = [
    "FAIL",
    "NO_CUDA",
    "PASS",
    "SKIPPED",
    "CheckResult",
    "SelfCheckOptions",
    "SelfCheckReport",
    "judged",
    "run_selfcheck",
    "selected_checks",
]
