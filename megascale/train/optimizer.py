"""The optimizer and LR schedule: megatron-core's optimizer wrappers, with LAMB swapped in when asked.

``build_optimizer`` always goes through ``megatron.core.optimizer.get_megatron_optimizer``, so mixed
precision (fp32 main params), the distributed optimizer (ZeRO-1 flat shards), global gradient
clipping over TP/PP/DP and checkpoint formats are megatron-core's own code.

* ``optim.name = "adam"`` is AdamW: ``OptimizerConfig(optimizer="adam",
  decoupled_weight_decay=True)`` makes megatron-core 0.16 build ``torch.optim.AdamW`` (or TE/apex
  ``FusedAdam(adam_w_mode=True)`` where those are installed); see ``optimizer/__init__.py``,
  ``_get_megatron_optimizer_based_on_param_groups``.
* ``optim.name = "lamb"`` builds the very same wrappers configured as Adam (the distributed
  optimizer asserts an Adam inner optimizer at construction time), then, before any step, replaces
  each wrapper's inner torch optimizer by :class:`~megascale.train.lamb.Lamb` over the *same*
  ``param_groups`` (the same dicts: megatron's per-group ``wd_mult``/``max_lr``/... keys and the
  scheduler keep working) and gives it a norm reducer from :func:`make_norm_reducer`, so trust
  ratios use whole-parameter norms whatever the TP size and DP sharding.

Both: the inner optimizer's ``load_state_dict`` gets a post-hook that un-aliases the per-param
``step`` tensors megatron-core's distributed optimizer restores as one shared object (without it,
torch AdamW's in-place increments make a resumed run drift from an uninterrupted one).

apex ``FusedLAMB`` is never used, even where apex is installed: it computes each trust ratio from
the tensor it is handed (a distributed-optimizer shard is not a parameter, and a TP-split weight is
not the whole weight), offers no hook to reduce norms across ranks, and clips gradients by a norm it
computes locally. It would only be right with TP=1 and no distributed optimizer, and its
``use_nvlamb=False`` default exempts ``weight_decay == 0`` groups, another convention again.

Expert-parallel (MoE) parameter groups are refused under LAMB: expert weights are split over the
expert-TP group, which this module does not wire up.
"""

from __future__ import annotations

import logging

