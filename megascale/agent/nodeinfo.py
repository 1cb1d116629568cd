"""What the agent reports about its node: hardware (once), GPU health and network counters (every
heartbeat). Linux ``/proc``; GPUs through NVML (``nvidia-ml-py``) only when it is installed and a
driver answers."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def hardware_info() -> dict[str, Any]:
    """CPU count and model, memory, OS; GPUs from NVML when ``nvidia-ml-py`` is installed."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    gpus = gpu_status()
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model or platform.processor(),
        "memory_bytes": memory,
        "os": platform.platform(),
        "gpus": [g.get("name") for g in gpus or ()],
    }


_nvml: Any = None  # the pynvml module once NVML is initialised; False when it cannot be


def _nvml_module() -> Any:
    """``pynvml`` initialised, or None without NVML (no ``nvidia-ml-py``, no driver). Tried once
    per process: the agent asks on every heartbeat, and a failing ``nvmlInit`` costs more than the
    rest of the heartbeat."""
    global _nvml
    if _nvml is None:
        try:
            import pynvml
        except ImportError:
            _nvml = False
            return None
        try:
            pynvml.nvmlInit()
            _nvml = pynvml
        except pynvml.NVMLError:  # no driver: no GPU to report on
            _nvml = False
    return _nvml or None


def gpu_status() -> list[dict[str, Any]] | None:
    """Per GPU: name, memory used/total, temperature, utilisation, uncorrected ECC errors. None
    when NVML is not available (no ``nvidia-ml-py``, no driver)."""
    pynvml = _nvml_module()
    if pynvml is None:
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpu: dict[str, Any] = {
                "index": i,
                "name": pynvml.nvmlDeviceGetName(h),
                "memory_used": memory.used,
                "memory_total": memory.total,
                "temperature_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                "utilization": pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
            }
            try:
                gpu["ecc_uncorrected"] = pynvml.nvmlDeviceGetTotalEccErrors(
                    h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                )
            except pynvml.NVMLError:
                gpu["ecc_uncorrected"] = None
            out.append(gpu)
        return out
    except pynvml.NVMLError as e:
        return [{"error": str(e)}]


def network_counters() -> dict[str, dict[str, int]]:
    """Per interface, from /proc/net/dev: bytes, packets and errors received and sent."""
    counters = {}
    try:
        lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    except OSError:
        return {}
    for line in lines:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if len(fields) >= 11:
            counters[name.strip()] = {
                "rx_bytes": int(fields[0]),
                "rx_packets": int(fields[1]),
                "rx_errs": int(fields[2]),
                "tx_bytes": int(fields[8]),
                "tx_packets": int(fields[9]),
                "tx_errs": int(fields[10]),
            }
    return counters
