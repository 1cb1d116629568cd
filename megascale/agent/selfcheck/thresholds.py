"""Self-check thresholds: every default in one table (``PROFILES``), a TOML file, ``--set``.

A threshold's key is the name of the check it holds (``host.disk_write`` holds the check of that
name; ``net.loopback_tcp`` holds every ``net.loopback_tcp@<address>``). Each field says its unit and
whether the measured figure must be at least (min) or at most (max) the threshold. A ``None``
threshold is not enforced: the check still measures and passes.

Precedence: ``--set section.key=value`` > the TOML file > the profile's defaults. The profile is
chosen from the hardware (``profile_for_gpu``): ``cpu`` without CUDA, else the GPU model as
``megascale.probes.flops.lookup_peak`` names it (``H100 SXM``, ``H100 PCIe``, ``H200``,
``A100``), else ``gpu`` (generic, loose). A thresholds file has the same sections (an example
for an 8 x H100 node: ``megascale/config/presets/selfcheck/h100-8gpu.toml``)::

    [host]
    disk_write = 800.0      # MB/s: a faster checkpoint volume than the profile assumes
    [gpu]
    count = 8               # the node must show 8 GPUs
    matmul = 0.7            # of the dense bf16 peak

Calibration (``megascale selfcheck --calibrate --output FILE``, ``selfcheck.calibration``): a
file whose ``[calibration]`` section holds the figures measured on a healthy node of the same kind;
each calibrated threshold is then ``measured x safety_factor``. Precedence: ``--set`` > the file's
explicit sections > its calibration > the profile.

Why these numbers: GPU figures are about 60% of the data-sheet figure for what these tests
measure (bf16 8192^3 matmul vs the dense peak; a device-to-device copy counted as bytes read +
written vs the HBM bandwidth; clocks, PCIe and NVLink as the data sheet states), to catch a
broken or throttled part without failing a healthy one. They are not yet calibrated on this
project's GPUs: run ``megascale selfcheck --json`` on a healthy node and adjust. CPU figures are floors
that only a broken machine misses: on a shared 2-core CI machine under a load average of 6-19 the
measured figures were memory 13-26 GB/s, disk 0.9-1.5 GB/s, loopback TCP 3.8-37 Gbit/s, gloo
all-to-all 0.08-1.2 GB/s and all-reduce ~1 GB/s (contention moves them 10x).
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class HostThresholds:
    """Thresholds of the ``host.*`` checks."""

    memory_bandwidth: float = 1.0
    """min GB/s: copy of a large numpy buffer in host memory (bytes read + written per second)."""
    disk_write: float = 20.0
    """min MB/s: sequential write of the checkpoint directory, fsync included, file removed."""
    disk_free: float = 1.0
    """min GB free on the checkpoint directory's filesystem."""


@dataclass(frozen=True)
class NetThresholds:
    """Thresholds of the ``net.*`` checks."""

    loopback_tcp: float = 0.5
    """min Gbit/s: one TCP stream from this node to itself, per local interface address."""
    intranode_alltoall: float = 0.01
    """min GB/s bus bandwidth of all-to-all among the node's K local processes (NCCL or gloo)."""
    neighbour_allreduce: float = 0.01
    """min GB/s bus bandwidth of a gloo all-reduce over TCP with the neighbour nodes."""


