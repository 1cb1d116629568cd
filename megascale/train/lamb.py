"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning") that stays correct when each
rank only holds a piece of a parameter.

LAMB is Adam with a per-parameter *trust ratio*: the Adam step ``u`` (plus decoupled weight decay) is
rescaled by ``||w|| / ||u||`` before it is applied. Both norms are over the **whole logical
parameter**. Under megatron-core's distributed optimizer a rank's torch optimizer sees flat shards
(a slice of one parameter, or nothing of it), and under tensor parallelism a parameter marked
``tensor_model_parallel`` is split over the TP group. A shard-local norm would give every shard a
different trust ratio and the run would silently diverge from a single-process run.

So :class:`Lamb` never computes a trust ratio from local data alone. One step is:

1. Adam moments and the update ``u`` for every local tensor; the *partial squared norms* of ``w``
   and ``u`` for every tensor of the optimizer, in param-group order (two 1-D vectors).
2. One call to ``norm_reducer(w_sq, u_sq)`` that turns partial squared norms into whole-parameter
   squared norms (a collective: one call per step for the whole optimizer, never one per param).
3. ``w -= lr * trust_ratio * u`` for every tensor.

The default reducer is the identity (every tensor is a whole parameter). :class:`SlotNormReducer`
is the sharded one: it knows which whole parameter ("slot") each local tensor belongs to and which
slots are split over TP. ``megascale.train.optimizer.make_norm_reducer`` derives that mapping from
a megatron-core optimizer.

Conventions (the unit test's reference implementation follows the same ones):

* decoupled weight decay (AdamW style): ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w``;
* bias correction on by default (``bias_correction`` per group);
* trust ratio ``||w|| / ||u||``, and 1.0 when either norm is 0 (a zero-initialised tensor, or a
  tensor whose update is exactly zero);
* the trust ratio applies to **every** parameter, biases and norms included, as in NVIDIA's
  apex ``FusedLAMB(use_nvlamb=True)`` and most LAMB ports. A group can opt out with
  ``layer_adaptation=False`` (it then takes plain AdamW steps). We keep it on everywhere because
  megatron-core puts biases and norms in their own group with ``weight_decay == 0`` only after the
  LR scheduler's first call, so keying the choice off ``weight_decay`` would make it depend on
  call order.
* no clipping of the trust ratio and no gradient clipping inside: megatron-core's wrapper clips
  the global gradient norm (over TP/PP/DP) before the inner step.

State: per parameter ``exp_avg``, ``exp_avg_sq`` (same dtype and shape as the parameter) and
``step`` (a float32 CPU scalar tensor), exactly the keys and layout of ``torch.optim.Adam``, so
megatron-core's distributed-optimizer checkpointing (which reads ``exp_avg``/``exp_avg_sq`` from
``optimizer.state[p]`` and the step either from ``state[p]["step"]`` or, when TE/apex are
installed, from ``param_group["step"]``) works unchanged. Each group also carries ``step`` (int).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

NormReducer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``(w_sq, u_sq) -> (w_sq_full, u_sq_full)``: 1-D float32 tensors with one entry per tensor of the
optimizer in param-group order (tensors without a gradient this step contribute 0). It is called
exactly once per ``Lamb.step()`` on every rank, so it may run collectives."""


def identity_norm_reducer(w_sq: torch.Tensor, u_sq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every local tensor is a whole parameter: partial norms are already the full norms."""
    return w_sq, u_sq


