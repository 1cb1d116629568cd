"""Which TP overlap runs on which layer spec (``megascale.overlap.tp_plan``): ours chunked on the
local spec, Transformer Engine's userbuffers on the TE spec, and the TE combinations that cannot work
refused with the field named. Pure: no TE, no GPU."""

from __future__ import annotations

import pytest

from megascale.config import ConfigError, load, validate
from megascale.model import gpt
from megascale.overlap.tp_plan import CHUNKED, OFF, TE_USERBUFFERS, plan_tp_overlap

TP2_SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
TE_BF16 = [*TP2_SP, "model.spec=te", "model.params_dtype=bf16"]


def test_flagship_preset_gets_te_userbuffers_overlap():
    """The 175B preset (TE spec, TP8 + SP, bf16) overlaps its TP communication inside TE."""
    job = validate(load("megascale-175b"), 12288, "nccl")
    plan = plan_tp_overlap(job, use_te=True, te_version="2.8.0", gpus_per_node=8)
    assert plan.mode == TE_USERBUFFERS
    assert plan.megatron_flags["tp_comm_overlap"] is True
    assert plan.megatron_flags["tp_comm_bootstrap_backend"] == "nccl"
    assert plan.ub_shape == (2048 * 1, 12288)  # seq_length * micro_batch_size rows
    assert plan.tp == 8


def test_single_gpu_preset_has_no_tp_communication():
    plan = plan_tp_overlap(load("h100-1b"), use_te=True, te_version="2.8.0", gpus_per_node=1)
    assert plan.mode == OFF and "parallel.tp = 1" in plan.reason


@pytest.mark.parametrize(
    ("sets", "use_te", "mode"),
    [
        (TP2_SP, False, CHUNKED),
        ([*TP2_SP, "overlap.tp_chunks=1"], False, OFF),
        ([*TP2_SP, "overlap.tp=false"], False, OFF),
        (["parallel.tp=2"], False, OFF),  # no SP: TP all-reduces, neither path overlaps them
        (TE_BF16, True, TE_USERBUFFERS),
        ([*TE_BF16, "overlap.tp_chunks=1"], True, TE_USERBUFFERS),  # chunks: local spec only
        ([*TE_BF16, "overlap.tp=false"], True, OFF),
        (["parallel.tp=2", "model.params_dtype=bf16"], True, OFF),
        ([*TP2_SP, "model.spec=te"], True, OFF),  # fp32 (correctness runs): userbuffers are 16-bit
    ],
)
def test_mode_per_spec_and_layout(sets, use_te, mode):
    plan = plan_tp_overlap(load("tiny", sets), use_te, te_version="2.8.0", gpus_per_node=8)
    assert plan.mode == mode, plan
    assert plan.chunks == (4 if mode == CHUNKED else 1)
    assert bool(plan.megatron_flags) is (mode == TE_USERBUFFERS)


@pytest.mark.parametrize(
    ("sets", "te_version", "gpus_per_node", "names"),
    [
        (TE_BF16, "1.8.0", 8, "Transformer Engine >= 1.9.0 (installed: 1.8.0)"),
        (TE_BF16, None, 8, "installed: unknown"),
        (TE_BF16, "2.8.0", 3, "parallel.tp = 2: TE's userbuffers need each TP group inside one"),
        (
            [*TE_BF16, "model.seq_length=63", "train.micro_batch_size=1"],
            "2.8.0",
            8,
            "seq_length * train.micro_batch_size = 63",
        ),
    ],
)
def test_te_combinations_that_cannot_work_are_refused(sets, te_version, gpus_per_node, names):
    job = load("tiny", sets)
    with pytest.raises(ConfigError, match="overlap.tp=false") as err:
        plan_tp_overlap(job, True, te_version=te_version, gpus_per_node=gpus_per_node)
    assert names in str(err.value)


def test_te_version_with_local_build_suffix_is_compared_numerically():
    plan = plan_tp_overlap(load("tiny", TE_BF16), True, te_version="1.10.0.dev0+abc123")
    assert plan.mode == TE_USERBUFFERS


def test_validate_applies_the_chunk_rule_to_the_local_spec_only():
    """``overlap.tp_chunks`` (which only the local spec uses) need not divide the per-rank
    sequence of a TE job."""
    sets = [*TP2_SP, "model.spec=te", "train.device=cuda", "model.params_dtype=bf16"]
    validate(load("tiny", [*sets, "overlap.tp_chunks=3"]), 2, "nccl")
    with pytest.raises(ConfigError, match="overlap.tp_chunks = 3"):
        validate(load("tiny", [*TP2_SP, "overlap.tp_chunks=3"]), 2, "gloo")


def test_te_plan_reaches_megatron_config():
    """What megatron-core's TE linears read to pass TE its ``ub_*`` arguments (config only)."""
    job = load("tiny", TE_BF16)
    plan = plan_tp_overlap(job, True, te_version="2.8.0")
    tconf = gpt.transformer_config(job, "cuda", plan)
    assert tconf.tp_comm_overlap and tconf.tp_comm_overlap_ag and tconf.tp_comm_overlap_rs
    assert not gpt.transformer_config(job, "cuda").tp_comm_overlap
