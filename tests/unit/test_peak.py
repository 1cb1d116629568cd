"""The peak MFU is measured against: override, GPU table, measured-and-cached CPU peak, and the
report reading the peak a run recorded."""

from __future__ import annotations

import json

import pytest

from megascale.config import ConfigError, load, validate
from megascale.probes import flops, peak
from megascale.tools import straggler


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_measured_cpu_peak_is_positive_and_cached_per_key(cache_home, monkeypatch):
    first = peak.run_peak("cpu", "fp32", None)
    assert first.source == "measured:cpu fp32" and first.tflops > 0
    stored = json.loads((cache_home / "megascale" / "cpu_peak.json").read_text())
    key = peak.cache_key("fp32", __import__("torch").get_num_threads())
    assert stored == {key: first.tflops}
    assert peak.cpu_model() in key and "torch " in key and "fp32" in key

    def no_benchmark(*args, **kwargs):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(peak, "measure_cpu_peak", no_benchmark)
    assert peak.run_peak("cpu", "fp32", None) == first  # the second start reads the cache


def test_a_corrupt_cache_is_measured_again_and_rewritten(cache_home):
    path = cache_home / "megascale" / "cpu_peak.json"
    path.parent.mkdir(parents=True)
    path.write_text("{torn")
    value = peak.cpu_peak("fp32", 1)
    assert value > 0 and json.loads(path.read_text()) == {peak.cache_key("fp32", 1): value}


def test_override_wins_on_every_device(cache_home):
    assert peak.run_peak("cpu", "fp32", 2.5) == peak.Peak(2.5, "train.peak_tflops")
    assert peak.run_peak("cuda", "bf16", 700.0) == peak.Peak(700.0, "train.peak_tflops")
    assert not (cache_home / "megascale").exists()  # nothing measured
    assert peak.Peak(2.5, "train.peak_tflops").label() == "2.5 TFLOP/s train.peak_tflops"


def test_benchmark_refuses_an_unknown_dtype():
    with pytest.raises(ValueError, match="dtype = 'int8'"):
        peak.measure_cpu_peak("int8")


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_config_refuses_a_non_positive_peak(value):
    cfg = load("tiny", [f"train.peak_tflops={value}"])
    with pytest.raises(ConfigError, match=r"train.peak_tflops = "):
        validate(cfg, 1, "gloo")
    assert validate(load("tiny", ["train.peak_tflops=1.5"]), 1, "gloo").train.peak_tflops == 1.5


def test_report_uses_the_cpu_peak_the_run_recorded(tmp_path):
    assert straggler.recorded_peak(tmp_path) is None
    lines = [
        {"step": 1, "mfu": None},
        {"step": 2, "mfu": 0.1, "mfu_peak_tflops": 0.2, "mfu_peak_source": "measured:cpu fp32"},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert straggler.recorded_peak(tmp_path) == (0.2, "measured:cpu fp32")
    value, name, note = straggler._peak("cpu", None, straggler.recorded_peak(tmp_path))
    assert (value, note) == (0.2, "") and "measured:cpu fp32 (recorded by the run)" in name
    assert straggler._peak("cpu", 3.0, (0.2, "x"))[0] == 3.0  # an explicit peak still wins
    assert straggler._peak("NVIDIA A100", None, (0.2, "x"))[0] == flops.PEAK_TFLOPS["A100"]


H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    ("dtype", "tf32", "expected"),
    [
        ("bf16", {}, peak.Peak(989.0, "gpu:H100 SXM dense bf16")),
        ("fp16", {}, peak.Peak(989.0, "gpu:H100 SXM dense fp16")),
        ("fp32", {}, peak.Peak(67.0, "gpu:H100 SXM dense fp32")),  # torch's default: no TF32
        ("fp32", {"tf32": True}, peak.Peak(494.7, "gpu:H100 SXM dense tf32")),
        ("fp32", {"tf32": False}, peak.Peak(67.0, "gpu:H100 SXM dense fp32")),
        ("bf16", {"tf32": True}, peak.Peak(989.0, "gpu:H100 SXM dense bf16")),  # no fp32 GEMMs
    ],
    ids=["bf16", "fp16", "fp32", "fp32-tf32", "fp32-no-tf32", "bf16-tf32"],
)
def test_a_gpu_run_is_measured_against_the_peak_of_its_dtype(monkeypatch, dtype, tf32, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: H100)
    assert peak.run_peak("cuda", dtype, None, **tf32) == expected


def test_an_fp32_run_on_a_gpu_without_an_fp32_figure_reports_no_peak(monkeypatch, caplog):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA L40S")
    assert peak.run_peak("cuda", "bf16", None) == peak.Peak(362.0, "gpu:L40S dense bf16")
    assert peak.run_peak("cuda", "fp32", None) is None
    assert "no dense fp32 peak known for 'NVIDIA L40S'" in caplog.text
    assert "train.peak_tflops" in caplog.text


def test_fp32_gemms_run_as_tf32_under_transformer_engine_or_when_torch_allows_it(monkeypatch):
    import torch

    from megascale.model import gpt
    from megascale.train.run import fp32_gemms_as_tf32

    local, te, auto = (load("tiny", [f"model.spec={spec}"]) for spec in ("local", "te", "auto"))
    assert not fp32_gemms_as_tf32(local, "cpu")
    assert not fp32_gemms_as_tf32(local, "cuda")  # torch's default: true fp32
    assert not fp32_gemms_as_tf32(te, "cuda")  # no TE here: the trainer refuses the job
    monkeypatch.setattr(gpt, "te_available", lambda: True)
    assert fp32_gemms_as_tf32(te, "cuda") and fp32_gemms_as_tf32(auto, "cuda")
    assert not fp32_gemms_as_tf32(auto, "cpu")
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # a property: monkeypatch cannot restore it
    try:
        assert fp32_gemms_as_tf32(local, "cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
