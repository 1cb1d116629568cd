"""The trainer: model, optimizer, data and schedule for one rank; ``Trainer.step`` is the whole step.

Construction order (each a function you can grep): ``transformer_config`` -> ``parallelize``
(build_gpt per virtual stage, init by global name, DDP) -> ``build_optimizer`` -> ``build_scheduler``
-> ``build_splits`` (megatron-core datasets of the blend) -> ``train_batches`` (``data.loader``). ``Trainer.evaluate``
is the validation loss. Checkpoint save/load lives in ``megascale.train.checkpoint``.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megascale.config import JobConfig
from megascale.data.corpus import default_token_file
from megascale.data.dataset import build_splits, eval_batches
from megascale.data.indexed import DataError
from megascale.data.node_loader import train_batches
from megascale.messages import StepMetrics
from megascale.model.gpt import transformer_config, use_te_spec
from megascale.overlap.dp import ParamGatherPrefetch
from megascale.overlap.tp_plan import init_te_userbuffers, plan_for_this_rank
from megascale.parallel.groups import Groups
from megascale.parallel.parallelize import forward_backward_func, parallelize
from megascale.probes.compute_time import ComputeMeter
from megascale.probes.flops import flops_per_token
from megascale.probes.peak import Peak
from megascale.probes.profiling import NULL_NVTX, peak_memory_gib, reset_peak_memory, rss_gib
from megascale.probes.timers import NULL_TIMELINE, NullTimeline, Timeline
from megascale.train.optimizer import build_optimizer, build_scheduler

logger = logging.getLogger(__name__)


class Trainer:
    """Trains one rank's part of the model. Collective: every rank of the job constructs one and
    calls ``step`` the same number of times."""

    def __init__(
        self,
        job: JobConfig,
        groups: Groups,
        device: str,
        *,
        data_cache_dir: Path,
        peak: Peak | None = None,
        timeline: Timeline | NullTimeline = NULL_TIMELINE,
    ) -> None:
        self.job, self.groups, self.device = job, groups, device
        use_te = use_te_spec(job.model, device)
        self.tp_overlap = plan_for_this_rank(job, use_te)
        self.config = transformer_config(job, device, self.tp_overlap)
        init_te_userbuffers(self.tp_overlap, self.config.params_dtype)  # before the TE modules
        self.model = parallelize(job, self.config, groups, use_te=use_te, device=device)
        self.optimizer = build_optimizer(
            job.optim,
            self.model,
            use_distributed_optimizer=job.parallel.distributed_optimizer,
            bf16=job.model.params_dtype == "bf16",
        )
        self.scheduler = build_scheduler(job.optim, self.optimizer, job.train.steps)
        train_data, self.valid_data = build_splits(
            job, _default_prefix(job, data_cache_dir), _index_cache_dir(job, data_cache_dir)
        )
        # data.loader: one loader per machine in shared memory ("node") or per rank ("rank").
        # megatron-core feeds a middle pipeline stage the previous stage's activations: no tokens.
        needs_tokens = groups.is_first_stage or groups.is_last_stage
        self.data = train_batches(
            job, train_data, groups.dp_rank, groups.layout.dp, needs_tokens=needs_tokens
        )
        self.forward_backward = forward_backward_func(job, groups)
        self.param_prefetch = ParamGatherPrefetch(self.model)
        self.tokens_per_step = job.train.global_batch_size * job.model.seq_length
        self.flops_per_token = flops_per_token(job.model).total
        self.peak = peak
        """What MFU is measured against (None: MFU not reported)."""
        self.step_num = 0
        self.resumed_from: int | None = None
        """The step of the checkpoint this trainer was loaded from (None: trained from scratch)."""
        # megatron-core's own timers (micro-batch forward/backward, p2p, grad sync) report here too.
        self.timeline = timeline
        timeline.attach(self.config, self.optimizer)
        # Forward and backward compute per step, on the device (the straggler signal); it stands
        # in front of the timeline's timers and leaves them working.
        self.compute = ComputeMeter(device, blocked_s=_blocked_seconds()).install(self.config)
        # NVTX ranges for Nsight Systems around the schedule and the optimizer (train.nvtx, set by
        # the run loop, which puts the step's own range around step()); null by default.
        self.nvtx = NULL_NVTX
        self._state_readers: list[torch.cuda.Event] = []

    def reading_state(self, done: torch.cuda.Event) -> None:
        """A copy of the training state is in flight on another CUDA stream until ``done``: the
        next update (the optimizer's step, which writes the state in place) waits for it on the
        device; the host does not wait."""
        self._state_readers.append(done)

    def step(self) -> StepMetrics:
        """One optimizer step: data -> forward/backward schedule -> grad sync -> clip -> update."""
        self.timeline.step_begin(self.step_num + 1)
        reset_peak_memory(self.device)  # the step's peak: mem_max_*_gib
        start = time.perf_counter()
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        # MegaScale: the first bucket's param all-gather is in flight while the batch is read; the
        # first forward pre-hook waits for it (overlap.dp with the distributed optimizer).
        self.param_prefetch.start()
        data_start = time.perf_counter()
        with self.timeline.span("megascale::data::wait"):
            micro_batches = self.data.next_step()
        data_wait = time.perf_counter() - data_start
        self.compute.begin(self.step_num + 1)
        with self.nvtx.range("megascale::schedule::forward_backward"):
            losses = self._schedule(micro_batches, forward_only=False)
        self.compute.end()
        # finalize_model_grads (registered by apply_ddp) has synced grads over DP, SP and the tied
        # embedding; step() clips by the global norm and updates (all-gathering params if sharded).
        lr = self.optimizer.param_groups[0]["lr"]  # the lr this step runs at
        optim_span = "megascale::optim::step"
        for done in self._state_readers:  # an in-memory snapshot's copy to host memory
            torch.cuda.current_stream().wait_event(done)
        self._state_readers.clear()
        with self.timeline.span(optim_span), self.nvtx.range(optim_span):
            updated, grad_norm, _ = self.optimizer.step()
        if not updated:
            raise FloatingPointError(f"step {self.step_num + 1}: non-finite gradients")
        self.scheduler.step(increment=1)
        loss = self._mean_loss(losses)
        self.timeline.step_end()
        self.step_num += 1
        elapsed = time.perf_counter() - start
        tokens_per_s = self.tokens_per_step / elapsed
        mfu = None
        if self.peak is not None:
            world = self.groups.layout.world_size
            mfu = tokens_per_s * self.flops_per_token / (world * self.peak.tflops * 1e12)
        mem_allocated, mem_reserved = peak_memory_gib(self.device)
        return StepMetrics(
            step=self.step_num,
            loss=loss,
            grad_norm=float(grad_norm),
            lr=lr,
            step_time_s=elapsed,
            tokens_per_s=tokens_per_s,
            mfu=mfu,
            data_wait_s=data_wait,
            mfu_peak_tflops=None if self.peak is None else self.peak.tflops,
            mfu_peak_source=None if self.peak is None else self.peak.source,
            mem_max_allocated_gib=mem_allocated,
            mem_max_reserved_gib=mem_reserved,
            mem_rss_gib=rss_gib(),
        )

    def evaluate(self) -> float:
        """Mean loss over ``train.eval_steps`` global batches of the valid split (the same ones
        every time), with the training forward path and no gradients. Collective; every rank
        returns the same value. Raises DataError when ``data.split`` gives no valid share."""
        if self.valid_data is None:
            raise DataError(f"data.split = {self.job.data.split!r}: no valid split to evaluate")
        hooked = [c for c in self.model if getattr(c, "use_forward_hook", False)]
        for chunk in hooked:  # gathers the updated params once, as megatron-core's evaluate does
            chunk.disable_forward_pre_hook(param_sync=True)
        for chunk in self.model:
            chunk.eval()
        try:
            losses = []
            layout = self.groups.layout
            with torch.no_grad():
                for micro_batches in eval_batches(
                    self.valid_data, self.job, self.groups.dp_rank, layout.dp
                ):
                    losses.append(self._mean_loss(self._schedule(micro_batches, True)))
        finally:
            for chunk in self.model:
                chunk.train()
            for chunk in hooked:
                chunk.enable_forward_pre_hook()
        return sum(losses) / len(losses)

    def _schedule(self, micro_batches: list[dict], forward_only: bool) -> list[dict]:
        """megatron-core's schedule (1F1B / interleaved / none) over these micro-batches."""
        # Every virtual stage walks the same micro-batches; the schedule interleaves them.
        iterators = [iter(micro_batches) for _ in self.model]
        return self.forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=iterators if len(self.model) > 1 else iterators[0],
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=len(micro_batches),
            seq_length=self.job.model.seq_length,
            micro_batch_size=self.job.train.micro_batch_size,
            forward_only=forward_only,
        )

    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)  # empty on a middle pipeline stage under data.loader "node"
        tokens, labels, loss_mask, position_ids = (
            batch[key].to(self.device, non_blocking=True) if key in batch else None
            for key in ("tokens", "labels", "loss_mask", "position_ids")
        )
        # On the last stage the model returns per-token cross entropy [b, s]; elsewhere activations.
        output = model(tokens, position_ids, None, labels=labels)

        def loss_func(per_token_loss: torch.Tensor):
            loss = (per_token_loss.float() * loss_mask).sum() / loss_mask.sum()
            # The schedule divides the returned loss by the number of micro-batches in place, so
            # the reported value must be a copy, not a view.
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    def _mean_loss(self, losses: list[dict]) -> float:
        """The step's loss on every rank: mean over micro-batches and DP ranks, sent along PP."""
        if self.groups.is_last_stage:
            local = torch.stack([d["lm loss"] for d in losses]).mean()
        else:
            local = torch.zeros((), device=self.device)
        local = local.to(self.device, torch.float32).reshape(1)
        dist.all_reduce(local, group=self.groups.pp)  # only the last stage contributes
        dist.all_reduce(local, group=self.groups.dp)
        value = float(local) / self.groups.layout.dp
        if not math.isfinite(value):
            raise FloatingPointError(f"step {self.step_num + 1}: loss is {value}")
        return value


def _blocked_seconds():
    """How long this process has been blocked in communication so far, as a callable: the flight
    recorder's count when one is installed (training installs it), else None."""
    from megascale.probes.flight.recorder import installed_recorder

    recorder = installed_recorder()
    return None if recorder is None else (lambda: recorder.blocked_s)


def _default_prefix(job: JobConfig, cache_dir: Path) -> Path | None:
    """The built-in corpus when the job names no data (built here if absent)."""
    if job.data.path is not None or job.data.blend is not None:
        return None
    # Each rank may build the default corpus at once; default_token_file renames atomically.
    return default_token_file(cache_dir)


def _index_cache_dir(job: JobConfig, data_dir: Path) -> Path:
    """megatron-core's index cache: ``data.cache_dir``, else ``RUN_DIR/data/index-cache``."""
    return Path(job.data.cache_dir) if job.data.cache_dir else Path(data_dir) / "index-cache"
