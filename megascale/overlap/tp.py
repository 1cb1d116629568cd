"""Tensor/sequence-parallel overlap: the SP collectives chunked and pipelined with the GEMMs.

With sequence parallelism each column-parallel linear (attention QKV, MLP fc1) all-gathers its input
along the sequence before the GEMM, and each row-parallel linear (attention output projection, MLP
fc2) reduce-scatters its output after it. MegaScale hides both:

* all-gather + GEMM (``all_gather_linears``): the local input is split into ``k`` sequence chunks;
  chunk ``j+1``'s all-gather is issued (asynchronously) just before chunk ``j``'s GEMM, which runs
  as soon as chunk ``j`` has arrived, so one chunk's communication is always in flight behind the
  current GEMM. The rows this rank already holds need no gather: their GEMM runs first, beside
  chunk 0's gather, and each chunk's GEMM then covers the other ranks' rows only — so the first
  gather is hidden too.
* GEMM + reduce-scatter (``linears_reduce_scatter``): the GEMM is split into ``k`` chunks; chunk
  ``j``'s reduce-scatter is issued as soon as its GEMM is done and runs while chunk ``j+1``'s GEMM
  computes. Each chunk's GEMM covers the rows the other ranks receive; this rank's own rows enter
  the reduce-scatter as zeros and their GEMM runs last, beside the last chunk's reduce-scatter,
  and is added to its result — so the last reduce-scatter is hidden too. (With ``tp = 2`` the sum
  is the same two operands in either order, so the result is bitwise the unchunked one.)

The serial block uses them per linear (``OverlappedColumnParallelLinear`` for QKV and fc1,
``OverlappedRowParallelLinear`` for the output projection and fc2). MegaScale's parallel block
shares one gather of LN(x) between QKV and fc1 and one reduce-scatter between the output projection
and fc2 (``megascale.model.parallel_block``): on each chunk the two weights run as one fused
GEMM (QKV + fc1 on the weights side by side; output projection + fc2 on the inputs and weights
side by side).

Backward mirrors them. All-gather side: per chunk, the input-gradient GEMM (it needs no gathered
input) runs while that chunk's local input is gathered again (only the local shard is saved), its
reduce-scatter is issued at once, and the weight-gradient GEMM on the gathered chunk runs beside
that reduce-scatter and the next chunk's gather — so neither the first gather nor the last
reduce-scatter is left alone. Reduce-scatter side: chunked all-gather of the output gradient, one
chunk ahead, + GEMMs, the local rows' GEMMs first beside the first gather. Device-agnostic: the collectives are asynchronous
``torch.distributed`` calls (gloo runs them on its own threads; NCCL on its own stream), so the same
code overlaps on CPU and GPU.

Chunk layout. Rank ``r`` holds sequence rows ``[r*s/tp, (r+1)*s/tp)``. Chunk ``j`` of every rank is
the sub-block ``j`` of that rank's rows, so all-gathering chunk ``j`` yields rows ``{r*s/tp + j*c ...}``
for every ``r`` (``c = s/(tp*k)``), and reduce-scattering chunk ``j`` hands each rank its own
sub-block ``j``: the chunked results land exactly where the unchunked collectives put them. In a
``[s, ...]`` tensor viewed as ``[tp, k, c, ...]``, chunk ``j`` is ``[:, j]`` and this rank's own
rows are ``[r]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

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


def _gathered_one_ahead(
    x_local: torch.Tensor, k: int, group, local_work: Callable[[], None] | None = None
) -> Iterator[torch.Tensor]:
    """Yield each of the ``k`` sequence chunks of ``x_local`` all-gathered over ``group``, as
    ``[tp, c, ...]``, keeping exactly one chunk's all-gather in flight ahead of the caller.
    ``local_work`` (the GEMMs on the rows this rank holds) runs once chunk 0's gather is issued,
    beside it.

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
    if local_work is not None:
        local_work()
    for j in range(k):
        full, handle = pending
        if j + 1 < k:
            pending = _start_gather(chunks[j + 1], tp, group)
        handle.wait()
        yield full.view(tp, -1, *full.shape[1:])


def _others(rank: int, tp: int) -> list[slice]:
    """The ranks other than ``rank`` as at most two slices of ``range(tp)`` (before, after)."""
    return [part for part in (slice(0, rank), slice(rank + 1, tp)) if part.start < part.stop]


def _tp_chunk_view(full: torch.Tensor, tp: int, k: int) -> torch.Tensor:
    """``[s, ...]`` as ``[tp, k, c, ...]``: chunk ``j`` of every rank is ``[:, j]``."""
    return full.view(tp, k, full.shape[0] // (tp * k), *full.shape[1:])


def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, w.t())


