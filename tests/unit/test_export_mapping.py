"""The export's pure parts: architecture choice and refusals, QKV un-interleaving, name mapping."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megascale.config import ModelConfig
from megascale.tools.export import (
    PHI,
    STARCODER2,
    ExportError,
    choose_architecture,
    convert,
    hf_config_fields,
    split_qkv,
)


def _fused_qkv(heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """Megatron's layout with every row labelled: 1000 * kind (0 q, 1 k, 2 v) + 10 * head + dim
    (head: the query head's global index for q, the group for k and v)."""
    rows = []
    per_group = heads // groups
    for g in range(groups):
        for i in range(per_group):
            rows += [10 * (g * per_group + i) + d for d in range(head_dim)]
        rows += [1000 + 10 * g + d for d in range(head_dim)]
        rows += [2000 + 10 * g + d for d in range(head_dim)]
    return torch.tensor(rows, dtype=torch.float32)


@pytest.mark.parametrize(("heads", "groups"), [(4, 4), (4, 2), (4, 1), (6, 3)])
def test_split_qkv_puts_heads_in_transformers_order(heads, groups):
    head_dim = 3
    bias = _fused_qkv(heads, groups, head_dim)
    q, k, v = split_qkv(bias, heads, groups)
    assert q.tolist() == [10 * h + d for h in range(heads) for d in range(head_dim)]
    assert k.tolist() == [1000 + 10 * g + d for g in range(groups) for d in range(head_dim)]
    assert v.tolist() == [2000 + 10 * g + d for g in range(groups) for d in range(head_dim)]
    # A weight splits the same way along its rows; columns stay with their row.
    weight = torch.stack([bias, -bias], dim=1)
    qw, kw, vw = split_qkv(weight, heads, groups)
    assert torch.equal(qw[:, 0], q) and torch.equal(kw[:, 1], -k) and torch.equal(vw[:, 0], v)


def test_serial_block_is_starcoder2_and_parallel_block_is_phi():
    assert choose_architecture(ModelConfig()) is STARCODER2
    assert choose_architecture(ModelConfig(window_size=16, num_query_groups=2)) is STARCODER2
    assert choose_architecture(ModelConfig(parallel_block=True)) is PHI


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"swiglu": True}, "model.normalization = 'LayerNorm' with model.swiglu = true"),
        ({"normalization": "RMSNorm"}, "model.normalization = 'RMSNorm' with model.swiglu = false"),
        ({"parallel_block": True, "window_size": 8}, "model.window_size = 8"),
    ],
)
def test_features_without_a_counterpart_are_refused(changes, needle):
    with pytest.raises(ExportError, match=needle.replace(".", r"\.")) as e:
        choose_architecture(dataclasses.replace(ModelConfig(), **changes))
    assert "\n" not in str(e.value)


def _state(hidden: int = 8, vocab: int = 16) -> dict[str, torch.Tensor]:
    """A 1-layer serial-block state_dict (shapes matter only for the fused QKV tensors)."""
    layer = [
        "input_layernorm.norm",
        "self_attention.linear_qkv",
        "self_attention.linear_proj",
        "pre_mlp_layernorm.norm",
        "mlp.linear_fc1",
        "mlp.linear_fc2",
    ]
    names = [f"decoder.layers.0.{module}.{leaf}" for module in layer for leaf in ("weight", "bias")]
    state = {name: torch.randn(hidden) for name in names}
    state["decoder.layers.0.self_attention.linear_qkv.weight"] = torch.randn(3 * hidden, hidden)
    state["decoder.layers.0.self_attention.linear_qkv.bias"] = torch.randn(3 * hidden)
    state["embedding.word_embeddings.weight"] = torch.randn(vocab, hidden)
    state["decoder.final_layernorm.norm.weight"] = torch.randn(hidden)
    state["decoder.final_layernorm.norm.bias"] = torch.randn(hidden)
    return state


def test_convert_maps_every_tensor_and_refuses_unknown_ones():
    m = ModelConfig(num_layers=1, hidden_size=8, num_heads=2)
    state = _state()
    out = convert(state, m, STARCODER2, 16)
    assert torch.equal(
        out["model.layers.0.mlp.c_fc.bias"], state["decoder.layers.0.mlp.linear_fc1.bias"]
    )
    assert torch.equal(
        out["model.layers.0.post_attention_layernorm.weight"],
        state["decoder.layers.0.pre_mlp_layernorm.norm.weight"],
    )
    assert {"model.layers.0.self_attn.q_proj.weight", "model.norm.bias"} <= out.keys()
    assert len(out) == len(state) + 4  # the fused QKV weight and bias became three tensors each

    phi = convert({k: v for k, v in state.items() if "pre_mlp" not in k}, m, PHI, 16)
    assert torch.equal(phi["lm_head.bias"], torch.zeros(16))
    assert "model.final_layernorm.weight" in phi and "model.layers.0.self_attn.dense.bias" in phi
    with pytest.raises(ExportError, match="pre_mlp_layernorm.*PhiForCausalLM"):
        convert(state, m, PHI, 16)  # a serial block's second LayerNorm has no place in Phi
    extra = {**state, "decoder.layers.0.self_attention.q_layernorm.weight": torch.ones(4)}
    with pytest.raises(ExportError, match="q_layernorm"):
        convert(extra, m, STARCODER2, 16)


def test_a_multi_rank_job_becomes_a_valid_one_rank_cpu_job():
    from megascale.config import load, validate
    from megascale.tools.export import _one_rank_job

    sets = ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.sequence_parallel=true"]
    job = validate(load("tiny", [*sets, "parallel.batch_p2p_comm=false"]), 8, "gloo")
    one = _one_rank_job(job)
    p = one.parallel
    assert (p.tp, p.pp, p.vpp, p.dp, p.sequence_parallel) == (1, 1, 1, 1, False)
    assert (one.model.spec, one.train.device, one.data.path) == ("local", "cpu", None)
    assert one.model == dataclasses.replace(job.model, spec="local")
    assert one.optim == job.optim and one.checkpoint == job.checkpoint


FACTS = {
    "eps": 1e-5,
    "rotary_base": 1e4,
    "rotary_percent": 1.0,
    "vocab_size": 384,
    "eos_token_id": 0,
}


def test_hf_config_fields_carry_the_model_settings():
    transformers = pytest.importorskip("transformers")
    m = ModelConfig(num_query_groups=2, window_size=16, hidden_dropout=0.1, attention_dropout=0.05)
    fields = hf_config_fields(STARCODER2, m, FACTS)
    config = transformers.AutoConfig.for_model("starcoder2", **fields)
    assert (config.sliding_window, config.num_key_value_heads, config.vocab_size) == (16, 2, 384)
    assert (config.residual_dropout, config.embedding_dropout) == (0.1, 0.1)
    assert (config.attention_dropout, config.norm_epsilon, config.hidden_act) == (
        0.05,
        1e-5,
        "gelu",
    )
    assert config.tie_word_embeddings and config.use_bias and config.eos_token_id == 0

    phi = hf_config_fields(PHI, ModelConfig(parallel_block=True), {**FACTS, "rotary_percent": 0.5})
    assert phi["rope_parameters"]["partial_rotary_factor"] == 0.5 and "sliding_window" not in phi
    with pytest.raises(ExportError, match="rotary_percent=0.5: Starcoder2ForCausalLM"):
        hf_config_fields(STARCODER2, m, {**FACTS, "rotary_percent": 0.5})
