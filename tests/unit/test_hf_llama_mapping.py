"""The Llama mapping's pure parts: QKV fusing, both directions of the tensor mapping, the config
fields read from a ``LlamaForCausalLM`` config.json, and what is refused (one line, the field)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megascale.config import ModelConfig
from megascale.tools import hf_llama
from megascale.tools.export import LLAMA, ExportError, choose_architecture

LLAMA_M = ModelConfig(
    num_layers=2,
    hidden_size=16,
    num_heads=4,
    num_query_groups=2,
    ffn_hidden_size=24,
    vocab_size=300,
    swiglu=True,
    normalization="RMSNorm",
    bias=False,
    tie_embeddings=False,
)


@pytest.mark.parametrize(("heads", "groups"), [(4, 4), (4, 2), (4, 1), (6, 3)])
def test_fuse_qkv_inverts_split_qkv(heads, groups):
    fused = torch.randn((heads + 2 * groups) * 3, 5)
    q, k, v = hf_llama.split_qkv(fused, heads, groups)
    assert torch.equal(hf_llama.fuse_qkv(q, k, v, heads, groups), fused)
    bias = torch.randn((heads + 2 * groups) * 3)
    assert torch.equal(
        hf_llama.fuse_qkv(*hf_llama.split_qkv(bias, heads, groups), heads, groups), bias
    )


def _hf_tensors(m: ModelConfig) -> dict[str, torch.Tensor]:
    h, f, d = m.hidden_size, m.ffn_hidden_size, m.hidden_size // m.num_heads
    kv = (m.num_query_groups or m.num_heads) * d
    leaves = ("weight", "bias") if m.bias else ("weight",)
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h)}
    shapes |= {"self_attn.o_proj": (h, h), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h)}
    shapes |= {"mlp.down_proj": (h, f)}
    out = {"model.embed_tokens.weight": torch.randn(m.vocab_size, h)}
    for i in range(m.num_layers):
        for module, shape in shapes.items():
            for leaf in leaves:
                out[f"model.layers.{i}.{module}.{leaf}"] = torch.randn(
                    shape if leaf == "weight" else shape[:1]
                )
        out[f"model.layers.{i}.input_layernorm.weight"] = torch.randn(h)
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.randn(h)
    out["model.norm.weight"] = torch.randn(h)
    if not m.tie_embeddings:
        out["lm_head.weight"] = torch.randn(m.vocab_size, h)
    return out


@pytest.mark.parametrize(("bias", "tied"), [(False, False), (True, True)])
def test_from_hf_then_to_hf_gives_back_every_tensor(bias, tied):
    m = dataclasses.replace(LLAMA_M, bias=bias, tie_embeddings=tied)
    theirs = _hf_tensors(m)
    ours = hf_llama.from_hf(dict(theirs), m, 384)
    embedding = ours["embedding.word_embeddings.weight"]
    assert embedding.shape == (384, 16) and not embedding[300:].any()  # zero padding rows
    assert ("output_layer.weight" in ours) is not tied
    assert ours["decoder.layers.1.mlp.linear_fc1.weight"].shape == (48, 16)  # [gate; up]
    assert torch.equal(
        ours["decoder.layers.1.mlp.linear_fc1.weight"][:24],
        theirs["model.layers.1.mlp.gate_proj.weight"],
    )
    back = hf_llama.to_hf(ours, m)
    assert back.keys() == theirs.keys()
    assert all(torch.equal(back[k], theirs[k]) for k in theirs)


def test_from_hf_names_a_missing_or_an_unused_tensor():
    theirs = _hf_tensors(LLAMA_M)
    del theirs["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(
        hf_llama.ConversionError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"
    ):
        hf_llama.from_hf(theirs, LLAMA_M, 384)
    extra = {**_hf_tensors(LLAMA_M), "model.layers.0.self_attn.q_norm.weight": torch.ones(4)}
    with pytest.raises(hf_llama.ConversionError, match="q_norm.weight' of the Hugging Face model"):
        hf_llama.from_hf(extra, LLAMA_M, 384)


CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 500,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}


def test_model_fields_of_a_llama_config():
    fields = hf_llama.model_fields(CONFIG)
    m = dataclasses.replace(ModelConfig(), **fields)
    assert (m.num_query_groups, m.ffn_hidden_size, m.rotary_base) == (2, 176, 500000)
    assert (m.params_dtype, m.bias, m.tie_embeddings, m.seq_length) == ("bf16", False, False, 64)
    assert choose_architecture(m) is LLAMA
    # transformers < 5 writes rope_theta at the top level
    old = {k: v for k, v in CONFIG.items() if k != "rope_parameters"} | {"rope_theta": 1e4}
    assert hf_llama.model_fields(old)["rotary_base"] == 10000


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type 'gpt2'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling type 'llama3'"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
            "rope_parameters type 'yarn'",
        ),
        ({"rope_parameters": {"rope_theta": 1e4 + 0.5}}, "rope_theta = 10000.5"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        ({"attention_bias": True}, "attention_bias = True and mlp_bias = False"),
        ({"rms_norm_eps": 1e-6}, "rms_norm_eps = 1e-06"),
        ({"head_dim": 32}, "head_dim = 32"),
        ({"dtype": "float8_e4m3fn"}, "dtype = 'float8_e4m3fn'"),
    ],
)
def test_what_megascale_cannot_express_is_refused(change, needle):
    with pytest.raises(
        hf_llama.ConversionError, match=needle.replace(".", r"\.").replace("(", r"\(")
    ) as e:
        hf_llama.model_fields({**CONFIG, **change})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"normalization": "LayerNorm"}, "model.normalization = 'LayerNorm' with model.swiglu"),
        ({"parallel_block": True}, "model.parallel_block = true"),
        ({"window_size": 8}, "model.window_size = 8: LlamaForCausalLM"),
    ],
)
def test_swiglu_models_llama_cannot_express_are_not_exported(change, needle):
    with pytest.raises(ExportError, match=needle.replace(".", r"\.")):
        choose_architecture(dataclasses.replace(LLAMA_M, **change))


def test_llama_config_fields_build_a_llama_config():
    transformers = pytest.importorskip("transformers")
    facts = {"eps": 1e-5, "rotary_base": 5e5, "rotary_percent": 1.0, "eos_token_id": 0}
    fields = hf_llama.config_fields(dataclasses.replace(LLAMA_M, params_dtype="bf16"), facts)
    config = transformers.AutoConfig.for_model("llama", **fields)
    assert (config.vocab_size, config.num_key_value_heads, config.head_dim) == (300, 2, 4)
    assert (config.attention_bias, config.mlp_bias, config.tie_word_embeddings) == (False,) * 3
    assert config.rope_parameters["rope_theta"] == 5e5 and fields["dtype"] == "bfloat16"


class _Storage:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def read_bytes(self, rel: str) -> bytes:
        assert rel == "step_00000004/.metadata", rel
        return self.data


def _metadata(key: str) -> bytes:
    import pickle

    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    size = torch.Size([2, 64])
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=size)
    meta = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, [chunk])
    return pickle.dumps(Metadata(state_dict_metadata={key: meta}, storage_data={}))


def test_a_checkpoint_of_the_te_spec_is_refused_by_name():
    from megascale.tools.export import _check_spec

    te = "module.decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    with pytest.raises(ExportError, match="saved with model.spec = 'te'.*layer_norm_weight"):
        _check_spec(_Storage(_metadata(te)), 4)
    _check_spec(_Storage(_metadata("module.decoder.layers.input_layernorm.norm.weight")), 4)