def _fused(tensors, dim: int) -> torch.Tensor:
    """One tensor of ``tensors`` side by side along ``dim`` (the tensor itself when alone): the
    weights of linears that share an input (or an output) become one GEMM's operand."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


class _ChunkedAllGatherLinear(torch.autograd.Function):
    """(all_gather_seq(x) @ w_i^T for each weight w_i), with the gather chunked and overlapped with
    the GEMMs. Several weights share one gather (the parallel block's QKV and fc1) and run as one
    fused GEMM per chunk on the weights concatenated along the output dimension (each output
    column depends only on its own weight row, so the results are the separate GEMMs').

    Saves only the local input shard for backward (``1/tp`` of the gathered input), and gathers it
    again there, chunk by chunk behind the input-gradient GEMMs, as megatron-core's own
    sequence-parallel linear does.
    """

    @staticmethod
    def forward(ctx, x_local, k, group, *weights):
        tp = dist.get_world_size(group)
        w = _fused(weights, 0)  # read here: after the modules' forward pre-hooks (param gather)
        outs = [
            torch.empty(
                (x_local.shape[0] * tp, *x_local.shape[1:-1], wi.shape[0]),
                dtype=x_local.dtype,
                device=x_local.device,
            )
            for wi in weights
        ]
        rank = dist.get_rank(group)
        widths = [wi.shape[0] for wi in weights]
        views = [_tp_chunk_view(out, tp, k) for out in outs]

        def store(y: torch.Tensor, index) -> None:
            for view, part in zip(views, y.split(widths, -1), strict=True):
                view[index] = part.view(view[index].shape)

        def local_gemm() -> None:  # this rank's own rows, beside chunk 0's gather
            trace.mark("tp.ag.local_gemm_start")
            store(_matmul(x_local, w), rank)
            trace.mark("tp.ag.local_gemm_done")

        trace.mark("tp.ag.start")
        gathered = _gathered_one_ahead(x_local, k, group, local_gemm)
        for j, chunk_full in enumerate(gathered):
            trace.mark(f"tp.ag.gemm_start.{j}")  # chunk j+1's all-gather is in flight
            for others in _others(rank, tp):
                store(_matmul(chunk_full[others], w), (others, j))
            trace.mark(f"tp.ag.gemm_done.{j}")
        ctx.save_for_backward(x_local, *weights)
        ctx.k, ctx.group = k, group
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grad_outs):
        x_local, *weights = ctx.saved_tensors
        k, group = ctx.k, ctx.group
        tp = dist.get_world_size(group)
        w = _fused(weights, 0)
        grad_view = _tp_chunk_view(_fused([g.contiguous() for g in grad_outs], -1), tp, k)
        grad_x = torch.empty_like(x_local, dtype=grad_outs[0].dtype)
        grad_x_chunks = grad_x.chunk(k, dim=0)
        # The chunks' products are summed in fp32 and rounded once at the end, as one unchunked
        # GEMM into Megatron's fp32 main gradient would (in bf16, a running bf16 sum rounds k times).
        grad_w = torch.zeros_like(w, dtype=torch.promote_types(w.dtype, torch.float32))
        h = x_local.shape[-1]
        x_chunks = x_local.chunk(k, dim=0)
        handles = []
        pending = _start_gather(x_chunks[0], tp, group)
        for j in range(k):
            g = grad_view[:, j].reshape(-1, *grad_view.shape[3:])
            # The input gradient needs no gathered input: its GEMM runs while chunk j's input
            # gathers (so even the first gather has a GEMM beside it), and its reduce-scatter
            # is issued at once, to run beside the weight-gradient GEMM below (the last one too).
            gx = torch.matmul(g, w).contiguous()
            handles.append(
                (gx, dist.reduce_scatter_tensor(grad_x_chunks[j], gx, group=group, async_op=True))
            )
            full, handle = pending
            if j + 1 < k:  # one gather ahead, queued behind chunk j's reduce-scatter
                pending = _start_gather(x_chunks[j + 1], tp, group)
            handle.wait()
            grad_w += g.reshape(-1, g.shape[-1]).t().matmul(full.view(-1, h))
        for _, handle in handles:
            handle.wait()
        grad_ws = grad_w.to(w.dtype).split([wi.shape[0] for wi in weights], 0)
        return (grad_x, None, None, *grad_ws)


class _ChunkedReduceScatterLinear(torch.autograd.Function):
    """y_local = reduce_scatter_seq(sum_i x_i @ w_i^T), with the GEMMs chunked and each chunk's
    reduce-scatter overlapped with the next chunk's GEMM. Several (x_i, w_i) pairs share one
    reduce-scatter (the parallel block's output projection and fc2) and run as one fused GEMM
    per chunk: the inputs side by side times the weights side by side (``[x_1 x_2] @ [w_1 w_2]^T
    = x_1 @ w_1^T + x_2 @ w_2^T``)."""

    @staticmethod
    def _rows(x_views, index) -> torch.Tensor:
        """The rows ``index`` of every input (``[tp, k, c, ...]`` views) side by side, as
        ``[rows, sum of input widths]``."""
        parts = [v[index].reshape(-1, v.shape[-1]) for v in x_views]
        return _fused(parts, -1)

    @staticmethod
    def forward(ctx, k, group, *pairs):
        xs, weights = pairs[0::2], pairs[1::2]
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        x_views = [_tp_chunk_view(x, tp, k) for x in xs]
        rows = _ChunkedReduceScatterLinear._rows
        w = _fused(weights, 1)
        x0 = xs[0]
        out = torch.empty(
            (x0.shape[0] // tp, *x0.shape[1:-1], w.shape[0]),
            dtype=x0.dtype,
            device=x0.device,
        )
        out_chunks = out.chunk(k, dim=0)
        handles = []
        for j in range(k):
            # The other ranks' rows; this rank's own enter the sum as zeros (added below).
            partial = torch.empty(
                (tp, out_chunks[j].shape[0], *out.shape[1:]), dtype=out.dtype, device=out.device
            )
            partial[rank] = 0
            for others in _others(rank, tp):
                y = _matmul(rows(x_views, (others, j)), w)
                partial[others] = y.view(partial[others].shape)
            trace.mark(f"tp.rs.gemm_done.{j}")
            # Chunk j's reduce-scatter runs while chunk j+1's GEMM computes.
            handles.append(
                (
                    partial,
                    dist.reduce_scatter_tensor(
                        out_chunks[j], partial.view(-1, *out.shape[1:]), group=group, async_op=True
                    ),
                )
            )
        trace.mark("tp.rs.local_gemm_start")  # beside the last chunk's reduce-scatter
        own = _matmul(rows(x_views, rank), w).view(out.shape)
        trace.mark("tp.rs.local_gemm_done")
        for _, handle in handles:
            handle.wait()
        out += own
        ctx.save_for_backward(*pairs)
        ctx.k, ctx.group = k, group
        return out

    @staticmethod
    def backward(ctx, grad_out_local):
        pairs = ctx.saved_tensors
        xs, weights = pairs[0::2], pairs[1::2]
        k, group = ctx.k, ctx.group
        tp = dist.get_world_size(group)
        widths = [x.shape[-1] for x in xs]
        w = _fused(weights, 1)
        grad_xs = [torch.empty_like(x) for x in xs]
        grad_x_views = [_tp_chunk_view(g, tp, k) for g in grad_xs]
        x_views = [_tp_chunk_view(x, tp, k) for x in xs]
        # Summed in fp32, rounded once (see the all-gather side's backward).
        grad_w = torch.zeros_like(w, dtype=torch.promote_types(w.dtype, torch.float32))
        rank = dist.get_rank(group)
        rows = _ChunkedReduceScatterLinear._rows

        def gemms(g: torch.Tensor, index) -> None:
            """Input and weight gradients of the rows ``index`` from their output gradient."""
            g = g.reshape(-1, g.shape[-1])
            gx = torch.matmul(g, w)
            for grad_x_view, part in zip(grad_x_views, gx.split(widths, -1), strict=True):
                grad_x_view[index] = part.view(grad_x_view[index].shape)
            grad_w.add_(g.t().matmul(rows(x_views, index)))

        grad_local = grad_out_local.contiguous()
        gathered = _gathered_one_ahead(grad_local, k, group, lambda: gemms(grad_local, rank))
        for j, g in enumerate(gathered):
            for others in _others(rank, tp):
                gemms(g[others], (others, j))
        grad_ws = [gw.contiguous() for gw in grad_w.to(w.dtype).split(widths, 1)]
        grads = [t for pair in zip(grad_xs, grad_ws, strict=True) for t in pair]
        return (None, None, *grads)


def all_gather_linears(x_local: torch.Tensor, weights: list, k: int, group) -> tuple:
    """Each ``all_gather_seq(x_local) @ w^T``, the gather chunked ``k`` ways and pipelined with the
    GEMMs (one shared gather for every weight)."""
    out = _ChunkedAllGatherLinear.apply(x_local, k, group, *weights)
    return out if isinstance(out, tuple) else (out,)


def linears_reduce_scatter(pairs: list[tuple], k: int, group) -> torch.Tensor:
    """``reduce_scatter_seq(sum of x @ w^T over (x, w) in pairs)``, the GEMMs chunked ``k`` ways
    and each chunk's reduce-scatter overlapped with the next chunk's GEMMs."""
    flat = [t for pair in pairs for t in pair]
    return _ChunkedReduceScatterLinear.apply(k, group, *flat)


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
        gather_output = (
            self.gather_output if runtime_gather_output is None else runtime_gather_output
        )
        if not (self.sequence_parallel and k > 1 and not gather_output):
            return super().forward(input_, weight, runtime_gather_output)
        # ``weight``: the output layer's, passed in when tied to the embedding.
        (output,) = all_gather_linears(
            input_, [self.weight if weight is None else weight], k, self.tp_group
        )
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
        output = linears_reduce_scatter([(input_, self.weight)], k, self.tp_group)
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
        self.precomputed: torch.Tensor | None = None
        """Set by the caller just before ``forward`` when it has run this GEMM itself (pipelined
        with the gather); ``forward`` then returns it (plus bias) instead of its input's GEMM."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if self.precomputed is not None:
            output, self.precomputed = self.precomputed, None
        else:
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
        self.defer_gemm = False
        """When set, ``forward`` returns its input unmultiplied: the caller runs the GEMM itself,
        pipelined with the reduce-scatter (``linears_reduce_scatter``)."""

    def forward(self, input_):
        if self.defer_gemm:
            return input_, self.bias
        return _matmul(input_, self.weight), self.bias
