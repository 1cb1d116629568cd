"""LAMB on shards equals LAMB on whole parameters.

Two levels, each against a 1-process run on the full parameters (max relative error < 1e-6):

* ``SlotNormReducer`` on hand-made shards: parameters flattened into one buffer and cut into equal
  DP ranges the way megatron-core's distributed optimizer cuts its grad buffers (reverse order,
  aligned starts, padded end), with TP-split parameters cut along dim 0 first. Layouts DP2, DP4,
  TP2xDP2 and DP4 with an idle rank (2 and 4 gloo processes). A negative control (shard-local
  norms) must miss by > 1e-3, so the comparison can fail.
* The real megatron-core path, ``build_optimizer`` for "lamb" and "adam" (AdamW): DDP +
  DistributedOptimizer and DDP + FP32Optimizer on a small MLP, DP2 with ``torch.nn.Linear`` and
  TP2xDP2 with megatron's Column/RowParallelLinear, on the CPU backend, with an optimizer
  ``state_dict``/``load_state_dict`` round trip mid-run. Every DP rank gets the same batch, so
  gradients equal the reference's (the test is about the optimizer, not about DP averaging).

Workers are forked from the pytest process, which has already imported torch and megatron-core.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig

from megascale.config import OptimConfig
from megascale.launcher.local import run_local
from megascale.parallel import cpu_backend
from megascale.train.lamb import Lamb, SlotNormReducer
from megascale.train.optimizer import build_optimizer, build_scheduler

MAX_REL_ERROR = 1e-6
STEPS = 3


def _entry(fn, args: tuple) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)  # env:// from run_local
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` forked gloo processes; re-raise a failure."""
    run_local(_entry, world, (fn, args), timeout_s=300)


def max_rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


# --------------------------------------------------------------------------------------------------
# Hand-made shards
# --------------------------------------------------------------------------------------------------

# (shape of the whole parameter, split over TP along dim 0?, param group: 0 decays, 1 does not)
SPECS = [
    ((12, 10), True, 0),  # column-parallel weight
    ((12,), True, 1),  # column-parallel bias
    ((8, 6), True, 0),
    ((6,), False, 1),  # a norm weight: duplicated over TP
    ((4, 6), False, 0),  # a duplicated weight
    ((5,), False, 1),
]
GROUP_OPTIONS = [{"weight_decay": 0.1}, {"weight_decay": 0.0}]
LR, BETAS, EPS = 0.05, (0.9, 0.95), 1e-6
ALIGN = 4  # megatron aligns param starts to 64 elements; smaller here so params stay small


def full_params_and_grads(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=gen) for shape, _, _ in SPECS]
    grads = [[torch.randn(shape, generator=gen) for shape, _, _ in SPECS] for _ in range(STEPS)]
    return params, grads


def tp_local(tensor: torch.Tensor, spec_index: int, tp: int, tp_rank: int) -> torch.Tensor:
    return tensor.chunk(tp, dim=0)[tp_rank] if SPECS[spec_index][1] and tp > 1 else tensor