import torch
from megatron.core.optimizer import (
    ChainedOptimizer,
    DistributedOptimizer,
    MegatronOptimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megascale.config import OptimConfig
from megascale.train.lamb import Lamb, SlotNormReducer

logger = logging.getLogger(__name__)

OPTIMIZER_NAMES = ("adam", "lamb")


def build_optimizer(
    cfg: OptimConfig,
    model_chunks: list,
    *,
    use_distributed_optimizer: bool,
    bf16: bool,
    pg_collection=None,
) -> MegatronOptimizer:
    """megatron-core optimizer for ``model_chunks`` (DDP-wrapped, one per virtual pipeline stage).

    ``use_distributed_optimizer`` must match the chunks' ``ddp_config`` (the DDP buffers are laid
    out for it). Gradients are clipped to ``cfg.clip_grad`` inside ``optimizer.step()``. Learning
    rate and per-group weight decay (0 for biases and 1-D params, megatron's ``wd_mult``) are set by
    :func:`build_scheduler`: build it before the first step. Never with gloo twins of the
    data-parallel groups (megatron-core needs them only for its dp-zero checkpoint format, which
    megascale does not use; ``parallel.build_groups`` does not create them).
    """
    if cfg.name not in OPTIMIZER_NAMES:
        raise ValueError(f"optim.name={cfg.name!r}: expected one of {OPTIMIZER_NAMES}")
    for i, chunk in enumerate(model_chunks):
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None:
            raise TypeError(
                f"model_chunks[{i}] is a {type(chunk).__name__}; expected a megatron-core "
                "DistributedDataParallel wrapper (it carries ddp_config and the grad buffers)"
            )
        if ddp_config.use_distributed_optimizer != use_distributed_optimizer:
            raise ValueError(
                f"use_distributed_optimizer={use_distributed_optimizer} but model_chunks[{i}] "
                f"was wrapped with use_distributed_optimizer="
                f"{ddp_config.use_distributed_optimizer}; they must agree"
            )
    mcore_config = OptimizerConfig(
        optimizer="adam",  # also for LAMB: the wrappers are built for Adam, then swapped below
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.beta1,
        adam_beta2=cfg.beta2,
        adam_eps=cfg.eps,
        decoupled_weight_decay=True,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
        clip_grad=cfg.clip_grad,
    )
    optimizer = get_megatron_optimizer(
        mcore_config,
        model_chunks,
        use_gloo_process_groups=False,  # build_groups creates none (docs/scale.md)
        pg_collection=pg_collection,
    )
    if cfg.name == "lamb":
        install_lamb(optimizer)
    for sub in _sub_optimizers(optimizer):
        if isinstance(sub.optimizer, torch.optim.Optimizer):
            sub.optimizer.register_load_state_dict_post_hook(_unshare_step_tensors)
    return optimizer


def build_scheduler(
    cfg: OptimConfig, optimizer: MegatronOptimizer, total_steps: int
) -> OptimizerParamScheduler:
    """Linear warm-up from 0 to ``cfg.lr`` over ``cfg.warmup_steps``, then cosine decay to
    ``cfg.min_lr`` at ``total_steps``; constant weight decay ``cfg.weight_decay`` times each
    group's ``wd_mult``.

    Optimizer step ``k`` (1-based) runs at the schedule's value for ``k``: the returned scheduler is
    already advanced to step 1 (megatron-core would start at step 0, i.e. lr 0 with warm-up, a
    wasted step), and the trainer calls ``scheduler.step(1)`` after every optimizer step, so the
    last step runs at ``cfg.min_lr``. Construction writes lr and weight decay into every group.
    """
    if total_steps <= cfg.warmup_steps:
        raise ValueError(
            f"total_steps={total_steps} with optim.warmup_steps={cfg.warmup_steps}: the decay "
            "needs total_steps > warmup_steps"
        )
    if not 0.0 <= cfg.min_lr <= cfg.lr:
        raise ValueError(f"optim.min_lr={cfg.min_lr}: expected 0 <= min_lr <= lr ({cfg.lr})")
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.warmup_steps,
        lr_decay_steps=total_steps,
        lr_decay_style="cosine",
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=total_steps,
        wd_incr_style="constant",
        # A resumed run must be configured like the checkpoint; a mismatch fails loudly.
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False,
    )
    scheduler.step(increment=1)
    return scheduler


