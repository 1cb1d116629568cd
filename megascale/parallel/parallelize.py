"""Wrap this rank's model chunks for data parallelism and pick the pipeline schedule.

``parallelize`` composes, in this order:

1. tensor and sequence parallelism: already in the modules (megatron-core's column/row-parallel
   linears, built by ``megascale.model.build_gpt`` from ``parallel.tp``/``sequence_parallel``);
2. pipeline parallelism: each chunk is one virtual stage (``build_model_chunks``); the schedule
   (1F1B or interleaved 1F1B) comes from ``forward_backward_func``;
3. data parallelism: ``apply_ddp`` wraps every chunk in megatron-core's DDP over contiguous grad
   buffers (ZeRO-1 sharding with the distributed optimizer), and registers
   ``finalize_model_grads`` (DP grad sync, SP LayerNorm grads, tied embedding grads).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.transformer import TransformerConfig

from megascale.config import JobConfig
from megascale.model.gpt import build_gpt, init_parameters
from megascale.overlap.dp import pending_param_sync
from megascale.parallel.groups import Groups


def build_model_chunks(
    job: JobConfig, config: TransformerConfig, groups: Groups, *, use_te: bool, device: str
) -> list[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage held by this rank, initialised by global name."""
    from megatron.core import parallel_state as ps

    vpp = job.parallel.vpp
    chunks = []
    for v in range(vpp):
        vp_stage = v if vpp > 1 else None
        model = build_gpt(
            job,
            config,
            use_te=use_te,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
            pg_collection=groups.pg_collection,
        )
        if device == "cuda":
            model.cuda(torch.cuda.current_device())
        init_parameters(
            model,
            config,
            job.train.seed,
            vp_stage=vp_stage,
            pp_rank=groups.pp_rank,
            tp_rank=groups.tp_rank,
            tp_size=groups.layout.tp,
        )
        chunks.append(model)
    return chunks


def apply_ddp(
    chunks: list[torch.nn.Module], config: TransformerConfig, job: JobConfig, groups: Groups
) -> list[DistributedDataParallel]:
    """Wrap each chunk in megatron-core DDP; grads reduce in fp32 into contiguous buckets.

    With ``overlap.dp`` each bucket's reduce-scatter starts from a backward hook as soon as the
    bucket is ready, and (distributed optimizer) parameter all-gathers are waited for in forward
    pre-hooks one bucket ahead: see ``megascale.overlap.dp``.
    """
    overlap = job.overlap.dp
    gather = overlap and job.parallel.distributed_optimizer
    # Interleaved: the schedule dispatches every chunk's param all-gather ahead of its first
    # forward (config.param_sync_func below); without it a later chunk's first gather waits at once.
    align = gather and len(chunks) > 1
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=job.parallel.distributed_optimizer,
        overlap_grad_reduce=overlap,
        overlap_param_gather=gather,
        align_param_gather=align,
        bucket_size=job.overlap.bucket_size,
        check_for_nan_in_grad=True,
    )
    wrapped = [
        DistributedDataParallel(
            config,
            ddp_config,
            chunk,
            # Only the first chunk's buckets may be split: later chunks' grads are ready earlier.
            disable_bucketing=(i > 0),
            pg_collection=groups.pg_collection,
        )
        for i, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    if overlap:
        # The schedule suppresses grad sync for all but the last micro-batch through no_sync; without
        # it every micro-batch's backward would launch the bucket reduce-scatters.
        no_sync = [chunk.no_sync for chunk in wrapped]
        config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    if align:
        config.param_sync_func = [pending_param_sync(chunk) for chunk in wrapped]
    return wrapped


def parallelize(
    job: JobConfig, config: TransformerConfig, groups: Groups, *, use_te: bool, device: str
) -> list[DistributedDataParallel]:
    """Build and wrap this rank's model chunks (see the module docstring for the order)."""
    chunks = build_model_chunks(job, config, groups, use_te=use_te, device=device)
    return apply_ddp(chunks, config, job, groups)


def forward_backward_func(job: JobConfig, groups: Groups) -> Callable:
    """megatron-core's schedule for the configured layout: no pipelining, 1F1B, or interleaved;
    plain 1F1B with ``overlap.pp`` runs with decoupled, posted-ahead p2p (``overlap.pp``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    stream_ordered = dist.is_initialized() and dist.get_backend() == "nccl"
    if job.overlap.pp_decoupled(job.parallel) and not stream_ordered:
        from megascale.overlap.pp import overlapped_1f1b

        return overlapped_1f1b(groups)
    return get_forward_backward_func()
