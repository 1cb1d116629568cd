"""Self-check calibration and the GPU benchmarks' timing: thresholds from measured figures x a
safety factor (file format, precedence, bad input), the command line on CPU (host checks), and the
time-based median measurement driven by a fake CUDA clock."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from megascale.agent.selfcheck import FAIL, PASS, SKIPPED, CheckResult
from megascale.agent.selfcheck import gpu as selfcheck_gpu
from megascale.agent.selfcheck import suite as selfcheck
from megascale.agent.selfcheck.calibration import (
    calibration_toml,
    measured_figures,
)
from megascale.agent.selfcheck.thresholds import GpuThresholds, load_thresholds

CHECKS = [
    CheckResult("gpu.matmul", PASS, 700.0, "TFLOP/s"),
    CheckResult("gpu.memory_bandwidth", FAIL, 2500.0, "GB/s"),  # a figure even when it failed
    CheckResult("net.loopback_tcp@127.0.0.1", PASS, 40.0, "Gbit/s"),
    CheckResult("net.loopback_tcp@10.0.0.5", PASS, 25.0, "Gbit/s"),  # the lowest address counts
    CheckResult("net.intranode_alltoall", SKIPPED),  # nothing measured: left out
    CheckResult("gpu.temperature", PASS, 40.0, "C"),  # not a throughput: never calibrated
]


def _write(tmp_path, figures, factor=0.5, extra=""):
    path = tmp_path / "calibration.toml"
    text = calibration_toml(
        figures, safety_factor=factor, node="n1", time="2026-01-01T00:00:00+00:00", profile="x"
    )
    path.write_text(text + extra)
    return path


def test_measured_figures_take_the_worst_instance_and_skip_the_unmeasured():
    assert measured_figures(CHECKS) == {
        "gpu.matmul": 700.0,
        "gpu.memory_bandwidth": 2500.0,
        "net.loopback_tcp": 25.0,
    }


def test_thresholds_are_measured_times_safety_factor(tmp_path):
    path = _write(tmp_path, measured_figures(CHECKS), factor=0.5)
    t = load_thresholds("H100 SXM", path)
    assert t.gpu.matmul_tflops == 350.0
    assert t.gpu.memory_bandwidth == 1250.0
    assert t.net.loopback_tcp == 12.5
    assert t.host == load_thresholds("H100 SXM").host  # not calibrated: the profile's


def test_explicit_sections_win_over_the_calibration_and_set_over_both(tmp_path):
    path = _write(tmp_path, {"gpu.matmul": 700.0}, extra="\n[gpu]\nmatmul_tflops = 600.0\n")
    assert load_thresholds("H100 SXM", path).gpu.matmul_tflops == 600.0
    t = load_thresholds("H100 SXM", path, ["gpu.matmul_tflops=100"])
    assert t.gpu.matmul_tflops == 100.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[calibration]\nsafety_factor = 1.5\n", r"calibration.safety_factor = 1.5: accepted"),
        (
            "[calibration]\nsafety_factor = 0\n",
            r"safety_factor = 0: accepted: a number in \(0, 1\]",
        ),
        ('[calibration.measured]\n"gpu.clocks" = 1.0\n', r"measured.gpu.clocks = 1.0: unknown"),
        ('[calibration.measured]\n"gpu.matmul" = -3\n', r"gpu.matmul = -3: accepted: a positive"),
        ('[calibration.measured]\n"gpu.matmul" = "fast"\n', r"gpu.matmul = 'fast'"),
    ],
)
def test_bad_calibration_names_field_value_and_accepted(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_thresholds("cpu", path)


def test_calibrated_matmul_threshold_replaces_the_fraction_of_peak():
    threshold, source = selfcheck_gpu._matmul_threshold(GpuThresholds(), "NVIDIA H100 80GB HBM3")
    assert math.isclose(threshold, 0.6 * 989) and "H100 SXM dense bf16 peak" in source
    threshold, source = selfcheck_gpu._matmul_threshold(
        GpuThresholds(matmul_tflops=640.0), "NVIDIA H100 80GB HBM3"
    )
    assert (threshold, source) == (640.0, "gpu.matmul_tflops")
    threshold, source = selfcheck_gpu._matmul_threshold(GpuThresholds(), "Mystery GPU")
    assert threshold is None and "set gpu.peak_tflops" in source


class _FakeClock:
    """A CUDA clock that advances only when the benchmarked step runs."""

    now = 0.0

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.t = None

        def record(self) -> None:
            self.t = _FakeClock.now

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end) -> float:
            return (end.t - self.t) * 1e3


def test_timed_rate_warms_up_then_takes_the_median_of_repeats_over_min_seconds(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeClock.Event)
    durations = iter([0.004] * 20 + [0.002] * 10_000)  # slow while warming up, then steady

    def step():
        _FakeClock.now += next(durations)

    rate = selfcheck_gpu.timed_rate(step, work=10.0, min_seconds=1.0)
    assert rate.repeats == selfcheck_gpu.REPEATS
    assert math.isclose(rate.value, 10.0 / 0.002)  # the warm-up's slow steps are not counted
    assert rate.seconds >= 1.0 and rate.spread < 1e-9
    assert "median of 5 repeats" in rate.describe()


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    selfcheck.add_arguments(parser)
    return selfcheck.run(parser.parse_args(list(argv)))


def test_calibrate_command_writes_a_file_that_sets_thresholds(tmp_path, capsys):
    out = tmp_path / "cal" / "node.toml"
    only = ["--only", "host.memory_bandwidth", "--only", "host.disk_write"]
    code = _cli("--calibrate", "--output", str(out), "--quick", "--dir", str(tmp_path), *only)
    assert code == 0, capsys.readouterr()
    assert f"calibration written to {out}" in capsys.readouterr().out
    text = out.read_text()
    assert '"host.disk_write" =' in text and "safety_factor = 0.8" in text
    t = load_thresholds("cpu", out)
    assert t.host.disk_write > 0 and t.host.disk_write != load_thresholds("cpu").host.disk_write
    assert t.gpu == load_thresholds("cpu").gpu


@pytest.mark.parametrize(
    "argv",
    [["--calibrate"], ["--output", "x.toml"], ["--safety-factor", "0.5"]],
)
def test_calibrate_arguments_go_together(argv, caplog):
    assert _cli(*argv, "--only", "none") == 2
    assert "--calibrate needs --output FILE" in caplog.text


def test_calibrate_refuses_a_bad_safety_factor(tmp_path, caplog):
    args = ["--calibrate", "--output", str(tmp_path / "x.toml"), "--safety-factor", "2"]
    assert _cli(*args, "--only", "host.disk_free", "--dir", str(tmp_path)) == 2
    assert "--safety-factor = 2.0: accepted" in caplog.text
