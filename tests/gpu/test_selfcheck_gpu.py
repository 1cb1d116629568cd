"""The node self-check on a real GPU: every GPU check runs (none skipped for want of CUDA), the
benchmarks report a figure, a threshold and how they were measured, and a calibration taken on
this node makes the next run pass its calibrated checks (the figures are stable enough)."""

from __future__ import annotations

import pytest
from gpu_jobs import in_child

from megascale.agent.selfcheck import (
    NO_CUDA,
    SKIPPED,
    CheckResult,
    SelfCheckOptions,
    run_selfcheck,
)
from megascale.agent.selfcheck.calibration import calibration_toml, measured_figures
from megascale.agent.selfcheck.thresholds import load_thresholds

pytestmark = pytest.mark.gpu


def _gpu_report(thresholds_file: str | None) -> dict:
    options = SelfCheckOptions(quick=True, only=["gpu.*"], thresholds_file=thresholds_file)
    return run_selfcheck(options).to_dict()


def _checks(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def test_selfcheck_measures_every_gpu_and_calibration_passes_the_next_run(tmp_path):
    report = in_child(_gpu_report, None)
    checks = _checks(report)
    assert not [c for c in checks.values() if c["detail"] == NO_CUDA], checks
    for name in ("gpu.matmul", "gpu.memory_bandwidth"):
        check = checks[name]
        assert check["status"] != SKIPPED, check
        assert check["value"] > 0 and check["threshold"] > 0, check
        assert "median of 5 repeats" in check["detail"], check
    figures = measured_figures([CheckResult(**c) for c in report["checks"]])
    assert set(figures) == {"gpu.matmul", "gpu.memory_bandwidth"}
    path = tmp_path / "calibration.toml"
    path.write_text(
        calibration_toml(
            figures, safety_factor=0.8, node="this", time=report["time"], profile=report["profile"]
        )
    )
    # The file keeps the figure to a few decimals, so the threshold read back is equal to it only
    # to that precision.
    calibrated = load_thresholds(report["profile"], path).gpu.matmul_tflops
    assert calibrated == pytest.approx(0.8 * figures["gpu.matmul"], rel=1e-4)
    again = _checks(in_child(_gpu_report, str(path)))
    for name in ("gpu.matmul", "gpu.memory_bandwidth"):
        assert again[name]["status"] == "pass", again[name]
        assert again[name]["threshold"] == pytest.approx(0.8 * figures[name], rel=1e-4)