def install_lamb(optimizer: MegatronOptimizer) -> None:
    """Replace the inner torch optimizer of every (chained) megatron-core optimizer by ``Lamb``.

    Call before the first step: the Adam being replaced must hold no state yet. Each sub-optimizer
    gets the norm reducer of :func:`make_norm_reducer` with the groups megatron-core recorded on it
    (``optimizer.tp_group``; the distributed optimizer's ``data_parallel_group``).
    """
    for sub in _sub_optimizers(optimizer):
        inner = sub.optimizer
        if inner is None:  # a stub: this rank has no trainable params in it
            continue
        if len(inner.state) != 0:
            raise RuntimeError(
                "install_lamb after the optimizer has stepped: Adam state would be lost"
            )
        if any(group.get("is_expert_parallel", False) for group in inner.param_groups):
            raise NotImplementedError(
                "optim.name='lamb' with expert-parallel (MoE) parameters is not supported"
            )
        config = sub.config
        if config.use_precision_aware_optimizer:
            raise ValueError("use_precision_aware_optimizer=True needs TE FusedAdam, not LAMB")
        lamb = Lamb.adopting(
            inner.param_groups,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        lamb.norm_reducer = make_norm_reducer(sub)
        sub.optimizer = lamb
        logger.debug(
            "LAMB installed in %s (%d tensors)", type(sub).__name__, len(sub.get_parameters())
        )


def make_norm_reducer(
    optimizer: MegatronOptimizer, *, tp_group=None, dp_group=None
) -> SlotNormReducer:
    """Whole-parameter norm reducer for the inner optimizer of one non-chained megatron optimizer.

    * ``DistributedOptimizer``: slots are the model params of its grad buffers, in buffer order
      (identical on every DP and TP rank: the buffers are laid out the same everywhere). Inner param
      ``i`` of group ``g`` is the shard of ``[*model_fp32_groups[g], *model_float16_groups[g]][i]``
      (the order in which the optimizer wrote the group's params). Partial norms are summed over
      ``dp_group`` (default: the optimizer's ``data_parallel_group``, the group its buffers are
      sharded over, with context parallelism folded in).
    * ``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer``: every inner param (an fp32 main
      copy, or the fp32 model param) is a whole param and its own slot; no DP reduction.

    In both cases slots of params with ``tensor_model_parallel=True`` are summed over ``tp_group``
    (default: ``optimizer.tp_group``, which ``get_megatron_optimizer`` sets); the attribute is read
    from the model param (the distributed optimizer) or the inner param (megatron copies it onto
    main params). Pipeline stages need no reduction: a param lives on one stage (tied embeddings are
    two identical copies that get identical updates).
    """
    if isinstance(optimizer, ChainedOptimizer):
        raise TypeError("make_norm_reducer takes one sub-optimizer; see install_lamb for chains")
    if tp_group is None:
        tp_group = getattr(optimizer, "tp_group", None)
    inner_params = [p for group in optimizer.optimizer.param_groups for p in group["params"]]
    if not isinstance(optimizer, DistributedOptimizer):
        tp_split = [_is_tp_split(p) for p in inner_params]
        device = inner_params[0].device if inner_params else None
        return SlotNormReducer(range(len(inner_params)), tp_split, tp_group=tp_group, device=device)

    if not hasattr(optimizer, "buffers"):
        raise NotImplementedError("LAMB with megatron FSDP (use_megatron_fsdp) is not supported")
    if dp_group is None:
        dp_group = optimizer.data_parallel_group
    slots: dict[torch.nn.Parameter, int] = {}
    for buffer in optimizer.buffers:
        for param in buffer.params:
            slots.setdefault(param, len(slots))
    owners: list[torch.nn.Parameter] = []
    for g, group in enumerate(optimizer.optimizer.param_groups):
        group_owners = [*optimizer.model_fp32_groups[g], *optimizer.model_float16_groups[g]]
        if len(group_owners) != len(group["params"]):
            raise RuntimeError(
                f"param group {g} holds {len(group['params'])} shards but the distributed "
                f"optimizer maps {len(group_owners)} model params to it (megatron-core layout "
                "changed?)"
            )
        owners.extend(group_owners)
    missing = [p for p in owners if p not in slots]
    if missing:
        raise RuntimeError(f"{len(missing)} optimizer params are in none of the grad buffers")
    return SlotNormReducer(
        [slots[p] for p in owners],
        [_is_tp_split(p) for p in slots],
        dp_group=dp_group,
        tp_group=tp_group,
        device=next(iter(slots)).device if slots else None,
    )


def _sub_optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    if isinstance(optimizer, ChainedOptimizer):
        return list(optimizer.chained_optimizers)
    return [optimizer]


def _unshare_step_tensors(inner: torch.optim.Optimizer) -> None:
    """Post-hook of the inner optimizer's ``load_state_dict``.

    Without TE/apex, megatron-core 0.16's ``DistributedOptimizer.load_state_dict`` puts *one* step
    tensor object into every param's state (``s["step"] = step``, distrib_optimizer.py:818-825)
    and ``torch.optim.Optimizer.load_state_dict`` keeps the aliasing. torch's AdamW increments
    steps in place, so after a resume the step grew by the number of params per step (seen: 1, 5,
    9 with 4 params): wrong bias correction, and a resumed run no longer equals an uninterrupted
    one. Give each param its own copy. (Lamb never increments in place; this is for AdamW.)
    """
    for state in inner.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            state["step"] = step.clone()


def _is_tp_split(param: torch.Tensor) -> bool:
    # The attribute megatron's layers set; megatron-core's param_is_not_tensor_parallel_duplicate
    # (tensor_parallel/layers.py) reads the same one.
    return bool(getattr(param, "tensor_model_parallel", False))
