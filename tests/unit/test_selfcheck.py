"""Self-check: thresholds (profiles, file, --set), the GPU rules on made-up NVML facts, the report,
and the host checks measured in-process. The network checks and the command line: distributed tier.
"""

from __future__ import annotations

import json

import pytest

from megascale.agent.selfcheck import (
    FAIL,
    NO_CUDA,
    PASS,
    SKIPPED,
    CheckResult,
    SelfCheckOptions,
    SelfCheckReport,
    judged,
    run_selfcheck,
)
from megascale.agent.selfcheck.gpu import GpuFacts, judge_facts
from megascale.agent.selfcheck.thresholds import (
    PROFILES,
    GpuThresholds,
    load_thresholds,
    parse_set,
    profile_for_gpu,
)
from megascale.config import PRESETS_DIR

# -- thresholds -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "profile"),
    [
        (None, "cpu"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("Tesla V100-SXM2-32GB", "gpu"),
        ("NVIDIA H100 NVL", "gpu"),
    ],
)
def test_profile_for_gpu(name, profile):
    assert profile_for_gpu(name) == profile
    assert profile in PROFILES


def test_profiles_differ_where_hardware_does():
    h100, h200, a100 = PROFILES["H100 SXM"].gpu, PROFILES["H200"].gpu, PROFILES["A100"].gpu
    assert h200.memory_bandwidth > h100.memory_bandwidth > a100.memory_bandwidth
    assert (h100.nvlink, a100.nvlink) == (18, 12)
    assert (h100.pcie_gen, a100.pcie_gen) == (5, 4)
    assert PROFILES["cpu"].host.disk_write < PROFILES["H100 SXM"].host.disk_write


def test_precedence_set_over_file_over_profile(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('[host]\ndisk_write = 500\ndisk_free = 7\n[gpu]\ncount = 8\nmodel = "H100"\n')
    t = load_thresholds("H100 SXM", path, ["host.disk_write=900", "gpu.count=none"])
    assert t.profile == "H100 SXM"
    assert t.host.disk_write == 900.0  # --set wins over the file
    assert t.host.disk_free == 7.0  # the file wins over the profile (100)
    assert t.host.memory_bandwidth == PROFILES["H100 SXM"].host.memory_bandwidth
    assert t.gpu.count is None and t.gpu.model == "H100"
    assert t.for_check("net.loopback_tcp@10.0.0.1") == t.net.loopback_tcp
    assert t.for_check("gpu.count") is None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("host.disk_speed=1", "unknown selfcheck threshold host.disk_speed"),
        ("hots.disk_write=1", "unknown selfcheck threshold section 'hots'"),
        ("host.disk_write=fast", "host.disk_write = 'fast': accepted: float"),
        ("gpu.count=2.5", "gpu.count = '2.5': accepted: int or none"),
        ("disk_write=1", "expected SECTION.KEY=VALUE"),
    ],
)
def test_bad_overrides_name_field_value_and_accepted(override, message):
    with pytest.raises(ValueError, match="accepted|expected") as err:
        load_thresholds("cpu", None, [override])
    assert message in str(err.value)


def test_shipped_example_file_loads():
    path = PRESETS_DIR / "selfcheck" / "h100-8gpu.toml"
    t = load_thresholds("H100 SXM", path)
    assert (t.gpu.count, t.gpu.model, t.net.intranode_alltoall) == (8, "H100", 150.0)


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(ValueError, match="accepted: cpu, gpu, H100 SXM"):
        load_thresholds("B300")


def test_parse_set_groups_by_section():
    assert parse_set(["net.loopback_tcp=5", "net.intranode_alltoall=1", "gpu.model=H200"]) == {
        "net": {"loopback_tcp": "5", "intranode_alltoall": "1"},
        "gpu": {"model": "H200"},
    }


# -- GPU rules on NVML facts ----------------------------------------------------------------------


def _h100(index: int, **changes) -> GpuFacts:
    base = dict(
        index=index,
        name="NVIDIA H100 80GB HBM3",
        ecc_uncorrected=0,
        bad_memory=0,
        temperature_c=41.0,
        sm_clock_max_mhz=1980.0,
        pcie_width=16,
        pcie_gen_max=5,
        nvlink_active=18,
    )
    return GpuFacts(**{**base, **changes})


