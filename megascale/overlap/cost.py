"""A communication cost model that is faithful in kind: each call costs alpha + bytes / beta.

``CostModel.delay(op, nbytes, group_size, link)`` is a pure function: the seconds one call of
``op`` (a ``torch.distributed`` function name) moving a tensor of ``nbytes`` among ``group_size``
ranks takes on a named fabric, over one link class:

* ``"tp"``: within a node (NVLink), the tensor-parallel group;
* ``"dp"`` and ``"pp"``: across nodes (the NICs), data-parallel collectives and pipeline p2p;
* ``"other"``: anything else (grad-norm all-reduce, barriers), costed as across nodes.

Bytes on the wire follow the ring algorithms NCCL uses: all-gather and reduce-scatter move
``(n-1)/n`` of the full tensor per rank, all-reduce twice that, broadcast and p2p the tensor once.
``nbytes`` is what the call moves on this machine; ``elem_scale`` converts it to the GPU's dtype
(``0.5``: fp32 tensors here stand for bf16 ones there).

``time_scale`` maps GPU seconds to CPU seconds: the GPU's peak GEMM rate divided by the GEMM rate
measured on this CPU (``measure_gemm_flops``), so a layout's communication/computation ratio on CPU
is the one the same shapes have on the named GPU. ``alpha_scale`` shrinks the per-call latency for
shapes scaled down from a real layout: a call's latency is fixed while its GEMMs shrink with the
shapes, so a model with ``f`` times fewer FLOPs per GEMM keeps the real layout's latency/compute
ratio with ``alpha_scale = 1/f`` (1 for the real shapes). ``CostModel.fixed(latency_s)`` is the older
fixed-latency model (every call costs the same), kept for comparison.

Where the delay is applied (on a communication thread, so an asynchronous op really runs beside
compute) is ``megascale.overlap.trace``; this module only prices calls.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

LINKS = ("tp", "dp", "pp", "other")


@dataclass(frozen=True)
class Fabric:
    """One GPU type and its links: per-direction bandwidth (bytes/s) and per-call latency (s)."""

    name: str
    gpu_peak_flops: float
    intra_node_bw: float
    intra_node_alpha_s: float
    inter_node_bw: float
    inter_node_alpha_s: float


FABRICS = {
    # H100 SXM: 989 TFLOP/s dense bf16; NVLink 4: 18 links x 25 GB/s = 450 GB/s per direction;
    # across nodes 8 x 400 Gb/s ConnectX-7, one NIC per GPU: 50 GB/s per GPU per direction.
    "h100-nvlink4-8x400g": Fabric(
        name="h100-nvlink4-8x400g",
        gpu_peak_flops=989e12,
        intra_node_bw=450e9,
        intra_node_alpha_s=3e-6,
        inter_node_bw=50e9,
        inter_node_alpha_s=8e-6,
    ),
}


def _wire_factor(op: str, group_size: int) -> float:
    """Bytes each rank sends per byte of the call's (full) tensor, for NCCL's ring algorithms."""
    n = max(group_size, 1)
    if op in ("isend", "irecv", "send", "recv", "batch_isend_irecv", "broadcast"):
        return 1.0
    if n == 1:
        return 0.0
    if op == "all_reduce" or op == "coalesced_all_reduce":
        return 2.0 * (n - 1) / n
    return (n - 1) / n  # all-gather, reduce-scatter (and coalesced buckets of them)


@dataclass(frozen=True)
class CostModel:
    """Prices one communication call in seconds on this machine (see the module docstring)."""

    fabric: Fabric | None
    time_scale: float = 1.0
    elem_scale: float = 1.0
    fixed_latency_s: float = 0.0
    alpha_scale: float = 1.0

    @classmethod
    def fixed(cls, latency_s: float) -> CostModel:
        return cls(fabric=None, fixed_latency_s=latency_s)

    @classmethod
    def calibrated(
        cls, fabric: str, cpu_gemm_flops: float, elem_scale: float = 0.5, alpha_scale: float = 1.0
    ) -> CostModel:
        """The named fabric, with time scaled by the GPU's peak over this CPU's GEMM rate."""
        if fabric not in FABRICS:
            raise ValueError(f"fabric={fabric!r} is unknown; accepted: {sorted(FABRICS)}")
        if cpu_gemm_flops <= 0:
            raise ValueError(f"cpu_gemm_flops={cpu_gemm_flops!r} must be > 0")
        spec = FABRICS[fabric]
        if not 0 < alpha_scale <= 1:
            raise ValueError(f"alpha_scale={alpha_scale!r} must be in (0, 1]")
        return cls(spec, spec.gpu_peak_flops / cpu_gemm_flops, elem_scale, alpha_scale=alpha_scale)

    def delay(self, op: str, nbytes: int, group_size: int, link: str) -> float:
        """Seconds the call takes here: (alpha + wire bytes / beta) on the GPU, x ``time_scale``."""
        if self.fabric is None:
            return self.fixed_latency_s
        f = self.fabric
        if link == "tp":
            alpha, beta = f.intra_node_alpha_s, f.intra_node_bw
        else:
            alpha, beta = f.inter_node_alpha_s, f.inter_node_bw
        wire = nbytes * self.elem_scale * _wire_factor(op, group_size)
        return (alpha * self.alpha_scale + wire / beta) * self.time_scale

    def describe(self) -> dict:
        """The parameters, for reports (JSON-serialisable)."""
        if self.fabric is None:
            return {"model": "fixed", "latency_s": self.fixed_latency_s}
        return {
            "model": "bytes",
            "fabric": asdict(self.fabric),
            "time_scale": self.time_scale,
            "elem_scale": self.elem_scale,
            "alpha_scale": self.alpha_scale,
        }


def measure_gemm_flops(size: int = 256, repeats: int = 20) -> float:
    """This process's fp32 GEMM rate (FLOP/s) on ``size``-square matrices, median of ``repeats``.

    Run it on every rank at once when ranks share cores, so the rate is the one each rank gets.
    """
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.matmul(a, b)  # warm the kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - start)
    times.sort()
    return 2.0 * size**3 / times[len(times) // 2]