@dataclass(frozen=True)
class GpuThresholds:
    """Thresholds of the ``gpu.*`` checks (only run where CUDA is present)."""

    count: int | None = None
    """exact number of GPUs the node must show; None: at least one."""
    model: str | None = None
    """text every GPU's name must contain (e.g. "H100"); None: all GPUs the same model."""
    ecc_errors: int = 0
    """max uncorrected ECC errors per GPU since the driver loaded (volatile counter)."""
    retired_pages: int = 0
    """max memory pages pending retirement plus rows pending remap or failed to remap, per GPU."""
    temperature: float = 85.0
    """max GPU core temperature, degrees C."""
    clocks: float | None = None
    """min max-SM-clock in MHz; any hardware slowdown (thermal, power brake) fails regardless."""
    pcie_width: int = 16
    """min current PCIe link width (lanes)."""
    pcie_gen: int = 3
    """min PCIe generation the GPU and its slot can run at (the idle link may run lower)."""
    nvlink: int = 0
    """min active NVLink links per GPU on nodes with more than one GPU."""
    matmul: float = 0.6
    """min bf16 matmul throughput as a fraction of the GPU's dense bf16 peak."""
    matmul_tflops: float | None = None
    """min bf16 matmul TFLOP/s, absolute; when set (a calibration sets it: measured x safety
    factor) it replaces ``matmul`` x the peak."""
    peak_tflops: float | None = None
    """dense bf16 peak per GPU for ``matmul``; None: ``flops.lookup_peak`` of the GPU name."""
    memory_bandwidth: float = 200.0
    """min GB/s: device-to-device copy of a large buffer (bytes read + written per second)."""


@dataclass(frozen=True)
class Thresholds:
    """All thresholds of one self-check run, and the profile they started from."""

    profile: str = "cpu"
    host: HostThresholds = field(default_factory=HostThresholds)
    net: NetThresholds = field(default_factory=NetThresholds)
    gpu: GpuThresholds = field(default_factory=GpuThresholds)

    def for_check(self, name: str) -> Any:
        """The threshold holding check ``name`` (``net.loopback_tcp@10.0.0.1`` -> loopback_tcp)."""
        section, key = name.split("@")[0].split(".", 1)
        return getattr(getattr(self, section), key)


def _gpu_profile(
    *, clocks: float, pcie_gen: int, nvlink: int, memory_bandwidth: float, alltoall: float
) -> Thresholds:
    return Thresholds(
        host=HostThresholds(memory_bandwidth=10.0, disk_write=200.0, disk_free=100.0),
        net=NetThresholds(loopback_tcp=10.0, intranode_alltoall=alltoall, neighbour_allreduce=0.5),
        gpu=GpuThresholds(
            clocks=clocks, pcie_gen=pcie_gen, nvlink=nvlink, memory_bandwidth=memory_bandwidth
        ),
    )


PROFILES: dict[str, Thresholds] = {
    "cpu": Thresholds(),
    "gpu": dataclasses.replace(
        _gpu_profile(clocks=0.0, pcie_gen=3, nvlink=0, memory_bandwidth=200.0, alltoall=5.0),
        host=HostThresholds(memory_bandwidth=5.0, disk_write=100.0, disk_free=20.0),
    ),
    # H100 SXM5: 1980 MHz max SM clock, PCIe Gen5 x16, 18 NVLink 4 links, HBM3 3.35 TB/s.
    "H100 SXM": _gpu_profile(
        clocks=1980.0, pcie_gen=5, nvlink=18, memory_bandwidth=2000.0, alltoall=100.0
    ),
    # H100 PCIe: 1755 MHz, no NVLink switch (bridges optional), HBM2e 2.0 TB/s.
    "H100 PCIe": _gpu_profile(
        clocks=1755.0, pcie_gen=5, nvlink=0, memory_bandwidth=1200.0, alltoall=10.0
    ),
    # H200 SXM: as H100 SXM with HBM3e 4.8 TB/s.
    "H200": _gpu_profile(
        clocks=1980.0, pcie_gen=5, nvlink=18, memory_bandwidth=3000.0, alltoall=100.0
    ),
    # A100 SXM4: 1410 MHz, PCIe Gen4, 12 NVLink 3 links, HBM2e 1.55-2.0 TB/s.
    "A100": _gpu_profile(
        clocks=1410.0, pcie_gen=4, nvlink=12, memory_bandwidth=1000.0, alltoall=60.0
    ),
}
"""Default thresholds per hardware profile: the one place they live."""


