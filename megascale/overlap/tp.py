"""Tensor/sequence-parallel overlap: the FFN's SP collectives chunked and pipelined with its GEMMs.

With sequence parallelism the FFN's column-parallel fc1 all-gathers its input along the sequence
before the GEMM, and the row-parallel fc2 reduce-scatters its output after it. MegaScale hides both:

* ``fc1``: the local input is split into ``k`` sequence chunks; chunk ``j+1``'s all-gather is
  issued (asynchronously) just before chunk ``j``'s GEMM, which runs as soon as chunk ``j`` has
  arrived, so one chunk's communication is always in flight behind the current GEMM.
* ``fc2``: the GEMM is split into ``k`` chunks; chunk ``j``'s reduce-scatter is issued as soon as its
  GEMM is done and runs while chunk ``j+1``'s GEMM computes.

Backward mirrors them (fc1: the local input gathered again chunk by chunk — only it is saved —
with chunked GEMMs + reduce-scatter of the input gradient; fc2: chunked all-gather of the output
gradient, one chunk ahead, + GEMM). Device-agnostic: the collectives are asynchronous
``torch.distributed`` calls (gloo runs them on its own threads; NCCL on its own stream), so the same
code overlaps on CPU and GPU.

Chunk layout. Rank ``r`` holds sequence rows ``[r*s/tp, (r+1)*s/tp)``. Chunk ``j`` of every rank is
the sub-block ``j`` of that rank's rows, so all-gathering chunk ``j`` yields rows ``{r*s/tp + j*c ...}``
for every ``r`` (``c = s/(tp*k)``), and reduce-scattering chunk ``j`` hands each rank its own
sub-block ``j``: the chunked results land exactly where the unchunked collectives put them. In a
``[s, ...]`` tensor viewed as ``[tp, k, c, ...]``, chunk ``j`` is ``[:, j]``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megascale.overlap import trace


def _start_gather(chunk: torch.Tensor, tp: int, group) -> tuple[torch.Tensor, object]:
    """Issue the asynchronous all-gather of one sequence chunk; (output [tp*c, ...], handle)."""
    out = torch.empty(
        (tp * chunk.shape[0], *chunk.shape[1:]), dtype=chunk.dtype, device=chunk.device
    )
    return out, dist.all_gather_into_tensor(out, chunk.contiguous(), group=group, async_op=True)


def _gathered_one_ahead(x_local: torch.Tensor, k: int, group) -> Iterator[torch.Tensor]:
    """Yield each of the ``k`` sequence chunks of ``x_local`` all-gathered over ``group``, as
    ``[tp, c, ...]``, keeping exactly one chunk's all-gather in flight ahead of the caller.

    Ordering relied on: chunk ``j+1``'s all-gather is issued just before chunk ``j`` is yielded,
    i.e. just before the caller's GEMM on chunk ``j``. With ``CUDA_DEVICE_MAX_CONNECTIONS=1``
    (sequence parallelism) the GPU runs work in issue order on one hardware queue, so issuing all
    ``k`` gathers up front would make GEMM 0 wait behind gathers 1..k-1; interleaved, GEMM ``j``
    waits only for gather ``j`` while gather ``j+1`` runs beside it. On CUDA the gathers run on
    NCCL's own communication stream and ``wait()`` only makes the compute stream wait for them (no
    host block); on gloo they run on gloo's threads.
    """
    tp = dist.get_world_size(group)
    chunks = x_local.chunk(k, dim=0)
    pending = _start_gather(chunks[0], tp, group)
    for j in range(k):
        full, handle = pending
        if j + 1 < k:
            pending = _start_gather(chunks[j + 1], tp, group)
        handle.wait()
        yield full.view(tp, -1, *full.shape[1:])


def _tp_chunk_view(full: torch.Tensor, tp: int, k: int) -> torch.Tensor:
    """``[s, ...]`` as ``[tp, k, c, ...]``: chunk ``j`` of every rank is ``[:, j]``."""
    return full.view(tp, k, full.shape[0] // (tp * k), *full.shape[1:])


def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, w.t())


class _ChunkedAllGatherLinear(torch.autograd.Function):
    """y = all_gather_seq(x) @ w^T, with the gather chunked and overlapped with the GEMMs.

    Saves only the local input shard for backward (``1/tp`` of the gathered input), and gathers it
    again there, chunk by chunk behind the input-gradient GEMMs, as megatron-core's own
    sequence-parallel linear does.
    """

    @staticmethod
    def forward(ctx, x_local, weight, k, group):
        tp = dist.get_world_size(group)
        out = torch.empty(
            (x_local.shape[0] * tp, *x_local.shape[1:-1], weight.shape[0]),
            dtype=x_local.dtype,
            device=x_local.device,
        )
        out_view = _tp_chunk_view(out, tp, k)
        trace.mark("tp.fc1.start")
        for j, chunk_full in enumerate(_gathered_one_ahead(x_local, k, group)):
            trace.mark(f"tp.fc1.gemm_start.{j}")  # chunk j+1's all-gather is in flight
            out_view[:, j] = _matmul(chunk_full, weight)
            trace.mark(f"tp.fc1.gemm_done.{j}")
        ctx.save_for_backward(x_local, weight)
        ctx.k, ctx.group = k, group
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_local, weight = ctx.saved_tensors
        k, group = ctx.k, ctx.group
        tp = dist.get_world_size(group)
        grad_out = grad_out.contiguous()
        grad_view = _tp_chunk_view(grad_out, tp, k)
        grad_x = torch.empty_like(x_local, dtype=grad_out.dtype)
        grad_x_chunks = grad_x.chunk(k, dim=0)
        grad_w = torch.zeros_like(weight)
        handles = []
        for j, x_full in enumerate(_gathered_one_ahead(x_local, k, group)):
            g = grad_view[:, j].reshape(-1, *grad_out.shape[1:])
            gx = torch.matmul(g, weight).contiguous()
            # Reduce-scatter chunk j while chunk j+1's GEMMs run.
            handles.append(
                (gx, dist.reduce_scatter_tensor(grad_x_chunks[j], gx, group=group, async_op=True))
            )
            x = x_full.reshape(-1, x_local.shape[-1])
            grad_w += g.reshape(-1, g.shape[-1]).t().matmul(x)
        for _, handle in handles:
            handle.wait()
        return grad_x, grad_w, None, None


class _ChunkedReduceScatterLinear(torch.autograd.Function):
    """y_local = reduce_scatter_seq(x @ w^T), with the GEMM chunked and the scatter overlapped."""

    @staticmethod
    def forward(ctx, x, weight, k, group):
        tp = dist.get_world_size(group)
        x_view = _tp_chunk_view(x, tp, k)
        s_local = x.shape[0] // tp
        out = torch.empty(
            (s_local, *x.shape[1:-1], weight.shape[0]), dtype=x.dtype, device=x.device
        )
        out_chunks = out.chunk(k, dim=0)
        handles = []
        for j in range(k):
            partial = _matmul(x_view[:, j].reshape(-1, *x.shape[1:]), weight).contiguous()
            trace.mark(f"tp.fc2.gemm_done.{j}")
            # Chunk j's reduce-scatter runs while chunk j+1's GEMM computes.
            handles.append(
                (
                    partial,
                    dist.reduce_scatter_tensor(out_chunks[j], partial, group=group, async_op=True),
                )
            )
        for _, handle in handles:
            handle.wait()
        ctx.save_for_backward(x, weight)
        ctx.k, ctx.group = k, group
        return out

    @staticmethod
    def backward(ctx, grad_out_local):
        x, weight = ctx.saved_tensors
        k, group = ctx.k, ctx.group
        tp = dist.get_world_size(group)
        grad_x = torch.empty_like(x)
        grad_x_view, x_view = _tp_chunk_view(grad_x, tp, k), _tp_chunk_view(x, tp, k)
        grad_w = torch.zeros_like(weight)
        for j, g in enumerate(_gathered_one_ahead(grad_out_local.contiguous(), k, group)):
            grad_x_view[:, j] = torch.matmul(g, weight)
            grad_w += g.reshape(-1, g.shape[-1]).t().matmul(x_view[:, j].reshape(-1, x.shape[-1]))
        return grad_x, grad_w, None, None


def _chunks_for(module, seq_local: int) -> int:
    k = module.overlap_chunks
    return k if k > 1 and seq_local % k == 0 else 1


class OverlappedColumnParallelLinear(ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear; with sequence parallelism its all-gather is chunked and
    overlapped with the GEMM (module docstring). Same parameters, same results."""

    def __init__(self, *args, overlap_chunks: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.overlap_chunks = overlap_chunks

    def forward(self, input_, weight=None, runtime_gather_output=None):
        k = _chunks_for(self, input_.shape[0])
        if not (self.sequence_parallel and k > 1 and weight is None and not self.gather_output):
            return super().forward(input_, weight, runtime_gather_output)
        output = _ChunkedAllGatherLinear.apply(input_, self.weight, k, self.tp_group)
        if self.bias is not None and not self.skip_bias_add:
            output = output + self.bias
        return output, (self.bias if self.skip_bias_add else None)


class OverlappedRowParallelLinear(RowParallelLinear):
    """megatron-core's RowParallelLinear; with sequence parallelism the GEMM is chunked and each
    chunk's reduce-scatter overlaps the next chunk's GEMM. Same parameters, same results."""

    def __init__(self, *args, overlap_chunks: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.overlap_chunks = overlap_chunks

    def forward(self, input_):
        tp = self.tp_group.size()
        k = _chunks_for(self, input_.shape[0] // max(tp, 1))
        if not (self.sequence_parallel and k > 1 and self.input_is_parallel):
            return super().forward(input_)
        output = _ChunkedReduceScatterLinear.apply(input_, self.weight, k, self.tp_group)
        if self.bias is not None and not self.skip_bias_add:
            output = output + self.bias
        return output, (self.bias if self.skip_bias_add else None)


class GatheredInputColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel linear whose input is already the full sequence, gathered by its caller.

    Used by the parallel block's shared all-gather (``ParallelTransformerLayer``): no gather of its
    own, and no all-reduce of the input gradient — the caller's gather reduce-scatters it once for
    both branches. Same parameters as ``ColumnParallelLinear``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sequence_parallel = False
        self.disable_grad_reduce = True

    def forward(self, input_, weight=None, runtime_gather_output=None):
        output = _matmul(input_, self.weight if weight is None else weight)
        if self.bias is not None and not self.skip_bias_add:
            output = output + self.bias
        return output, (self.bias if self.skip_bias_add else None)


class PartialRowParallelLinear(RowParallelLinear):
    """A row-parallel linear that returns this rank's partial sum, unreduced.

    The parallel block adds the attention's and the MLP's partial sums and reduce-scatters them
    once. The bias (full size, identical on every rank) is returned separately and must be added
    after the reduction (``skip_bias_add`` is required).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not self.skip_bias_add:
            raise ValueError("PartialRowParallelLinear needs skip_bias_add=True")

    def forward(self, input_):
        return _matmul(input_, self.weight), self.bias