class Lamb(torch.optim.Optimizer):
    """LAMB with decoupled weight decay and a pluggable whole-parameter norm reduction.

    Args:
        params: parameters or param-group dicts, as for any torch optimizer. Group dicts may carry
            extra keys (megatron-core's ``wd_mult``, ``max_lr``...); they are kept untouched.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        bias_correction: divide the moments by ``1 - beta**step`` (group key of the same name).
        layer_adaptation: apply the trust ratio (group key of the same name; see module docstring).
        norm_reducer: see :data:`NormReducer`; ``None`` means :func:`identity_norm_reducer`. It can
            also be set later through the ``norm_reducer`` attribute (it is not saved in the state
            dict: it describes this process's sharding, not the training state).

    ``step()`` must be called on every rank that shares the reducer's process groups, every step,
    even where this rank holds no tensor of the optimizer: the reducer's collective must match.
    Memory: the update of every local tensor is held until the reduced norms are known (one extra
    fp32 copy of this rank's shard, transient).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        bias_correction: bool = True,
        layer_adaptation: bool = True,
        norm_reducer: NormReducer | None = None,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"lr={lr}: expected a value >= 0")
        if eps <= 0.0:
            raise ValueError(f"eps={eps}: expected a value > 0")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}]={beta}: expected a value in [0, 1)")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay={weight_decay}: expected a value >= 0")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            layer_adaptation=layer_adaptation,
        )
        super().__init__(params, defaults)
        self.norm_reducer: NormReducer = norm_reducer or identity_norm_reducer

    @classmethod
    def adopting(cls, param_groups: list[dict[str, Any]], **kwargs: Any) -> Lamb:
        """A Lamb that takes over existing param-group dicts as they are: the same dict objects, no
        copy, no leaf check. This is how megatron-core's distributed optimizer installs its shard
        groups (``optimizer.param_groups = ...``), and its shards are views of the model params,
        which ``torch.optim.Optimizer.add_param_group`` would refuse as non-leaf tensors. Keys a
        group lacks get the defaults from ``kwargs``; keys it has (lr, betas, eps, weight_decay
        from the optimizer it came from) are kept.
        """
        lamb = cls([torch.zeros(1, requires_grad=True)], **kwargs)
        for group in param_groups:
            for key, value in lamb.defaults.items():
                group.setdefault(key, value)
        lamb.param_groups = list(param_groups)
        return lamb

    def _group_option(self, group: dict[str, Any], key: str) -> Any:
        # Groups loaded from another optimizer's state dict (e.g. an Adam checkpoint) may lack our
        # keys; fall back to the constructor's defaults.
        return group.get(key, self.defaults[key])

    @staticmethod
    def _next_step(state: dict[str, Any], group_step: int) -> float:
        if "step" in state:
            previous = float(state["step"])
        elif "exp_avg" in state:
            # Moments restored without a per-param step: megatron-core's distributed optimizer
            # restores the step into param_group["step"] when TE/apex are installed.
            previous = float(group_step)
        else:
            previous = 0.0
        step = previous + 1.0
        # A fresh tensor, never an in-place increment: DistributedOptimizer.load_state_dict gives
        # every parameter's state the *same* step tensor object.
        state["step"] = torch.tensor(step, dtype=torch.float32)
        return step

    @torch.no_grad()
    def _adam_update(
        self, group: dict[str, Any], param: torch.Tensor, group_step: int
    ) -> tuple[torch.Tensor, float]:
        """Advance the moments of ``param``; return ``u`` (Adam direction + decoupled decay) and
        the param's new step count. ``group_step``: the group's step before this ``step()``."""
        grad = param.grad
        if grad.is_sparse:
            raise RuntimeError("Lamb does not support sparse gradients")
        state = self.state[param]
        step = self._next_step(state, group_step)  # before the moments exist: it looks at them
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        beta1, beta2 = self._group_option(group, "betas")
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        if self._group_option(group, "bias_correction"):
            bias_correction1 = 1.0 - beta1**step
            bias_correction2 = 1.0 - beta2**step
        else:
            bias_correction1 = bias_correction2 = 1.0
        denom = (exp_avg_sq / bias_correction2).sqrt_().add_(self._group_option(group, "eps"))
        update = (exp_avg / bias_correction1).div_(denom)
        weight_decay = group["weight_decay"]
        if weight_decay != 0.0:
            update.add_(param, alpha=weight_decay)
        return update, step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One LAMB step over all groups: local updates, one norm reduction, then apply."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        # 1. Updates and partial squared norms, one entry per tensor in param-group order.
        params: list[torch.Tensor] = []
        updates: list[torch.Tensor | None] = []
        lrs: list[float] = []
        adapt: list[bool] = []
        for group in self.param_groups:
            group_step = int(group.get("step", 0))
            steps = []
            for param in group["params"]:
                update = None
                if param.grad is not None:
                    update, step = self._adam_update(group, param, group_step)
                    steps.append(step)
                params.append(param)
                updates.append(update)
                lrs.append(group["lr"])
                adapt.append(bool(self._group_option(group, "layer_adaptation")))
            if steps:
                group["step"] = int(max(steps))
        w_sq, u_sq = self._partial_sq_norms(params, updates)

        # 2. Whole-parameter norms: the single collective of the step (inside the reducer).
        w_sq, u_sq = self.norm_reducer(w_sq, u_sq)
        if w_sq.shape != (len(params),) or u_sq.shape != (len(params),):
            raise RuntimeError(
                f"norm_reducer returned shapes {tuple(w_sq.shape)} and {tuple(u_sq.shape)}; "
                f"expected ({len(params)},) each (one entry per tensor of the optimizer)"
            )

        # 3. Apply. Ratio 1 where either norm is 0 or adaptation is off for the group.
        w_norm, u_norm = w_sq.sqrt(), u_sq.sqrt()
        use_ratio = (w_norm > 0) & (u_norm > 0)
        use_ratio &= torch.tensor(adapt, dtype=torch.bool, device=use_ratio.device)
        ratio = torch.where(use_ratio, w_norm / torch.where(use_ratio, u_norm, 1.0), 1.0)
        for i, (param, update) in enumerate(zip(params, updates, strict=True)):
            if update is None:
                continue
            update.mul_(ratio[i].to(update.dtype))
            param.add_(update, alpha=-lrs[i])
        return loss

    @staticmethod
    def _partial_sq_norms(
        params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor | None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 squared norms of each local tensor and its update (0 where there is no update)."""
        live = [i for i, u in enumerate(updates) if u is not None]
        device = params[0].device if params else torch.device("cpu")
        w_sq = torch.zeros(len(params), dtype=torch.float32, device=device)
        u_sq = torch.zeros(len(params), dtype=torch.float32, device=device)
        if live:
            index = torch.tensor(live, dtype=torch.long, device=device)
            w_norms = torch._foreach_norm([params[i] for i in live], 2, dtype=torch.float32)
            u_norms = torch._foreach_norm([updates[i] for i in live], 2, dtype=torch.float32)
            w_sq.index_copy_(0, index, torch.stack(w_norms).square())
            u_sq.index_copy_(0, index, torch.stack(u_norms).square())
        return w_sq, u_sq