def _by_name(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {r.name: r for r in results}


def test_healthy_h100_node_passes_every_nvml_check():
    t = load_thresholds("H100 SXM", None, ["gpu.count=8", "gpu.model=H100"]).gpu
    results = _by_name(judge_facts([_h100(i) for i in range(8)], t))
    assert {r.status for r in results.values()} == {PASS}, results
    assert results["gpu.count"].value == 8 and results["gpu.count"].op == "=="
    assert results["gpu.temperature"].value == 41.0 and results["gpu.temperature"].op == "<="


def test_each_broken_gpu_is_named():
    t = PROFILES["H100 SXM"].gpu
    facts = [_h100(i) for i in range(8)]
    facts[3] = _h100(3, ecc_uncorrected=2, temperature_c=91.0)
    facts[5] = _h100(5, bad_memory=1, pcie_width=8, nvlink_active=12)
    facts[6] = _h100(6, slowdown=("hw_thermal",))
    r = _by_name(judge_facts(facts, t))
    assert r["gpu.ecc_errors"].status == FAIL and "GPUs [3]" in r["gpu.ecc_errors"].detail
    assert r["gpu.temperature"].status == FAIL and r["gpu.temperature"].value == 91.0
    assert r["gpu.retired_pages"].status == FAIL and "GPUs [5]" in r["gpu.retired_pages"].detail
    assert r["gpu.pcie_width"].status == FAIL and r["gpu.pcie_width"].value == 8
    assert r["gpu.nvlink"].status == FAIL and r["gpu.nvlink"].value == 12
    assert r["gpu.clocks"].status == FAIL and "GPU 6: hw_thermal" in r["gpu.clocks"].detail
    assert r["gpu.pcie_gen"].status == PASS


def test_count_model_and_unsupported_queries():
    t = GpuThresholds(count=8, model="H200")
    facts = [_h100(0, ecc_uncorrected=None, bad_memory=None), _h100(1, ecc_uncorrected=None)]
    r = _by_name(judge_facts(facts, t))
    assert r["gpu.count"].status == FAIL and "is not == 8" in r["gpu.count"].detail
    assert r["gpu.model"].status == FAIL and "GPUs [0, 1] are not H200" in r["gpu.model"].detail
    assert r["gpu.ecc_errors"].status == SKIPPED
    assert "not supported" in r["gpu.ecc_errors"].detail
    assert r["gpu.retired_pages"].status == PASS  # one GPU answered


def test_single_gpu_skips_nvlink_and_mixed_models_fail():
    r = _by_name(judge_facts([_h100(0)], GpuThresholds(nvlink=18)))
    assert r["gpu.nvlink"].status == SKIPPED and "one GPU" in r["gpu.nvlink"].detail
    mixed = [_h100(0), _h100(1, name="NVIDIA A100-SXM4-80GB")]
    assert _by_name(judge_facts(mixed, GpuThresholds()))["gpu.model"].status == FAIL


# -- report ---------------------------------------------------------------------------------------


def test_judged_and_report_formats():
    ok = judged("host.disk_free", 50.0, "GB", ">=", 1.0, "/ckpt")
    bad = judged("host.disk_write", 12.5, "MB/s", ">=", 20.0, "/ckpt")
    assert (ok.status, bad.status) == (PASS, FAIL)
    assert bad.detail.startswith("12.5 MB/s is not >= 20")
    report = SelfCheckReport("node-7", "2026-01-01T00:00:00+00:00", "cpu", [ok, bad])
    assert not report.ok and report.failed == ["host.disk_write"]
    d = json.loads(json.dumps(report.to_dict()))
    assert d["node"] == "node-7" and d["failed"] == ["host.disk_write"]
    assert d["checks"][1] == {
        "name": "host.disk_write",
        "status": "fail",
        "value": 12.5,
        "unit": "MB/s",
        "threshold": 20.0,
        "op": ">=",
        "detail": bad.detail,
        "duration_s": 0.0,
    }
    table = report.table()
    assert "host.disk_write" in table and "FAIL" in table and ">= 20 MB/s" in table
    assert table.splitlines()[-1] == "result: FAIL (1: host.disk_write)"
    assert "host.disk_write: 12.5 MB/s" in report.summary()


# -- host checks, measured ------------------------------------------------------------------------


def test_cpu_run_measures_host_and_skips_gpu(tmp_path):
    # a low disk threshold: this tests the measurement, not the CI machine's disk (a stall there
    # can drop 16 MiB + fsync below the profile's 20 MB/s)
    report = run_selfcheck(
        SelfCheckOptions(
            quick=True,
            directory=str(tmp_path / "not" / "yet"),
            only=["gpu.*", "host.*"],
            overrides=["host.disk_write=1"],
        )
    )
    checks = _by_name(report.checks)
    assert report.profile == "cpu" and report.ok, report.table()
    gpu = [c for c in report.checks if c.name.startswith("gpu.")]
    assert len(gpu) == 11 and all(c.status == SKIPPED and c.detail == NO_CUDA for c in gpu)
    for name, unit in [
        ("host.memory_bandwidth", "GB/s"),
        ("host.disk_write", "MB/s"),
        ("host.disk_free", "GB"),
    ]:
        assert checks[name].status == PASS and checks[name].unit == unit
        assert checks[name].value > 0 and checks[name].duration_s >= 0
    assert checks["host.disk_write"].threshold == 1.0  # the override was what it was held to
    assert str(tmp_path) in checks["host.disk_write"].detail  # nearest existing parent
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone


def test_impossible_threshold_fails_that_check_only(tmp_path):
    report = run_selfcheck(
        SelfCheckOptions(
            quick=True,
            directory=str(tmp_path),
            only=["host.*"],
            # the disk at a low threshold, so that only the impossible one can fail
            overrides=["host.memory_bandwidth=1e9", "host.disk_write=1"],
        )
    )
    assert report.failed == ["host.memory_bandwidth"]
    failed = _by_name(report.checks)["host.memory_bandwidth"]
    assert failed.threshold == 1e9 and "is not >= 1e+09" in failed.detail


# -- read_nvml against a stand-in NVML (no GPU here) ----------------------------------------------


class _NotSupported(Exception):
    pass


class _FakeNvml:
    """The subset of ``pynvml`` that ``read_nvml`` calls: two H100s, GPU 1 with a pending row
    remap and a thermal slowdown, 18 NVLinks each, retired-page queries unsupported (Hopper)."""

    NVMLError = _NotSupported
    NVML_FEATURE_ENABLED = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_NVLINK_MAX_LINKS = 36
    nvmlClocksThrottleReasonHwSlowdown = 8
    nvmlClocksThrottleReasonHwThermalSlowdown = 64
    nvmlClocksThrottleReasonHwPowerBrakeSlowdown = 128

    def __init__(self):
        self.initialised = 0

    def nvmlInit(self):  # noqa: N802 (NVML's names)
        self.initialised += 1

    def nvmlShutdown(self):  # noqa: N802
        self.initialised -= 1

    def nvmlDeviceGetCount(self):  # noqa: N802
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802
        return i

    def nvmlDeviceGetName(self, h):  # noqa: N802
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):  # noqa: N802
        return 64 if h == 1 else 0

    def nvmlDeviceGetNvLinkState(self, h, link):  # noqa: N802
        if link >= 18:
            raise _NotSupported
        return 1

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):  # noqa: N802
        return 0

    def nvmlDeviceGetTemperature(self, h, sensor):  # noqa: N802
        return 40 + h

    def nvmlDeviceGetMaxClockInfo(self, h, clock):  # noqa: N802
        return 1980

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):  # noqa: N802
        return 16

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):  # noqa: N802
        return 5

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):  # noqa: N802
        raise _NotSupported

    def nvmlDeviceGetRemappedRows(self, h):  # noqa: N802
        return (0, 1, h == 1, False)


