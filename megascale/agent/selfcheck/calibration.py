"""Self-check calibration: thresholds from figures measured on a healthy node, not data sheets.

A failed self-check evicts a node, so its throughput thresholds must sit safely below what a
healthy node of the same kind measures, and above what a broken one does. ``megascale selfcheck
--calibrate --output FILE`` runs the measuring checks on a node known to be good and writes their
figures; ``--thresholds FILE`` (or ``diagnostics.selfcheck_thresholds`` in a job config, for the
self-check the agents run) then holds every later run to ``measured x safety_factor``::

    [calibration]
    safety_factor = 0.8
    node = "gpu-node-17"
    time = "2026-11-25T08:00:00+00:00"
    profile = "H100 SXM"

    [calibration.measured]
    "gpu.matmul" = 702.4            # TFLOP/s, worst GPU -> gpu.matmul_tflops
    "gpu.memory_bandwidth" = 2710.0 # GB/s, worst GPU
    "host.disk_write" = 1830.0      # MB/s

Only checks where higher is better are calibrated (``CALIBRATED``); NVML facts (ECC, clocks,
links) keep their rules. Explicit ``[gpu]``/``[host]``/``[net]`` sections in the same file win over
the calibration, and ``--set`` wins over both.
"""

from __future__ import annotations

import json
import math
from typing import Any

DEFAULT_SAFETY_FACTOR = 0.8
"""Thresholds at 80% of the calibrated figure: the GPU checks' repeat-to-repeat spread is a few
percent once they run >= 1 s (``selfcheck.gpu``), host and network figures vary more."""

CALIBRATED: dict[str, tuple[str, str, str]] = {
    # check name: (threshold section, threshold key, unit)
    "gpu.matmul": ("gpu", "matmul_tflops", "TFLOP/s"),
    "gpu.memory_bandwidth": ("gpu", "memory_bandwidth", "GB/s"),
    "host.memory_bandwidth": ("host", "memory_bandwidth", "GB/s"),
    "host.disk_write": ("host", "disk_write", "MB/s"),
    "net.loopback_tcp": ("net", "loopback_tcp", "Gbit/s"),
    "net.intranode_alltoall": ("net", "intranode_alltoall", "GB/s"),
}
"""The checks a calibration measures, and the threshold each one sets."""


def measured_figures(checks: list[Any]) -> dict[str, float]:
    """``{check name: figure}`` of the calibrated checks in a report's ``checks`` (``CheckResult``s):
    the lowest over a check's instances (``net.loopback_tcp@<address>``); checks that were skipped
    or could not measure are left out."""
    figures: dict[str, float] = {}
    for c in checks:
        name = c.name.split("@")[0]
        if name not in CALIBRATED or not isinstance(c.value, int | float) or c.value <= 0:
            continue
        figures[name] = min(float(c.value), figures.get(name, math.inf))
    return figures


def calibration_toml(
    figures: dict[str, float],
    *,
    safety_factor: float,
    node: str,
    time: str,
    profile: str,
    command: str = "",
) -> str:
    """The calibration file for ``figures`` (from ``measured_figures``)."""
    check_factor(safety_factor, "--safety-factor")
    lines = [
        "# Self-check calibration, measured on a healthy node by `megascale selfcheck --calibrate`.",
        "# Each threshold below is measured x safety_factor. Use: megascale selfcheck --thresholds",
        "# THIS, or diagnostics.selfcheck_thresholds = THIS in the job config (agents' self-check).",
        *([f"# command: {command}"] if command else []),
        "",
        "[calibration]",
        f"safety_factor = {safety_factor!r}",
        f"node = {json.dumps(node)}",
        f"time = {json.dumps(time)}",
        f"profile = {json.dumps(profile)}",
        "",
        "[calibration.measured]",
    ]
    for name, value in sorted(figures.items()):
        section, key, unit = CALIBRATED[name]
        threshold = value * safety_factor
        lines.append(
            f'"{name}" = {value:.6g}  # {unit}; threshold {section}.{key} >= {threshold:.4g}'
        )
    return "\n".join(lines) + "\n"


def check_factor(value: Any, where: str) -> float:
    """``value`` as a safety factor in (0, 1], or ValueError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"{where} = {value!r}: accepted: a number in (0, 1], e.g. 0.8")
    return float(value)


def calibrated_updates(calibration: Any, origin: str) -> dict[str, dict[str, float]]:
    """Threshold updates ``{section: {key: measured x safety_factor}}`` from a file's
    ``[calibration]`` table; ValueError naming the bad field and what is accepted."""
    if not isinstance(calibration, dict):
        raise ValueError(f"{origin}: [calibration] must be a table")
    factor = check_factor(
        calibration.get("safety_factor", DEFAULT_SAFETY_FACTOR),
        f"{origin}: calibration.safety_factor",
    )
    measured = calibration.get("measured", {})
    if not isinstance(measured, dict):
        raise ValueError(f"{origin}: calibration.measured must be a table of check = figure")
    updates: dict[str, dict[str, float]] = {}
    for name, value in measured.items():
        if name not in CALIBRATED:
            raise ValueError(
                f"{origin}: calibration.measured.{name} = {value!r}: unknown check; accepted: "
                + ", ".join(CALIBRATED)
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(
                f"{origin}: calibration.measured.{name} = {value!r}: accepted: a positive number"
            )
        section, key, _unit = CALIBRATED[name]
        updates.setdefault(section, {})[key] = float(value) * factor
    return updates
