"""The chunked TP overlap's two operations against the unchunked ones they replace, on real gloo
ranks, forward and backward: the sequence-parallel all-gather + GEMM (``all_gather_linears``) and
GEMM + reduce-scatter (``linears_reduce_scatter``), with one weight and with two fused. At TP4 some
ranks hold rows between other ranks' rows, so their own rows' GEMM splits the others' in two.

Every rank holds its own weight shard (seeded by rank) and builds every rank's tensors from the
same seeds, so it computes the whole unchunked result itself and checks its own part of it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megascale.launcher.local import run_local
from megascale.overlap.tp import all_gather_linears, linears_reduce_scatter

S_LOCAL, BATCH, HIDDEN = 8, 2, 6
DTYPE = torch.float64  # exact enough to hold the chunked sums to 1e-12


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_()


def _all_gather_side(
    rank: int, tp: int, k: int, widths
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Rank ``q``'s weights ``w_i^q`` and output gradients ``g_i^q``; the input is the gathered
    ``x``. Reference: ``y_i^q = x w_i^q^T``; the input gradient is this rank's rows of
    ``sum_q sum_i g_i^q w_i^q``."""
    s = S_LOCAL * tp
    x_full = _randn(1, s, BATCH, HIDDEN)
    weights = {
        q: [_randn(100 + 10 * q + i, w, HIDDEN) for i, w in enumerate(widths)] for q in range(tp)
    }
    grads = {
        q: [_randn(200 + 10 * q + i, s, BATCH, w) for i, w in enumerate(widths)] for q in range(tp)
    }
    mine = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL)
    x_local, ws = _leaf(x_full[mine]), [_leaf(w) for w in weights[rank]]
    outs = all_gather_linears(x_local, ws, k, dist.group.WORLD)
    torch.autograd.backward(outs, grads[rank])
    checks = [
        (f"y{i}", out, x_full @ w.t())
        for i, (out, w) in enumerate(zip(outs, weights[rank], strict=True))
    ]
    grad_x = sum(
        torch.matmul(g, w) for q in range(tp) for g, w in zip(grads[q], weights[q], strict=True)
    )
    checks.append(("grad x", x_local.grad, grad_x[mine]))
    for i, (w, g) in enumerate(zip(ws, grads[rank], strict=True)):
        checks.append(
            (f"grad w{i}", w.grad, g.reshape(-1, g.shape[-1]).t() @ x_full.reshape(-1, HIDDEN))
        )
    return checks


def _reduce_scatter_side(
    rank: int, tp: int, k: int, widths
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Rank ``q``'s inputs ``x_i^q`` (full sequence) and weights ``w_i^q``. Reference: this rank's
    rows of ``sum_q sum_i x_i^q w_i^q^T``; with the output gradient ``G`` (this rank holds its rows),
    ``grad x_i^q = G w_i^q`` and ``grad w_i^q = G^T x_i^q``."""
    s, out = S_LOCAL * tp, 4
    xs = {
        q: [_randn(300 + 10 * q + i, s, BATCH, w) for i, w in enumerate(widths)] for q in range(tp)
    }
    weights = {
        q: [_randn(400 + 10 * q + i, out, w) for i, w in enumerate(widths)] for q in range(tp)
    }
    grad_full = _randn(2, s, BATCH, out)
    mine = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL)
    pairs = [(_leaf(x), _leaf(w)) for x, w in zip(xs[rank], weights[rank], strict=True)]
    y = linears_reduce_scatter(pairs, k, dist.group.WORLD)
    y.backward(grad_full[mine])
    total = sum(x @ w.t() for q in range(tp) for x, w in zip(xs[q], weights[q], strict=True))
    checks = [("y", y, total[mine])]
    g = grad_full.reshape(-1, out)
    for i, ((x, w), x_ref) in enumerate(zip(pairs, xs[rank], strict=True)):
        checks.append((f"grad x{i}", x.grad, grad_full @ w.detach()))
        checks.append((f"grad w{i}", w.grad, g.t() @ x_ref.reshape(-1, x_ref.shape[-1])))
    return checks


def _rank(k: int, fused: bool) -> dict[str, float]:
    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    widths = (5, 3) if fused else (5,)
    errors = {}
    for side in (_all_gather_side, _reduce_scatter_side):
        for name, got, want in side(rank, tp, k, widths):
            assert got.shape == want.shape, (side.__name__, name, got.shape, want.shape)
            errors[f"{side.__name__} {name}"] = float((got - want).abs().max() / want.abs().max())
    dist.destroy_process_group()
    return errors


@pytest.mark.parametrize("fused", [False, True], ids=["one weight", "two fused"])
@pytest.mark.parametrize("tp,k", [(2, 4), (4, 2)])
def test_chunked_tp_collectives_match_the_unchunked_ones(tp, k, fused):
    for rank, errors in enumerate(run_local(_rank, tp, (k, fused), timeout_s=300)):
        bad = {name: e for name, e in errors.items() if not e < 1e-12}
        assert not bad, f"tp {tp} k {k} rank {rank}: relative errors {bad}"
        assert len(errors) == (10 if fused else 6), errors
