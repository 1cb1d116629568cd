"""What a checkpoint's shards say about their tensors, and the optimizer's step count.

``to_dcp`` must describe each local shard as torch's ``ShardedTensor`` finds it (device, pinned
memory), or torch refuses it: on a GPU the pieces are CUDA tensors (a synchronous save, a load) or
pinned host buffers (the asynchronous save's snapshot). This CPU build can make neither, so the
tests use ``meta`` tensors for another device and a tensor that reports itself pinned.

The step count must survive a save and a restore whichever place the optimizer keeps it in:
``state[p]["step"]`` (torch's Adam, LAMB) or ``param_group["step"]`` only (Transformer Engine's
FusedAdam); ``GroupStepAdam`` below counts like the latter.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megascale.train.checkpoint.shards import (
    Entry,
    LayoutError,
    ensure_optimizer_state,
    optimizer_step_count,
    set_optimizer_step_count,
    to_dcp,
)


@pytest.fixture
def one_rank():
    """A one-process gloo group: ``ShardedTensor`` reads the rank of its shards' placements."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _two_rows(device: str = "cpu") -> Entry:
    """A (4, 3) tensor held here as two pieces of two rows each."""
    pieces = [((0, 0), torch.zeros(2, 3, device=device)), ((2, 0), torch.ones(2, 3, device=device))]
    return Entry("w", (4, 3), torch.float32, pieces)


def test_shards_are_placed_on_the_device_their_tensors_are_on(one_rank):
    (sharded,) = to_dcp([_two_rows("meta")], rank=0, world=1).values()
    placements = [str(m.placement) for m in sharded.metadata().shards_metadata]
    assert placements == ["rank:0/meta", "rank:0/meta"]
    assert [s.tensor.device.type for s in sharded.local_shards()] == ["meta", "meta"]


def test_shards_of_pinned_buffers_are_described_as_pinned(one_rank, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: True)
    (sharded,) = to_dcp([_two_rows()], rank=0, world=1).values()
    assert sharded.metadata().tensor_properties.pin_memory is True
    assert [str(m.placement) for m in sharded.metadata().shards_metadata] == ["rank:0/cpu"] * 2


def test_an_entry_whose_pieces_differ_in_pinning_is_refused(one_rank, monkeypatch):
    entry = _two_rows()
    pinned = entry.pieces[0][1]
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: self is pinned)
    with pytest.raises(LayoutError, match="'w'.*pinned"):
        to_dcp([entry], rank=0, world=1)


class GroupStepAdam(torch.optim.Optimizer):
    """Adam that counts steps in ``param_group["step"]`` only, as TE's FusedAdam does: created by
    the first step, absent from a fresh group, never written to ``state[p]``."""

    def __init__(self, params, lr: float = 0.1, betas=(0.9, 0.95), eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m = state["exp_avg"] / (1 - beta1 ** group["step"])
                v = state["exp_avg_sq"] / (1 - beta2 ** group["step"])
                p.sub_(group["lr"] * m / (v.sqrt() + group["eps"]))


def _trainer(optimizer: torch.optim.Optimizer) -> SimpleNamespace:
    """What the step-count functions read of a trainer: megatron-core's wrapper's ``optimizer``."""
    return SimpleNamespace(optimizer=SimpleNamespace(optimizer=optimizer))


def _stepped(make, steps: int) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    optimizer = make(params)
    for _ in range(steps):
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("make", [GroupStepAdam, torch.optim.AdamW], ids=["group", "per-param"])
def test_the_step_count_is_read_where_the_optimizer_keeps_it(make):
    trainer = _trainer(_stepped(make, 3))
    ensure_optimizer_state(trainer)  # as a save does before it reads the count
    assert optimizer_step_count(trainer) == 3.0
    assert optimizer_step_count(_trainer(make([torch.nn.Parameter(torch.ones(1))]))) == 0.0


def test_a_resumed_optimizer_that_counts_in_its_groups_takes_the_uninterrupted_step():
    whole, saved = _stepped(GroupStepAdam, 4), _stepped(GroupStepAdam, 3)
    saved_params = saved.param_groups[0]["params"]
    params = [torch.nn.Parameter(p.detach().clone()) for p in saved_params]
    resumed = GroupStepAdam(params)
    assert "step" not in resumed.param_groups[0]  # a fresh group has no count
    ensure_optimizer_state(_trainer(resumed))  # as a load does, before it copies the state in
    for old, new in zip(saved_params, params, strict=True):
        for name in ("exp_avg", "exp_avg_sq"):
            resumed.state[new][name].copy_(saved.state[old][name])
    set_optimizer_step_count(_trainer(resumed), optimizer_step_count(_trainer(saved)))
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    resumed.step()  # bias correction at step 4, as in the uninterrupted run
    assert resumed.param_groups[0]["step"] == 4
    for a, b in zip(whole.param_groups[0]["params"], params, strict=True):
        assert torch.equal(a, b)
