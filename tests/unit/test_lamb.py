"""Lamb against an independent per-parameter reference, its state layout, and the norm reducer hook."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from megascale.config import OptimConfig
from megascale.train.lamb import Lamb, SlotNormReducer, identity_norm_reducer

SHAPES = [(7,), (3, 5), (2, 3, 4), (1,), (16, 1)]


def reference_lamb(params, grads_per_step, groups, *, bias_correction=True):
    """Textbook LAMB, one parameter at a time, float64, no shared code with megascale.train.lamb.

    ``groups``: list of (indices, lr, (beta1, beta2), eps, weight_decay, layer_adaptation).
    """
    weights = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(w) for w in weights]
    v = [torch.zeros_like(w) for w in weights]
    for t, grads in enumerate(grads_per_step, start=1):
        for indices, lr, (beta1, beta2), eps, wd, adapt in groups:
            for i in indices:
                g = grads[i].double()
                m[i] = beta1 * m[i] + (1 - beta1) * g
                v[i] = beta2 * v[i] + (1 - beta2) * g * g
                m_hat = m[i] / (1 - beta1**t) if bias_correction else m[i]
                v_hat = v[i] / (1 - beta2**t) if bias_correction else v[i]
                update = m_hat / (v_hat.sqrt() + eps) + wd * weights[i]
                w_norm, u_norm = weights[i].norm().item(), update.norm().item()
                ratio = w_norm / u_norm if adapt and w_norm > 0 and u_norm > 0 else 1.0
                weights[i] = weights[i] - lr * ratio * update
    return weights


def make_params(seed=0, zero=()):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i, shape in enumerate(SHAPES):
        data = torch.zeros(shape) if i in zero else torch.randn(shape, generator=gen)
        params.append(torch.nn.Parameter(data))
    return params


def make_grads(n_steps, seed=1, zero=()):
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(n_steps):
        grads = [torch.randn(shape, generator=gen) * 0.1 for shape in SHAPES]
        steps.append([torch.zeros_like(g) if i in zero else g for i, g in enumerate(grads)])
    return steps


def run_lamb(opt, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.clone()
        opt.step()


def assert_close_to(params, expected, rtol=2e-6):
    for i, (p, e) in enumerate(zip(params, expected, strict=True)):
        scale = max(e.abs().max().item(), 1e-30)
        err = (p.detach().double() - e).abs().max().item() / scale
        assert err < rtol, f"param {i} shape {tuple(p.shape)}: max rel error {err:.2e}"


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_matches_reference(weight_decay, bias_correction):
    params = make_params()
    grads = make_grads(4)
    betas = (0.9, 0.95)
    opt = Lamb(
        params, lr=0.02, betas=betas, eps=1e-8, weight_decay=weight_decay,
        bias_correction=bias_correction,
    )  # fmt: skip
    expected = reference_lamb(
        params, grads, [(range(len(SHAPES)), 0.02, betas, 1e-8, weight_decay, True)],
        bias_correction=bias_correction,
    )  # fmt: skip
    run_lamb(opt, params, grads)
    assert_close_to(params, expected)


def test_param_groups_with_and_without_decay_and_adaptation():
    params = make_params()
    grads = make_grads(3)
    betas = (0.8, 0.99)
    opt = Lamb(
        [
            {"params": params[:2], "weight_decay": 0.05},
            {"params": params[2:4], "weight_decay": 0.0, "lr": 0.003},
            {"params": params[4:], "layer_adaptation": False},
        ],
        lr=0.01,
        betas=betas,
        eps=1e-6,
        weight_decay=0.2,
    )
    expected = reference_lamb(
        params,
        grads,
        [
            ([0, 1], 0.01, betas, 1e-6, 0.05, True),
            ([2, 3], 0.003, betas, 1e-6, 0.0, True),
            ([4], 0.01, betas, 1e-6, 0.2, False),
        ],
    )
    run_lamb(opt, params, grads)
    assert_close_to(params, expected)


def test_zero_norm_edge_cases():
    # param 0 starts at zero (||w|| = 0: ratio 1); param 1 gets zero grads with no decay
    # (||u|| = 0: ratio 1, no move); param 2 gets zero grads with decay (u = wd * w).
    params = make_params(zero={0})
    grads = make_grads(3, zero={1, 2})
    opt = Lamb(
        [{"params": [params[1]], "weight_decay": 0.0}, {"params": [params[0], *params[2:]]}],
        lr=0.05,
        weight_decay=0.1,
    )
    before = params[1].detach().clone()
    expected = reference_lamb(
        params,
        grads,
        [
            ([1], 0.05, (0.9, 0.999), 1e-6, 0.0, True),
            ([0, 2, 3, 4], 0.05, (0.9, 0.999), 1e-6, 0.1, True),
        ],
    )
    run_lamb(opt, params, grads)
    assert torch.equal(params[1].detach(), before)
    assert params[0].detach().abs().sum() > 0  # moved away from zero with ratio 1
    assert torch.isfinite(torch.cat([p.detach().flatten() for p in params])).all()
    assert_close_to(params, expected)
    # u = wd * w exactly: ratio 1 / wd, so the step is w <- w (1 - lr).
    torch.testing.assert_close(
        params[2].detach(), make_params(zero={0})[2].detach() * (1 - 0.05) ** 3, rtol=1e-5, atol=0
    )


def test_without_adaptation_is_adamw():
    params = make_params()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    grads = make_grads(4)
    lamb = Lamb(params, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                layer_adaptation=False)  # fmt: skip
    adamw = torch.optim.AdamW(twins, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    run_lamb(lamb, params, grads)
    run_lamb(adamw, twins, grads)
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def test_default_reducer_is_identity_and_called_once_per_step():
    assert identity_norm_reducer(torch.ones(2), torch.zeros(2))[0].tolist() == [1.0, 1.0]
    params = make_params()
    calls = []

    def recording(w_sq, u_sq):
        calls.append((w_sq.clone(), u_sq.clone()))
        return w_sq, u_sq

    opt = Lamb(params, lr=0.01)
    assert opt.norm_reducer is identity_norm_reducer
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = Lamb(twins, lr=0.01)
    opt.norm_reducer = recording
    grads = make_grads(2)
    grads[1][3] = None  # a param without a gradient contributes zeros and is not moved
    run_lamb(opt, params, grads)
    run_lamb(plain, twins, grads)
    assert len(calls) == 2
    w_sq, u_sq = calls[1]
    assert w_sq.shape == (len(SHAPES),) and w_sq.dtype == torch.float32
    assert w_sq[3] == 0 and u_sq[3] == 0
    assert w_sq[0] > 0 and u_sq[0] > 0
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)


def test_rank_without_tensors_still_calls_the_reducer():
    # A distributed-optimizer rank whose range is all padding holds no tensor of a group.
    calls = []
    opt = Lamb.adopting([{"params": []}, {"params": []}])
    opt.norm_reducer = lambda w_sq, u_sq: calls.append(w_sq.shape) or (w_sq, u_sq)
    opt.step()
    assert calls == [(0,)]
    assert all("step" not in group for group in opt.param_groups)


def test_reducer_output_is_used_and_checked():
    params = make_params()
    grads = make_grads(1)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = Lamb(twins, lr=0.01, weight_decay=0.0)
    # Reporting 4x the squared weight norm doubles every trust ratio, so doubles every step.
    quadrupled = Lamb(params, lr=0.01, weight_decay=0.0,
                      norm_reducer=lambda w_sq, u_sq: (4 * w_sq, u_sq))  # fmt: skip
    start = [p.detach().clone() for p in params]
    run_lamb(plain, twins, grads)
    run_lamb(quadrupled, params, grads)
    for p, q, s in zip(params, twins, start, strict=True):
        torch.testing.assert_close(p.detach() - s, 2 * (q.detach() - s), rtol=1e-5, atol=1e-7)
    bad = Lamb(make_params(), norm_reducer=lambda w, u: (w[:1], u[:1]))
    for p, g in zip(bad.param_groups[0]["params"], grads[0], strict=True):
        p.grad = g
    with pytest.raises(RuntimeError, match="norm_reducer returned shapes"):
        bad.step()


def test_state_layout_matches_adam():
    params = make_params()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    grads = make_grads(2)
    lamb, adam = Lamb(params), torch.optim.Adam(twins)
    run_lamb(lamb, params, grads)
    run_lamb(adam, twins, grads)
    lamb_state, adam_state = lamb.state_dict()["state"], adam.state_dict()["state"]
    assert lamb_state.keys() == adam_state.keys()
    for key, ours in lamb_state.items():
        theirs = adam_state[key]
        assert list(ours) == list(theirs) == ["step", "exp_avg", "exp_avg_sq"]
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert ours[name].dtype == theirs[name].dtype, name
            assert ours[name].shape == theirs[name].shape, name
            assert ours[name].device == theirs[name].device, name
        assert ours["step"].item() == theirs["step"].item() == 2.0
        # Same moments: LAMB's moments are Adam's (the trust ratio only scales the step).
        torch.testing.assert_close(ours["exp_avg"], theirs["exp_avg"])
    assert all(group["step"] == 2 for group in lamb.param_groups)


def test_state_dict_round_trip_resumes_exactly():
    grads = make_grads(4)
    params = make_params()
    straight = Lamb(params, lr=0.01, weight_decay=0.1)
    run_lamb(straight, params, grads)

    first = make_params()
    opt = Lamb(first, lr=0.01, weight_decay=0.1)
    run_lamb(opt, first, grads[:2])
    saved = copy.deepcopy(opt.state_dict())
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in first]
    resumed = Lamb(resumed_params, lr=0.5)  # group values come from the state dict
    resumed.load_state_dict(saved)
    run_lamb(resumed, resumed_params, grads[2:])
    for p, q in zip(params, resumed_params, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)


def test_shared_step_tensor_is_not_incremented_per_param():
    # megatron-core's DistributedOptimizer.load_state_dict (torch optimizer path) gives every
    # param's state the same step tensor object.
    params = make_params()
    opt = Lamb(params)
    run_lamb(opt, params, make_grads(1))
    shared = torch.tensor(1.0)
    for p in params:
        opt.state[p]["step"] = shared
    run_lamb(opt, params, make_grads(1, seed=5))
    assert shared.item() == 1.0
    assert {opt.state[p]["step"].item() for p in params} == {2.0}


def test_moments_without_step_use_the_group_step():
    # megatron-core with TE/apex installed restores exp_avg/exp_avg_sq into state[p] and the step
    # into param_group["step"] only.
    params = make_params()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    grads = make_grads(3)
    straight = Lamb(twins)
    run_lamb(straight, twins, grads)
    opt = Lamb(params)
    run_lamb(opt, params, grads[:2])
    for p in params:
        del opt.state[p]["step"]
    assert opt.param_groups[0]["step"] == 2
    run_lamb(opt, params, grads[2:])
    assert {opt.state[p]["step"].item() for p in params} == {3.0}
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)


def test_adopting_keeps_group_dicts_and_their_values():
    params = make_params()
    adam = torch.optim.AdamW(
        [{"params": params[:2], "wd_mult": 1.0}, {"params": params[2:], "wd_mult": 0.0}],
        lr=0.003, betas=(0.8, 0.9), weight_decay=0.2,
    )  # fmt: skip
    groups = adam.param_groups
    lamb = Lamb.adopting(groups, lr=1.0, weight_decay=0.0)
    assert lamb.param_groups[0] is groups[0] and lamb.param_groups[1] is groups[1]
    assert groups[1]["lr"] == 0.003 and groups[1]["betas"] == (0.8, 0.9)
    assert groups[0]["weight_decay"] == 0.2 and groups[1]["wd_mult"] == 0.0
    assert groups[0]["layer_adaptation"] is True and groups[0]["bias_correction"] is True
    assert len(lamb.state) == 0
    run_lamb(lamb, params, make_grads(1))
    assert len(lamb.state) == len(SHAPES)


def test_slot_reducer_without_groups_sums_pieces_of_a_slot():
    # Three local tensors: two pieces of slot 1 and one of slot 0 (slot 2 has no piece here).
    reducer = SlotNormReducer([1, 0, 1], [False, True, False])
    w, u = reducer(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0]))
    assert w.tolist() == [4.0, 2.0, 4.0] and u.tolist() == [10.0, 5.0, 10.0]
    with pytest.raises(RuntimeError, match="partial norms"):
        reducer(torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="slots must lie"):
        SlotNormReducer([3], [False])


def test_invalid_hyperparameters_name_the_field():
    with pytest.raises(ValueError, match="betas\\[1\\]=1.0"):
        Lamb(make_params(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="eps=0"):
        Lamb(make_params(), eps=0)


def test_build_scheduler_warmup_then_cosine():
    from megascale.train.optimizer import build_scheduler

    params = make_params()
    opt = Lamb([{"params": params[:3], "wd_mult": 1.0}, {"params": params[3:], "wd_mult": 0.0}])
    cfg = OptimConfig(name="lamb", lr=1e-3, min_lr=1e-4, warmup_steps=2, weight_decay=0.1)
    # OptimizerParamScheduler only touches optimizer.param_groups, so a bare torch optimizer works.
    scheduler = build_scheduler(cfg, opt, total_steps=10)
    lrs = []  # lrs[k - 1] is the lr optimizer step k runs at
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        scheduler.step(1)
    assert lrs[:2] == pytest.approx([5e-4, 1e-3])  # no wasted step at lr 0
    mid = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * 4 / 8))
    assert lrs[5] == pytest.approx(mid)
    assert lrs[9] == pytest.approx(1e-4)  # the last step runs at min_lr
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    with pytest.raises(ValueError, match="total_steps=2"):
        build_scheduler(cfg, opt, total_steps=2)


def test_build_optimizer_rejects_unknown_name():
    from megascale.train.optimizer import build_optimizer

    with pytest.raises(ValueError, match="optim.name='sgd'"):
        build_optimizer(OptimConfig(name="sgd"), [], use_distributed_optimizer=False, bf16=False)
