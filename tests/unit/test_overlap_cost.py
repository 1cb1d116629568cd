"""The communication cost model: alpha + wire bytes / beta per link class, scaled to this CPU."""

from __future__ import annotations

import math
import threading
import time

import pytest

from megascale.overlap.cost import FABRICS, CostModel
from megascale.parallel.async_comm import CommOp

H100 = "h100-nvlink4-8x400g"


def test_delay_is_alpha_plus_ring_bytes_over_link_bandwidth():
    f = FABRICS[H100]
    model = CostModel(f)  # GPU seconds, tensors already in the GPU's dtype
    mb = 1 << 20
    # TP all-gather over 8 ranks in the node: 7/8 of the full tensor crosses NVLink.
    assert math.isclose(
        model.delay("all_gather_into_tensor", 8 * mb, 8, "tp"),
        f.intra_node_alpha_s + 7 * mb / f.intra_node_bw,
    )
    # DP all-reduce across nodes: twice the reduce-scatter's bytes, on the NIC.
    assert math.isclose(
        model.delay("all_reduce", 4 * mb, 4, "dp"),
        f.inter_node_alpha_s + 2 * 3 * mb / f.inter_node_bw,
    )
    # PP send: the tensor once, across nodes; a bigger message costs proportionally more.
    small, big = model.delay("isend", mb, 2, "pp"), model.delay("isend", 2 * mb, 2, "pp")
    assert math.isclose(big - small, mb / f.inter_node_bw)
    assert model.delay("all_gather_into_tensor", mb, 1, "tp") == f.intra_node_alpha_s


def test_calibration_scales_gpu_time_by_peak_over_cpu_rate_and_dtype():
    f = FABRICS[H100]
    model = CostModel.calibrated(H100, cpu_gemm_flops=1e10, elem_scale=0.5, alpha_scale=0.1)
    scale = f.gpu_peak_flops / 1e10
    expected = (0.1 * f.intra_node_alpha_s + 0.5 * 1000 / f.intra_node_bw) * scale
    assert math.isclose(model.delay("broadcast", 1000, 2, "tp"), expected)
    assert model.describe()["time_scale"] == scale


def test_fixed_latency_model_prices_every_call_alike():
    model = CostModel.fixed(0.02)
    assert model.delay("isend", 10, 2, "pp") == model.delay("all_reduce", 10**9, 8, "dp") == 0.02
    assert model.describe() == {"model": "fixed", "latency_s": 0.02}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fabric": "tpu", "cpu_gemm_flops": 1e9}, "fabric='tpu' is unknown"),
        ({"fabric": H100, "cpu_gemm_flops": 0.0}, "cpu_gemm_flops=0.0 must be > 0"),
        ({"fabric": H100, "cpu_gemm_flops": 1e9, "alpha_scale": 2.0}, "alpha_scale=2.0"),
    ],
)
def test_bad_parameters_name_the_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CostModel.calibrated(**kwargs)


def test_nccl_like_op_waits_out_its_cost_on_its_thread_before_running():
    """The NCCL-like mode's op (``parallel.async_collectives``) with a modelled cost: its
    communication thread is busy for that long, then runs the call."""
    spans, ran = [], []
    op = CommOp(
        "all_reduce",
        lambda: ran.append(time.perf_counter()),
        [],
        cost_s=0.02,
        on_cost=lambda start, end: spans.append((start, end)),
    )
    thread = threading.Thread(target=op.execute)
    thread.start()
    assert op.wait()
    thread.join()
    ((start, end),) = spans
    assert end - start >= 0.02 and ran == [ran[0]] and ran[0] >= end
