"""Data-parallel overlap: megatron-core's bucketed grad reduce-scatter and param all-gather, plus
MegaScale's prefetch of the first all-gather at the start of the iteration.

What megatron-core already does right (configured by ``ddp_config``, not re-implemented):

* ``overlap_grad_reduce``: each bucket's reduce-scatter (all-reduce without the distributed
  optimizer) is issued from a backward hook as soon as the bucket's last gradient is ready, so it
  runs while backward computes earlier layers; ``finish_grad_sync`` waits for them at the end.
* ``overlap_param_gather`` (distributed optimizer): after the optimizer step each rank holds only
  its shard of the updated parameters; the all-gather of bucket ``i`` is waited for in the forward
  pre-hook of the first module using it, and that wait dispatches bucket ``i+1``'s all-gather, so
  gathering overlaps the forward pass one bucket ahead.

What it leaves exposed, and MegaScale fixes: the *first* bucket's all-gather is only dispatched by
the first forward pre-hook, which then waits for it at once. ``ParamGatherPrefetch.start`` issues it
at the very start of the iteration, before data loading, so it is in flight while the batch is read;
the forward pre-hook's wait finds it (nearly) done.

With interleaving (several model chunks) a chunk's bucket chain starts only at its own first
forward pre-hook, so each later chunk's first gather would be waited for at once. There
megatron-core's ``align_param_gather`` is on and the schedule dispatches each chunk's gathers ahead
of its first forward (``config.param_sync_func``, one ``pending_param_sync`` per chunk): chunk 0's
and 1's at the start of the schedule, chunk k+1's during chunk k's first forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


class ParamGatherPrefetch:
    """Start/finish pair around the first bucket all-gather of the first model chunk.

    Contract: call ``start()`` once per iteration after the grad buffers are zeroed (``zero_grad_buffer``
    resets the "dispatched" flags) and before data loading; ``finish()`` is optional — the first
    forward pre-hook waits for the handle — and idempotent. A no-op unless the chunk overlaps its param
    all-gather (distributed optimizer + ``overlap_param_gather``).
    """

    def __init__(self, model_chunks: list) -> None:
        first = model_chunks[0] if model_chunks else None
        config = getattr(first, "ddp_config", None)
        enabled = bool(
            config is not None
            and config.use_distributed_optimizer
            and config.overlap_param_gather
            and first.bucket_groups
        )
        # Buckets are built in reverse parameter order, so the last bucket group holds the first
        # layers' parameters: the first the forward pass needs.
        self._bucket_group = first.bucket_groups[-1] if enabled else None

    @property
    def enabled(self) -> bool:
        return self._bucket_group is not None

    def start(self) -> None:
        group = self._bucket_group
        if group is None or group.param_gather_dispatched:
            return
        group.start_param_sync()

    def finish(self) -> None:
        group = self._bucket_group
        if group is None or not group.param_gather_dispatched:
            return
        # Dispatches the next bucket's gather too, exactly as the forward pre-hook would.
        group.finish_param_sync()


def pending_param_sync(chunk) -> Callable[..., None]:
    """The schedule's ``param_sync_func`` for ``chunk``: dispatch the param all-gather of every
    bucket group of the chunk not dispatched yet this iteration (``ParamGatherPrefetch`` may have
    started the first one before data loading; dispatching it twice is an error in
    megatron-core). Asynchronous; the forward pre-hooks wait."""

    def start(*_unused) -> None:
        for group in chunk.bucket_groups:
            if not group.param_gather_dispatched:
                group.start_param_sync()

    return start


def sync_params(model_chunks: list) -> None:
    """Make this rank's parameters current before reading them (checkpoint, digest).

    With an overlapped param all-gather, a rank holds only its own shard of the updated parameters
    between the optimizer step and the forward pre-hooks of the next iteration. Collective.
    """
    for chunk in model_chunks:
        config = getattr(chunk, "ddp_config", None)
        if config is None or not (config.use_distributed_optimizer and config.overlap_param_gather):
            continue
        if chunk.intra_dp_cp_group.size() > 1:  # one DP rank holds every shard already
            chunk.start_param_sync(force_sync=True)