def test_read_nvml_turns_driver_answers_into_facts(monkeypatch):
    import sys

    from megascale.agent.selfcheck.gpu import read_nvml

    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    facts = read_nvml()
    assert fake.initialised == 0  # shut down again
    assert [f.name for f in facts] == ["NVIDIA H100 80GB HBM3"] * 2
    assert [f.bad_memory for f in facts] == [0, 1]
    assert [f.slowdown for f in facts] == [(), ("hw_thermal",)]
    assert [f.nvlink_active for f in facts] == [18, 18]
    assert facts[1].temperature_c == 41.0 and facts[0].pcie_gen_max == 5
    r = _by_name(judge_facts(facts, PROFILES["H100 SXM"].gpu))
    assert r["gpu.retired_pages"].status == FAIL and r["gpu.clocks"].status == FAIL
    assert r["gpu.nvlink"].status == PASS


def test_the_stand_in_uses_real_nvml_names():
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py (the gpu extra) not installed")
    names = [n for n in vars(_FakeNvml) if n.startswith(("nvml", "NVML"))]
    assert [n for n in names if not hasattr(pynvml, n)] == []
    for n in names:
        if (n.isupper() and n != "NVML_NVLINK_MAX_LINKS") or n.startswith("nvmlClocks"):
            assert getattr(pynvml, n) == getattr(_FakeNvml, n), n


def test_the_check_names_the_configuration_accepts_are_the_checks_that_run():
    from megascale.agent.selfcheck import names as selfcheck_names
    from megascale.agent.selfcheck import suite as selfcheck

    assert tuple(names for names, _ in selfcheck.CHECKS) == selfcheck_names.CHECK_NAMES
    assert selfcheck_names.selected_checks(["net"]) == [
        "net.loopback_tcp",
        "net.intranode_alltoall",
        "net.neighbour_allreduce",
    ]
