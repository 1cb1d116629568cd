"""The model on a GPU: Transformer Engine's spec (serial and parallel block) against the local
spec, bf16 training, and sliding-window attention against full attention and an explicit banded
mask, for both specs in bf16 (where megatron-core's fused softmax could drop the window); the TE
spec's TP overlap (userbuffers) against no overlap."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from gpu_jobs import in_child, small_job
from harness import train_steps, with_changes

pytestmark = pytest.mark.gpu

# find_spec, not an import: TE is imported in the forked ranks only.
needs_te = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is None,
    reason="Transformer Engine is not installed",
)


@needs_te
@pytest.mark.parametrize("parallel_block", [False, True], ids=["serial", "parallel-block"])
def test_te_spec_matches_local_spec(parallel_block, data_dir):
    """Same parameters (initialised by global name), same data: TE's kernels give the local
    modules' numbers in fp32 to kernel noise, for the first step (forward + backward)."""
    model = {"parallel_block": parallel_block}
    local = train_steps(small_job(model={**model, "spec": "local"}), 1, data_dir, steps=2)
    te = train_steps(small_job(model={**model, "spec": "te"}), 1, data_dir, steps=2)
    for (loss, norm), (ref_loss, ref_norm) in zip(te, local, strict=True):
        assert math.isclose(loss, ref_loss, rel_tol=1e-3), (loss, ref_loss)
        assert math.isclose(norm, ref_norm, rel_tol=1e-2), (norm, ref_norm)


@needs_te
@pytest.mark.gpu(2)
@pytest.mark.parametrize("parallel_block", [False, True], ids=["serial", "parallel-block"])
def test_te_spec_tensor_parallel_matches_one_gpu(parallel_block, data_dir):
    job = small_job(model={"parallel_block": parallel_block, "spec": "te"})
    one = train_steps(job, 1, data_dir, steps=2)
    tp2 = with_changes(job, parallel={"tp": 2, "sequence_parallel": True})
    for (loss, _), (ref_loss, _) in zip(train_steps(tp2, 2, data_dir, steps=2), one, strict=True):
        assert math.isclose(loss, ref_loss, rel_tol=1e-3), (loss, ref_loss)


@pytest.mark.parametrize("spec", ["local", pytest.param("te", marks=needs_te)])
def test_bf16_trains_close_to_fp32(spec, data_dir):
    fp32 = train_steps(small_job(model={"spec": spec}), 1, data_dir, steps=4)
    bf16 = train_steps(
        small_job(model={"spec": spec, "params_dtype": "bf16"}), 1, data_dir, steps=4
    )
    assert all(math.isfinite(loss) and math.isfinite(norm) for loss, norm in bf16)
    assert bf16[-1][0] < bf16[0][0], bf16  # it trains
    for (loss, _), (ref_loss, _) in zip(bf16, fp32, strict=True):
        assert math.isclose(loss, ref_loss, rel_tol=3e-2), (loss, ref_loss)


@pytest.mark.parametrize("spec", ["local", pytest.param("te", marks=needs_te)])
def test_window_covering_the_sequence_is_full_attention(spec, data_dir):
    seq = small_job().model.seq_length
    full = train_steps(small_job(model={"spec": spec}), 1, data_dir, steps=2)
    wide = train_steps(small_job(model={"spec": spec, "window_size": seq}), 1, data_dir, steps=2)
    for (loss, _), (ref_loss, _) in zip(wide, full, strict=True):
        assert math.isclose(loss, ref_loss, rel_tol=1e-4), (loss, ref_loss)


def banded_attention(q, k, v, window: int | None) -> torch.Tensor:
    """Reference: softmax(q k^T / sqrt(d) + mask) v in fp32, with key j visible to query i iff
    i - window < j <= i (``window`` None: plain causal). q, k, v: [s, b, heads, d] -> [s, b, h*d]."""
    s, b, h, d = q.shape
    scores = torch.einsum("ibhd,jbhd->bhij", q.float(), k.float()) / math.sqrt(d)
    i = torch.arange(s, device=q.device)[:, None]
    j = torch.arange(s, device=q.device)[None, :]
    visible = (j <= i) & ((j > i - window) if window is not None else True)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhij,jbhd->ibhd", probs, v.float()).reshape(s, b, h * d)