def profile_for_gpu(gpu_name: str | None) -> str:
    """The ``PROFILES`` key for a GPU name (None: no CUDA device -> ``cpu``)."""
    if gpu_name is None:
        return "cpu"
    from megascale.probes.flops import lookup_peak

    try:
        key, _ = lookup_peak(gpu_name)
    except ValueError:
        return "gpu"
    return key if key in PROFILES else "gpu"


def _convert(section: str, key: str, raw: Any, hint: Any) -> Any:
    """``raw`` (from TOML or a --set string) as the field's type, or ValueError naming it."""
    where = f"{section}.{key}"
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    base = args[0]
    optional = type(None) in typing.get_args(hint)
    if isinstance(raw, str):
        text = raw.strip()
        if optional and text.lower() in ("none", "null", ""):
            return None
        if base is str:
            return text
        try:
            raw = float(text) if base is float else int(text)
        except ValueError:
            raw = text
    if raw is None and optional:
        return None
    if base is float and isinstance(raw, int | float) and not isinstance(raw, bool):
        return float(raw)
    if base is int and isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if base is str and isinstance(raw, str):
        return raw
    accepted = base.__name__ + (" or none" if optional else "")
    raise ValueError(f"selfcheck threshold {where} = {raw!r}: accepted: {accepted}")


def _apply(thresholds: Thresholds, updates: dict[str, dict[str, Any]], origin: str) -> Thresholds:
    """``thresholds`` with ``{section: {key: value}}`` applied; unknown names raise ValueError."""
    sections = {f.name: f for f in dataclasses.fields(Thresholds) if f.name != "profile"}
    changed: dict[str, Any] = {}
    for section, values in updates.items():
        if section not in sections or not isinstance(values, dict):
            raise ValueError(
                f"{origin}: unknown selfcheck threshold section {section!r}; "
                f"accepted: {', '.join(sections)}"
            )
        current = getattr(thresholds, section)
        hints = typing.get_type_hints(type(current))
        fields = {f.name for f in dataclasses.fields(current)}
        for key, raw in values.items():
            if key not in fields:
                raise ValueError(
                    f"{origin}: unknown selfcheck threshold {section}.{key} = {raw!r}; "
                    f"accepted in [{section}]: {', '.join(sorted(fields))}"
                )
            current = dataclasses.replace(current, **{key: _convert(section, key, raw, hints[key])})
        changed[section] = current
    return dataclasses.replace(thresholds, **changed)


def parse_set(items: list[str]) -> dict[str, dict[str, str]]:
    """``["host.disk_write=100", ...]`` -> ``{"host": {"disk_write": "100"}}`` (strings)."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        name, sep, value = item.partition("=")
        section, dot, key = name.strip().partition(".")
        if not sep or not dot or not key:
            raise ValueError(
                f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. host.disk_write=100 "
                "(sections: host, net, gpu)"
            )
        out.setdefault(section, {})[key] = value
    return out


def load_thresholds(
    profile: str, file: str | Path | None = None, overrides: list[str] | None = None
) -> Thresholds:
    """The profile's defaults, then ``file`` (TOML: its calibration, then its explicit sections),
    then ``overrides`` (``SECTION.KEY=VALUE``).

    Raises ValueError for an unknown profile, section, key, or a value of the wrong type, naming
    it and what would be accepted.
    """
    if profile not in PROFILES:
        raise ValueError(f"selfcheck profile {profile!r} unknown; accepted: {', '.join(PROFILES)}")
    thresholds = dataclasses.replace(PROFILES[profile], profile=profile)
    if file is not None:
        from megascale.agent.selfcheck.calibration import calibrated_updates

        with open(file, "rb") as f:
            content = tomllib.load(f)
        calibration = content.pop("calibration", None)
        if calibration is not None:  # measured figures x safety factor, then the explicit values
            thresholds = _apply(thresholds, calibrated_updates(calibration, str(file)), str(file))
        thresholds = _apply(thresholds, content, str(file))
    if overrides:
        thresholds = _apply(thresholds, parse_set(overrides), "--set")
    return thresholds
