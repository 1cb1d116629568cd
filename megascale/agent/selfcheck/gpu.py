"""The self-check's GPU checks: NVML facts judged against thresholds, and two torch benchmarks.

Reading and judging are separate: ``read_nvml`` is the only function that talks to the driver
(through ``nvidia-ml-py``, the ``gpu`` extra); ``judge_facts`` is pure, so every rule is tested on
a machine without a GPU. One check covers all GPUs of the node and reports the worst one (the
lowest bandwidth, the highest temperature) with the offending GPU indices in its detail.

Only ``megascale.agent.selfcheck`` calls this module, and only when CUDA is present.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megascale.agent.check_result import CheckResult, judged, skipped
from megascale.agent.selfcheck.thresholds import GpuThresholds


@dataclass(frozen=True)
class GpuFacts:
    """What NVML says about one GPU; None where the GPU or driver does not support the query."""

    index: int
    name: str
    ecc_uncorrected: int | None = None
    """uncorrected ECC errors since the driver loaded."""
    bad_memory: int | None = None
    """pages pending retirement (pre-Ampere) + rows pending remap + a failed remap (Ampere+)."""
    temperature_c: float | None = None
    sm_clock_max_mhz: float | None = None
    slowdown: tuple[str, ...] = ()
    """active hardware slowdown reasons (thermal, power brake, HW slowdown)."""
    pcie_width: int | None = None
    pcie_gen_max: int | None = None
    """the highest PCIe generation this GPU can run in its slot (the idle link may run lower)."""
    nvlink_active: int | None = None


def _query(fn: Callable[..., Any], *args: Any) -> Any:
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError:  # not supported on this GPU / driver / virtualisation
        return None


def _bad_memory(nv: Any, handle: Any) -> int | None:
    total: int | None = None
    pending = _query(nv.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    if pending is not None:
        total = int(pending == nv.NVML_FEATURE_ENABLED)
    rows = _query(nv.nvmlDeviceGetRemappedRows, handle)
    if rows is not None:
        _corrected, _uncorrected, is_pending, failure = rows
        total = (total or 0) + int(bool(is_pending)) + int(bool(failure))
    return total


def read_nvml() -> list[GpuFacts]:
    """Facts about every GPU NVML sees. Raises ImportError without ``nvidia-ml-py``."""
    import pynvml as nv

    reasons = {
        "hw_slowdown": nv.nvmlClocksThrottleReasonHwSlowdown,
        "hw_thermal": nv.nvmlClocksThrottleReasonHwThermalSlowdown,
        "power_brake": nv.nvmlClocksThrottleReasonHwPowerBrakeSlowdown,
    }
    nv.nvmlInit()
    try:
        facts = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            name = nv.nvmlDeviceGetName(h)
            mask = _query(nv.nvmlDeviceGetCurrentClocksThrottleReasons, h) or 0
            links = [
                _query(nv.nvmlDeviceGetNvLinkState, h, link)
                for link in range(nv.NVML_NVLINK_MAX_LINKS)
            ]
            ecc = _query(
                nv.nvmlDeviceGetTotalEccErrors,
                h,
                nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_VOLATILE_ECC,
            )
            temperature = _query(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
            clock = _query(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM)
            width = _query(nv.nvmlDeviceGetCurrPcieLinkWidth, h)
            gen = _query(nv.nvmlDeviceGetMaxPcieLinkGeneration, h)
            facts.append(
                GpuFacts(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    ecc_uncorrected=None if ecc is None else int(ecc),
                    bad_memory=_bad_memory(nv, h),
                    temperature_c=None if temperature is None else float(temperature),
                    sm_clock_max_mhz=None if clock is None else float(clock),
                    slowdown=tuple(k for k, bit in reasons.items() if int(mask) & bit),
                    pcie_width=None if width is None else int(width),
                    pcie_gen_max=None if gen is None else int(gen),
                    nvlink_active=None
                    if all(s is None for s in links)
                    else sum(s == nv.NVML_FEATURE_ENABLED for s in links),
                )
            )
        return facts
    finally:
        nv.nvmlShutdown()


def _worst(
    name: str,
    facts: Sequence[GpuFacts],
    attr: str,
    unit: str,
    op: str,
    threshold: float | None,
    started: float,
) -> CheckResult:
    """One check over all GPUs: the worst value (max for "<=", min for ">=") held to threshold."""
    values = [(f.index, getattr(f, attr)) for f in facts if getattr(f, attr) is not None]
    if not values:
        return skipped(name, "not supported by this GPU or driver", time.perf_counter() - started)
    pick = max if op == "<=" else min
    index, worst = pick(values, key=lambda iv: iv[1])
    bad = []
    if threshold is not None:
        bad = [i for i, v in values if (v > threshold if op == "<=" else v < threshold)]
    detail = f"worst: GPU {index}" + (f"; out of bounds: GPUs {bad}" if bad else "")
    return judged(name, float(worst), unit, op, threshold, detail, time.perf_counter() - started)


def judge_facts(
    facts: Sequence[GpuFacts], t: GpuThresholds, started: float | None = None
) -> list[CheckResult]:
    """The NVML checks (count, model, ECC, bad memory, temperature, clocks, PCIe, NVLink)."""
    started = time.perf_counter() if started is None else started
    names = sorted({f.name for f in facts})
    count_op = "==" if t.count is not None else ">="
    results = [
        judged(
            "gpu.count",
            float(len(facts)),
            "GPUs",
            count_op,
            float(t.count if t.count is not None else 1),
            ", ".join(f"{f.index}: {f.name}" for f in facts),
            0.0,
        )
    ]
    wrong = [f.index for f in facts if t.model is not None and t.model not in f.name]
    mixed = t.model is None and len(names) > 1
    results.append(
        CheckResult(
            "gpu.model",
            "fail" if wrong or mixed else "pass",
            " | ".join(names),
            "",
            t.model,
            "contains" if t.model is not None else "one model",
            f"GPUs {wrong} are not {t.model}" if wrong else ("mixed models" if mixed else ""),
            0.0,
        )
    )
    results += [
        _worst("gpu.ecc_errors", facts, "ecc_uncorrected", "errors", "<=", t.ecc_errors, started),
        _worst("gpu.retired_pages", facts, "bad_memory", "pages", "<=", t.retired_pages, started),
        _worst("gpu.temperature", facts, "temperature_c", "C", "<=", t.temperature, started),
    ]
    clocks = _worst("gpu.clocks", facts, "sm_clock_max_mhz", "MHz", ">=", t.clocks, started)
    slow = [f"GPU {f.index}: {'+'.join(f.slowdown)}" for f in facts if f.slowdown]
    if slow:
        clocks.status = "fail"
        clocks.detail = "hardware slowdown active: " + "; ".join(slow)
    results.append(clocks)
    results += [
        _worst("gpu.pcie_width", facts, "pcie_width", "lanes", ">=", t.pcie_width, started),
        _worst("gpu.pcie_gen", facts, "pcie_gen_max", "gen", ">=", t.pcie_gen, started),
    ]
    if len(facts) < 2:
        results.append(skipped("gpu.nvlink", "one GPU: no NVLink peers", 0.0))
    else:
        results.append(
            _worst("gpu.nvlink", facts, "nvlink_active", "links", ">=", t.nvlink, started)
        )
    return results


WARMUP_S = 0.25
"""Seconds of untimed work before a GPU benchmark is timed (cuBLAS heuristics, clocks up)."""
REPEATS = 5
"""Timed repeats per GPU benchmark; the figure is their median."""


@dataclass(frozen=True)
class Rate:
    """A GPU benchmark's figure: the median rate of ``repeats`` timed repeats (CUDA events), which
    together ran ``seconds`` after warm-up; ``spread`` is (max - min) / median of the repeats."""

    value: float
    repeats: int
    seconds: float
    spread: float

    def describe(self) -> str:
        return (
            f"median of {self.repeats} repeats over {self.seconds:.2f} s, spread {self.spread:.1%}"
        )


def timed_rate(step: Callable[[], Any], work: float, min_seconds: float) -> Rate:
    """Run ``step`` (``work`` units per call, on the current CUDA device) for ``WARMUP_S``
    untimed, then ``REPEATS`` CUDA-event-timed repeats of equal length lasting ``min_seconds``
    together; the median rate in units/s. Long enough to be stable: a short burst measures clock
    ramp-up and launch overhead, and a node is evicted on this figure."""
    import torch

    def timed(calls: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    warm, one = 0.0, 0.0
    while warm < WARMUP_S:
        one = timed(1)
        warm += one
    calls = max(1, math.ceil(min_seconds / REPEATS / max(one, 1e-6)))
    times = [timed(calls) for _ in range(REPEATS)]
    rates = sorted(work * calls / t for t in times)
    median = statistics.median(rates)
    return Rate(median, REPEATS, sum(times), (rates[-1] - rates[0]) / median)


def matmul_tflops(device: int, n: int, min_seconds: float) -> Rate:
    """bf16 TFLOP/s of an n x n x n matmul on GPU ``device`` (2 n^3 FLOPs each)."""
    import torch

    with torch.cuda.device(device):
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(a)
        return timed_rate(lambda: torch.matmul(a, b, out=out), 2 * n**3 / 1e12, min_seconds)


def copy_bandwidth(device: int, nbytes: int, min_seconds: float) -> Rate:
    """GB/s (bytes read + written) of a device-to-device copy of ``nbytes`` on GPU ``device``."""
    import torch

    with torch.cuda.device(device):
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        return timed_rate(lambda: dst.copy_(src), 2 * nbytes / 1e9, min_seconds)


MATMUL_N = 8192
"""bf16 matmul size: large enough to reach the tensor cores' sustained rate on H100-class GPUs."""
COPY_BYTES = 1 << 30