class SlotNormReducer:
    """Whole-parameter squared norms from shards spread over data-parallel and tensor-parallel ranks.

    Every whole model parameter has a *slot* (an index in ``[0, len(tp_split))``) that is the same on
    all ranks of ``dp_group`` and ``tp_group``. Each local tensor of the optimizer maps to the slot
    of the parameter it is a piece of (``slot_index``). A call:

    1. scatters the local partial squared norms into two slot vectors (``index_add``, so a rank
       holding no piece of a parameter contributes 0 to its slot);
    2. all-reduces them (one ``[2, n_slots]`` tensor) over ``dp_group``: shards of the same parameter
       on different DP ranks add up;
    3. all-reduces again over ``tp_group`` with the slots of TP-duplicated parameters zeroed on every
       TP rank but 0, so TP-split parameters add up over TP and duplicated ones keep rank 0's value
       (megatron-core's ``param_is_not_tensor_parallel_duplicate`` convention, exact in floating
       point);
    4. gathers the slot values back to one entry per local tensor.

    A group of ``None`` or of size 1 is skipped, so at most two collectives run per step, each of
    ``2 * n_slots`` floats. Must be called on every rank of both groups (``Lamb.step`` does).
    ``device``: where the slot vectors live (the params' device; default: the inputs' device).
    """

    def __init__(
        self,
        slot_index: Sequence[int],
        tp_split: Sequence[bool],
        *,
        dp_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        n_slots = len(tp_split)
        bad = [s for s in slot_index if not 0 <= s < n_slots]
        if bad:
            raise ValueError(f"slot_index has {bad[:5]}...: slots must lie in [0, {n_slots})")
        self.n_slots = n_slots
        self._slot_index = torch.tensor(list(slot_index), dtype=torch.long)
        self._tp_duplicate = ~torch.tensor(list(tp_split), dtype=torch.bool)
        self.dp_group = dp_group if _size(dp_group) > 1 else None
        self.tp_group = tp_group if _size(tp_group) > 1 else None
        self._tp_rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        # Where the collectives run. A rank holding no tensor of the optimizer (a distributed-
        # optimizer range that is all padding) hands in empty CPU vectors; NCCL needs CUDA ones.
        self.device = torch.device(device) if device is not None else None

    def __call__(self, w_sq: torch.Tensor, u_sq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if w_sq.shape != self._slot_index.shape:
            raise RuntimeError(
                f"got {w_sq.numel()} partial norms but this reducer maps "
                f"{self._slot_index.numel()} tensors; rebuild it after changing param groups"
            )
        device = self.device or w_sq.device
        w_sq, u_sq = w_sq.to(device), u_sq.to(device)
        if self._slot_index.device != device:
            self._slot_index = self._slot_index.to(device)
            self._tp_duplicate = self._tp_duplicate.to(device)
        slots = torch.zeros(2, self.n_slots, dtype=torch.float32, device=device)
        slots[0].index_add_(0, self._slot_index, w_sq.float())
        slots[1].index_add_(0, self._slot_index, u_sq.float())
        if self.dp_group is not None:
            dist.all_reduce(slots, group=self.dp_group)
        if self.tp_group is not None:
            if self._tp_rank != 0:
                slots[:, self._tp_duplicate] = 0.0
            dist.all_reduce(slots, group=self.tp_group)
        full = slots[:, self._slot_index]
        return full[0], full[1]


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)