def dp_ranges(numels: list[int], dp: int, idle_last: bool = False):
    """Distributed-optimizer layout: each param's [start, end) in one flat buffer (filled in
    reverse order, starts aligned), the padded buffer size, and each DP rank's [lo, hi) range.
    ``idle_last``: the last DP rank's range is empty (as when its range is all padding)."""
    starts, cursor = [0] * len(numels), 0
    for i in reversed(range(len(numels))):
        cursor = -(-cursor // ALIGN) * ALIGN
        starts[i] = cursor
        cursor += numels[i]
    size = -(-cursor // (ALIGN * dp)) * (ALIGN * dp)
    active = dp - 1 if idle_last else dp
    per_rank = -(-size // active)
    ranks = [(min(r * per_rank, size), min((r + 1) * per_rank, size)) for r in range(dp)]
    return [(s, s + n) for s, n in zip(starts, numels, strict=True)], size, ranks


def shard_layout(numels: list[int], dp: int, dp_rank: int, idle_last: bool = False):
    """For one DP rank: (param index, slice start, slice end) of every piece it holds, grouped by
    param group and, within a group, in buffer order (as DistributedOptimizer orders them)."""
    spans, _, ranks = dp_ranges(numels, dp, idle_last)
    lo, hi = ranks[dp_rank]
    pieces = {0: [], 1: []}
    for i in sorted(range(len(numels)), key=lambda i: spans[i][0]):
        start, end = max(spans[i][0], lo), min(spans[i][1], hi)
        if end > start:
            pieces[SPECS[i][2]].append((i, start - spans[i][0], end - spans[i][0]))
    return pieces


def reference_lamb(params, grads):
    weights = [torch.nn.Parameter(p.clone()) for p in params]
    groups = [
        {"params": [w for w, spec in zip(weights, SPECS, strict=True) if spec[2] == g], **opts}
        for g, opts in enumerate(GROUP_OPTIONS)
    ]
    opt = Lamb(groups, lr=LR, betas=BETAS, eps=EPS)
    for step_grads in grads:
        for w, g in zip(weights, step_grads, strict=True):
            w.grad = g.clone()
        opt.step()
    return [w.detach() for w in weights]


def check_layout_is_interesting(numels: list[int], dp: int, idle_last: bool) -> None:
    """The layout must split some param over ranks and give some rank pieces of several params."""
    holders: dict[int, set[int]] = {}
    held_per_rank = []
    for r in range(dp):
        pieces = shard_layout(numels, dp, r, idle_last)
        held_per_rank.append({i for group in pieces.values() for i, _, _ in group})
        for i in held_per_rank[-1]:
            holders.setdefault(i, set()).add(r)
    assert any(len(held) >= 2 for held in held_per_rank), "no rank holds pieces of several params"
    assert any(len(ranks) >= 2 for ranks in holders.values()), "no param is split over DP ranks"
    assert not idle_last or not held_per_rank[-1], "the idle rank holds pieces"


def run_sharded(tp, dp, idle_last, groups, rank: int, reducer_kind: str) -> list[torch.Tensor]:
    """LAMB on this rank's shards; returns the reassembled whole params."""
    tp_rank, dp_rank = rank % tp, rank // tp
    tp_group, dp_group = groups
    params, grads = full_params_and_grads()
    local = [tp_local(p, i, tp, tp_rank) for i, p in enumerate(params)]
    numels = [p.numel() for p in local]
    check_layout_is_interesting(numels, dp, idle_last)
    pieces = shard_layout(numels, dp, dp_rank, idle_last)

    shards, slot_index, opt_groups = [], [], []
    for g, opts in enumerate(GROUP_OPTIONS):
        group_shards = []
        for i, start, end in pieces[g]:
            group_shards.append(torch.nn.Parameter(local[i].flatten()[start:end].clone()))
            slot_index.append(i)
        shards.extend(group_shards)
        opt_groups.append({"params": group_shards, **opts})
    if reducer_kind == "slots":
        reducer = SlotNormReducer(
            slot_index, [spec[1] for spec in SPECS], dp_group=dp_group, tp_group=tp_group
        )
    else:  # "local": shard-local norms, the mistake this module guards against
        reducer = None
    opt = Lamb(opt_groups, lr=LR, betas=BETAS, eps=EPS, norm_reducer=reducer)
    order = [(i, start, end) for g in (0, 1) for i, start, end in pieces[g]]
    for step_grads in grads:
        for shard, (i, start, end) in zip(shards, order, strict=True):
            shard.grad = tp_local(step_grads[i], i, tp, tp_rank).flatten()[start:end].clone()
        opt.step()

    # Reassemble: DP ranks fill their ranges of the flat buffer, sum over DP, then concat over TP.
    spans, size, _ = dp_ranges(numels, dp, idle_last)
    flat = torch.zeros(size)
    for shard, (i, start, end) in zip(shards, order, strict=True):
        flat[spans[i][0] + start : spans[i][0] + end] = shard.detach()
    dist.all_reduce(flat, group=dp_group)
    whole = []
    for i, (p, (lo, hi)) in enumerate(zip(local, spans, strict=True)):
        piece = flat[lo:hi].view_as(p)
        if SPECS[i][1] and tp > 1:
            parts = [torch.empty_like(piece) for _ in range(tp)]
            dist.all_gather(parts, piece.contiguous(), group=tp_group)
            piece = torch.cat(parts, dim=0)
        whole.append(piece)
    return whole


def _sharded_worker(rank: int, world: int, layouts: list[tuple[int, int, bool]]) -> None:
    params, grads = full_params_and_grads()
    expected = reference_lamb(params, grads)
    for tp, dp, idle_last in layouts:
        assert tp * dp == world
        # Every rank creates every group, in the same order (new_group is collective).
        tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(dp)]
        dp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
        groups = (tp_groups[rank // tp], dp_groups[rank % tp])
        whole = run_sharded(tp, dp, idle_last, groups, rank, "slots")
        for i, (w, e) in enumerate(zip(whole, expected, strict=True)):
            err = max_rel_error(w, e)
            assert err < MAX_REL_ERROR, f"TP{tp}xDP{dp} param {i} {SPECS[i]}: rel error {err:.2e}"
        # Negative control: shard-local trust ratios must visibly differ from the reference.
        local = run_sharded(tp, dp, idle_last, groups, rank, "local")
        worst = max(max_rel_error(w, e) for w, e in zip(local, expected, strict=True))
        assert worst > 1e-3, f"TP{tp}xDP{dp}: shard-local norms matched too ({worst:.1e})"


@pytest.mark.parametrize(
    ("world", "layouts"),
    [(2, [(1, 2, False)]), (4, [(1, 4, False), (2, 2, False), (1, 4, True)])],
    ids=["dp2", "dp4+tp2dp2+dp4-idle-rank"],
)
def test_slot_reducer_on_shards_matches_one_process(world, layouts):
    """(tp, dp, idle_last) layouts; an idle rank holds no piece yet joins the reduction."""
    spawn(_sharded_worker, world, layouts)


# --------------------------------------------------------------------------------------------------
# The real megatron-core path
# --------------------------------------------------------------------------------------------------

IN, HIDDEN, OUT = 16, 24, 8
OPTIM = OptimConfig(
    name="lamb", lr=0.02, min_lr=0.002, warmup_steps=0, weight_decay=0.1, clip_grad=1.0
)


class TPMLP(torch.nn.Module):
    """fc1 column-parallel (weight and bias split), fc2 row-parallel (bias duplicated over TP)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        init = torch.nn.init.zeros_  # overwritten from the reference model's weights
        self.fc1 = ColumnParallelLinear(IN, HIDDEN, config=config, init_method=init, bias=True)
        self.fc2 = RowParallelLinear(
            HIDDEN, OUT, config=config, init_method=init, bias=True, input_is_parallel=True,
            skip_bias_add=False,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.fc1(x)
        out, _ = self.fc2(torch.tanh(hidden))
        return out


def reference_mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
    )


def build_model(tp: int, reference: torch.nn.Sequential) -> torch.nn.Module:
    if tp == 1:
        return copy.deepcopy(reference)
    config = TransformerConfig(
        num_layers=1, hidden_size=IN, num_attention_heads=2, tensor_model_parallel_size=tp,
        use_cpu_initialization=True,  # perform_initialization also sets the TP attributes
    )  # fmt: skip
    model = TPMLP(config)
    for local, full in zip(model.parameters(), reference.parameters(), strict=True):
        local.data.copy_(_tp_slice(full.detach(), local, tp))
    return model


def _tp_slice(full: torch.Tensor, local: torch.Tensor, tp: int) -> torch.Tensor:
    if not getattr(local, "tensor_model_parallel", False):
        return full
    dim = local.partition_dim
    return full.chunk(tp, dim=dim)[parallel_state.get_tensor_model_parallel_rank()]


def _tp_whole(param: torch.nn.Parameter, tp: int) -> torch.Tensor:
    local = param.detach()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(
        parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    return torch.cat(parts, dim=param.partition_dim)


def _reference_run(reference: torch.nn.Sequential, batches, cfg: OptimConfig) -> list:
    weights = [p for p in reference.parameters() if p.ndim > 1]
    biases = [p for p in reference.parameters() if p.ndim == 1]
    # megatron-core's groups: wd_mult 0 for biases and 1-D params (get_standard_config_overrides).
    groups = [{"params": weights, "wd_mult": 1.0}, {"params": biases, "wd_mult": 0.0}]
    optimizer_cls = Lamb if cfg.name == "lamb" else torch.optim.AdamW
    opt = optimizer_cls(groups, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    scheduler = build_scheduler(cfg, opt, total_steps=10)
    for x, target in batches:
        reference.zero_grad()
        (reference(x) - target).square().sum().backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.clip_grad)
        opt.step()
        scheduler.step(1)
    return [p.detach() for p in reference.parameters()]


def _train(tp: int, cfg: OptimConfig, distributed: bool, batches):
    """``STEPS`` steps of megatron-core DDP + ``build_optimizer``, with a checkpoint round trip
    of the optimizer after step 2. Returns the whole params and the inner torch optimizer."""
    module = build_model(tp, reference_mlp())
    config = TransformerConfig(
        num_layers=1, hidden_size=IN, num_attention_heads=2, tensor_model_parallel_size=tp
    )
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed)
    model = DistributedDataParallel(config, ddp_config, module)
    opt = build_optimizer(cfg, [model], use_distributed_optimizer=distributed, bf16=False)
    scheduler = build_scheduler(cfg, opt, total_steps=10)
    for step, (x, target) in enumerate(batches):
        model.zero_grad_buffer()
        opt.zero_grad()
        (model(x) - target).square().sum().backward()
        model.finish_grad_sync()
        updated, _, _ = opt.step()
        assert updated
        scheduler.step(1)
        if step == 1:
            # Moments and step counts must survive (DistributedOptimizer.load_state_dict hands
            # every param the same step tensor object).
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    return [_tp_whole(p, tp) for p in module.parameters()], opt.chained_optimizers[0].optimizer


def _megatron_worker(rank: int, world: int, tp: int) -> None:
    cpu_backend.activate()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        gen = torch.Generator().manual_seed(1)
        batches = [(torch.randn(4, IN, generator=gen), torch.randn(4, OUT, generator=gen))
                   for _ in range(STEPS)]  # fmt: skip
        for cfg in (OPTIM, dataclasses.replace(OPTIM, name="adam")):
            expected = _reference_run(reference_mlp(), batches, cfg)
            for distributed in (True, False):
                got, inner = _train(tp, cfg, distributed, batches)
                assert isinstance(inner, Lamb if cfg.name == "lamb" else torch.optim.AdamW)
                kind = f"TP{tp} {cfg.name} " + ("DistOpt" if distributed else "FP32Optimizer")
                for i, (g, e) in enumerate(zip(got, expected, strict=True)):
                    err = max_rel_error(g, e)
                    assert err < MAX_REL_ERROR, f"{kind} param {i}: rel error {err:.2e}"
                steps = {float(s["step"]) for s in inner.state.values()}
                assert steps == {float(STEPS)}, f"{kind}: steps {steps}"
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize(("world", "tp"), [(2, 1), (4, 2)], ids=["dp2", "tp2dp2"])
def test_megatron_optimizer_matches_one_process(world, tp):
    """build_optimizer: LAMB (and AdamW) through megatron-core's real wrappers."""
    spawn(_megatron_worker, world, tp)
