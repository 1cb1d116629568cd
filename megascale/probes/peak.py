"""The peak a run's MFU is measured against, and where it came from.

``run_peak(device, dtype, override, tf32=...)`` is called once per rank at start, before the first
step:

* ``train.peak_tflops`` set: that value, on any device (``source = "train.peak_tflops"``).
* CUDA: the GPU's dense peak for the model's dtype, by the GPU's name (``flops.lookup_peak``):
  the bf16 tensor-core figure for bf16 and fp16 (equal on every GPU of the table); for fp32 the
  TF32 tensor-core figure where fp32 GEMMs run as TF32 (``tf32``: Transformer Engine's always do,
  torch's when ``torch.backends.cuda.matmul.allow_tf32`` is set), else the FP32 CUDA-core one
  (``flops.FP32_PEAK_TFLOPS``). The source names which (``"gpu:H100 SXM dense tf32"``). An unknown
  name, or no fp32 figure for the GPU, gives no peak (MFU is then not reported, with one warning).
* CPU: a peak *measured* by a short square matmul benchmark in the model's dtype, on the threads
  this rank trains with (``measure_cpu_peak``: ~0.25 s). The result is cached per machine in
  ``$XDG_CACHE_HOME/megascale/cpu_peak.json`` (default ``~/.cache``), keyed by CPU model, torch
  version, thread count and dtype, so a machine measures each combination once; a cache that
  cannot be read or written is ignored (measured again, never an error).

The measured CPU peak is what one matmul loop reaches on this rank's share of the cores, not the
vendor's theoretical figure, so a CPU MFU reads as "fraction of what this CPU's matmul reaches".
Every MFU figure carries ``Peak.label()`` so that it is never mistaken for a GPU data-sheet MFU.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MEASURE_SECONDS = 0.25
"""How long the CPU matmul benchmark runs (after one warm-up product)."""
MATMUL_SIZE = 512
"""Side of the square matrices the CPU benchmark multiplies."""
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Peak:
    """Dense TFLOP/s per device that MFU divides by, and where the figure came from:
    ``"train.peak_tflops"``, ``"gpu:<table key>"`` or ``"measured:cpu <dtype>"``."""

    tflops: float
    source: str

    def label(self) -> str:
        """E.g. ``"0.153 TFLOP/s measured:cpu fp32"`` (``peak_label``)."""
        return peak_label(self.tflops, self.source)


def peak_label(tflops: float | None, source: str | None) -> str:
    """A peak in words, as every MFU figure is labelled: ``"0.153 TFLOP/s measured:cpu fp32"``."""
    return f"{tflops:.4g} TFLOP/s {source}" if tflops else "no peak"


def cache_path() -> Path:
    """``$XDG_CACHE_HOME/megascale/cpu_peak.json`` (``~/.cache`` when the variable is unset)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "megascale" / "cpu_peak.json"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``, else the arch."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cache_key(dtype: str, threads: int) -> str:
    """What a cached CPU peak is valid for: CPU model, torch version, threads and dtype."""
    import torch

    return f"{cpu_model()} | torch {torch.__version__} | {threads} threads | {dtype}"


def measure_cpu_peak(
    dtype: str, seconds: float = MEASURE_SECONDS, size: int = MATMUL_SIZE
) -> float:
    """TFLOP/s of ``size`` x ``size`` matmuls in ``dtype`` ("fp32", "bf16", "fp16") on the
    current torch thread count: the best of repeated timed products over ``seconds``."""
    import torch

    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype = {dtype!r}: must be one of {', '.join(TORCH_DTYPES)}")
    kind = getattr(torch, TORCH_DTYPES[dtype])
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(kind)
    b = torch.randn(size, size, generator=generator).to(kind)
    out = torch.empty(size, size, dtype=kind)
    torch.mm(a, b, out=out)  # warm-up: first-call allocation and kernel selection
    best, deadline = float("inf"), time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
        if start >= deadline:
            break
    return 2.0 * size**3 / best / 1e12


def cpu_peak(dtype: str, threads: int) -> float:
    """The cached CPU peak for (this machine, ``dtype``, ``threads``), measured on a miss."""
    path, key = cache_path(), cache_key(dtype, threads)
    try:
        cached = json.loads(path.read_text())
        if isinstance(cached, dict) and float(cached.get(key, 0)) > 0:
            return float(cached[key])
    except (OSError, ValueError, TypeError):
        cached = {}
    value = measure_cpu_peak(dtype)
    logger.info("measured CPU matmul peak: %.4g TFLOP/s (%s)", value, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**(cached if isinstance(cached, dict) else {}), key: value}
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
        os.replace(tmp, path)  # several ranks or nodes may write: each write is whole
    except OSError as e:
        logger.warning("CPU peak not cached in %s: %s", path, e)
    return value


def run_peak(device: str, dtype: str, override: float | None, *, tf32: bool = False) -> Peak | None:
    """The peak for this rank's MFU (rules in the module docstring); None when none is known.
    ``dtype``: the model's ``params_dtype``; ``tf32``: its fp32 GEMMs run as TF32 (CUDA only)."""
    import torch

    from megascale.probes.flops import FP32_PEAK_TFLOPS, PEAK_TFLOPS, lookup_peak

    if override is not None:
        return Peak(float(override), "train.peak_tflops")
    if device == "cpu":
        return Peak(cpu_peak(dtype, torch.get_num_threads()), f"measured:cpu {dtype}")
    name = torch.cuda.get_device_name()
    try:
        key, value = lookup_peak(name)
    except ValueError:
        logger.warning(
            "no dense %s peak known for %r (known: %s); set train.peak_tflops for MFU",
            dtype,
            name,
            ", ".join(PEAK_TFLOPS),
        )
        return None
    if dtype != "fp32":
        return Peak(value, f"gpu:{key} dense {dtype}")
    kind = "tf32" if tf32 else "fp32"
    if key not in FP32_PEAK_TFLOPS:
        logger.warning(
            "no dense %s peak known for %r (known for: %s); set train.peak_tflops for MFU",
            kind,
            name,
            ", ".join(FP32_PEAK_TFLOPS),
        )
        return None
    return Peak(FP32_PEAK_TFLOPS[key][kind], f"gpu:{key} dense {kind}")