def _core_attention_outputs(job, data_dir) -> dict[str, float]:
    """In one forked rank: the model's own core attention (as the job's spec builds it, bf16, on
    CUDA) on random q/k/v, against the banded and the plain causal reference."""
    from megascale.parallel.groups import build_groups, destroy_groups, init_distributed
    from megascale.train.run import seed_everything
    from megascale.train.trainer import Trainer

    init_distributed("cuda")
    groups = build_groups(job.parallel)
    seed_everything(job.train.seed, groups.tp_rank, "cuda")
    trainer = Trainer(job, groups, "cuda", data_cache_dir=data_dir)
    core = trainer.model[0].module.decoder.layers[0].self_attention.core_attention
    m = job.model
    shape = (m.seq_length, 2, m.num_heads, m.hidden_size // m.num_heads)
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(shape, device="cuda", generator=generator).to(torch.bfloat16) for _ in range(3)
    )
    from megatron.core.transformer.enums import AttnMaskType

    with torch.no_grad():  # TE's attention has no default mask type (the local one keeps its own)
        out = core(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    out = out.float().reshape(m.seq_length, 2, -1)
    errors = {
        "banded": float((out - banded_attention(q, k, v, m.window_size)).abs().max()),
        "causal": float((out - banded_attention(q, k, v, None)).abs().max()),
    }
    destroy_groups()
    return errors


@pytest.mark.parametrize("spec", ["local", pytest.param("te", marks=needs_te)])
def test_sliding_window_attention_equals_an_explicit_banded_mask(spec, data_dir):
    job = small_job(model={"spec": spec, "params_dtype": "bf16", "window_size": 16})
    errors = in_child(_core_attention_outputs, job, data_dir)
    assert errors["banded"] < 3e-2, errors  # bf16 inputs, fp32 reference
    assert errors["causal"] > 0.1, errors  # the window really changes the result


def _te_overlap_engaged(job, data_dir):
    """In one rank: the plan this rank took, megatron's flag, and whether TE holds userbuffers."""
    from harness import _rank_trainer
    from transformer_engine.pytorch.module import base as te_base

    from megascale.parallel.groups import destroy_groups

    trainer = _rank_trainer(job, data_dir)
    trainer.step()
    engaged = (trainer.tp_overlap.mode, trainer.config.tp_comm_overlap)
    engaged += (bool(getattr(te_base, "_ub_communicators", None)),)
    destroy_groups()
    return engaged


@needs_te
@pytest.mark.gpu(2)
@pytest.mark.parametrize("parallel_block", [False, True], ids=["serial", "parallel-block"])
def test_te_userbuffers_tp_overlap_matches_no_overlap(parallel_block, data_dir):
    """The TE spec's TP overlap (Transformer Engine userbuffers, TP2 + SP, bf16) runs, and trains
    to the numbers of the same job without it (bf16 kernel noise)."""
    from megascale.config import validate
    from megascale.launcher.local import run_local

    job = small_job(
        model={"parallel_block": parallel_block, "spec": "te", "params_dtype": "bf16"},
        parallel={"tp": 2, "sequence_parallel": True},
    )
    off = train_steps(with_changes(job, overlap={"tp": False}), 2, data_dir, steps=3)
    on = train_steps(job, 2, data_dir, steps=3)
    for (loss, _), (ref_loss, _) in zip(on, off, strict=True):
        assert math.isclose(loss, ref_loss, rel_tol=2e-2), (loss, ref_loss)
    engaged = run_local(_te_overlap_engaged, 2, (validate(job, 2, "nccl"), data_dir))
    assert engaged[0] == ("te-userbuffers", True, True), engaged
