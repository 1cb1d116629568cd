"""The chunked TP overlap in bf16: its weight gradient sums the chunks' GEMMs in fp32 and rounds
once, as one unchunked GEMM into Megatron's fp32 main gradient would, instead of rounding the
running sum to bf16 after every chunk (k roundings, where k is the number of chunks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megascale.launcher.local import run_local
from megascale.overlap.tp import all_gather_linears

S, BATCH, HIDDEN, OUT, CHUNKS = 512, 2, 64, 32, 8


def _grad_w_errors() -> tuple[float, float]:
    from megascale.parallel.groups import init_distributed

    init_distributed("cpu")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(S, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    w = torch.randn(OUT, HIDDEN, generator=gen, dtype=torch.float64)
    g = torch.randn(S, BATCH, OUT, generator=gen, dtype=torch.float64)
    exact = g.reshape(-1, OUT).t() @ x.reshape(-1, HIDDEN)
    # One unchunked bf16 GEMM: the rounding a single weight-gradient GEMM makes.
    one_gemm = (g.bfloat16().reshape(-1, OUT).t() @ x.bfloat16().reshape(-1, HIDDEN)).double()
    w_bf16 = w.bfloat16().requires_grad_()
    (out,) = all_gather_linears(x.bfloat16(), [w_bf16], CHUNKS, dist.group.WORLD)
    torch.autograd.backward([out], [g.bfloat16()])
    scale = exact.abs().max().item()
    chunked = (w_bf16.grad.double() - exact).abs().max().item() / scale
    return chunked, (one_gemm - exact).abs().max().item() / scale


def test_chunked_bf16_weight_gradient_is_as_close_as_one_gemm():
    chunked, one_gemm = run_local(_grad_w_errors, 1, (), timeout_s=300)[0]
    assert chunked <= 1.5 * one_gemm, (chunked, one_gemm)