def _matmul_threshold(t: GpuThresholds, gpu_name: str) -> tuple[float | None, str]:
    """(min TFLOP/s, where it comes from): the absolute (calibrated) figure, or the fraction of
    the dense peak; (None, why) when neither is known."""
    from megascale.probes.flops import lookup_peak

    if t.matmul_tflops is not None:
        return t.matmul_tflops, "gpu.matmul_tflops"
    peak, source = t.peak_tflops, "gpu.peak_tflops"
    if peak is None:
        try:
            key, peak = lookup_peak(gpu_name)
            source = f"{key} dense bf16 peak"
        except ValueError:
            return None, f"no dense bf16 peak known for {gpu_name!r}: set gpu.peak_tflops"
    return t.matmul * peak, f"{t.matmul:g} x {peak:g} ({source})"


def _worst_rate(
    name: str, per_gpu: list[Rate], unit: str, threshold: float, how: str, started: float
) -> CheckResult:
    worst = min(range(len(per_gpu)), key=lambda i: per_gpu[i].value)
    rate = per_gpu[worst]
    detail = f"worst: GPU {worst}; {how}; {rate.describe()}"
    return judged(name, rate.value, unit, ">=", threshold, detail, time.perf_counter() - started)


def benchmark_checks(t: GpuThresholds, gpu_name: str, quick: bool) -> list[CheckResult]:
    """``gpu.matmul`` (bf16 TFLOP/s) and ``gpu.memory_bandwidth`` (GB/s) on every GPU, each timed
    for >= 1 s (3 s unless ``quick``) after warm-up, the median of repeats; the worst GPU is
    held to the threshold, and the detail says how the figure and the threshold were obtained."""
    import torch

    devices = range(torch.cuda.device_count())
    min_seconds = 1.0 if quick else 3.0
    results = []
    started = time.perf_counter()
    threshold, source = _matmul_threshold(t, gpu_name)
    if threshold is None:
        results.append(skipped("gpu.matmul", source))
    else:
        per_gpu = [matmul_tflops(d, MATMUL_N, min_seconds) for d in devices]
        how = f"bf16 {MATMUL_N}^3; threshold {source}"
        results.append(_worst_rate("gpu.matmul", per_gpu, "TFLOP/s", threshold, how, started))
    started = time.perf_counter()
    per_gpu = [copy_bandwidth(d, COPY_BYTES, min_seconds) for d in devices]
    how = f"copy of {COPY_BYTES >> 20} MiB, read + write"
    results.append(
        _worst_rate("gpu.memory_bandwidth", per_gpu, "GB/s", t.memory_bandwidth, how, started)
    )
    return results
