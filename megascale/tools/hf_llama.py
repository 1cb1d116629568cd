"""Llama-style models between megascale and ``transformers``' ``LlamaForCausalLM``, both ways.

Pure: tensors, dicts and ``ModelConfig`` in, the same out (no process group, no files). Used by
``megascale export`` (``tools.export``) and ``megascale import`` (``tools.hf_import``).

A Llama-style megascale model is ``model.swiglu = true`` with ``normalization = "RMSNorm"`` and the
serial block. Its 1-process ``GPTModel.state_dict()`` (megatron-core's local spec, megascale's
``LocalNorm``) maps onto ``LlamaForCausalLM`` as follows (``N`` a layer index):

==========================================================  ========================================
megascale                                                   transformers
==========================================================  ========================================
``embedding.word_embeddings.weight`` [padded vocab, h]      ``model.embed_tokens.weight`` [vocab, h]
``decoder.layers.N.input_layernorm.norm.weight``            ``model.layers.N.input_layernorm.weight``
``decoder.layers.N.self_attention.linear_qkv.*``            ``...self_attn.{q,k,v}_proj.*`` (split)
``decoder.layers.N.self_attention.linear_proj.*``           ``...self_attn.o_proj.*``
``decoder.layers.N.pre_mlp_layernorm.norm.weight``          ``...post_attention_layernorm.weight``
``decoder.layers.N.mlp.linear_fc1.*`` ([gate; up])          ``...mlp.gate_proj.*``, ``...up_proj.*``
``decoder.layers.N.mlp.linear_fc2.*``                       ``...mlp.down_proj.*``
``decoder.final_layernorm.norm.weight``                     ``model.norm.weight``
``output_layer.weight`` (untied only)                       ``lm_head.weight`` [vocab, h]
==========================================================  ========================================

The fused QKV rows are grouped per query group: that group's query heads, then its key head, then
its value head (``split_qkv``). SwiGLU's fused fc1 is the gate's rows then the up projection's
(megatron-core applies the activation to the first half of its output). Both use RoPE on the two
halves of each head (megatron-core's ``rotary_interleaved = False`` is ``rotate_half``), which the
export's and the import's logit checks confirm. megascale pads the vocabulary rows to a multiple of
128 (times TP); the export cuts them to ``model.vocab_size`` and the import pads with zero rows.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megascale.config import ModelConfig

if TYPE_CHECKING:
    import torch

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
NORM_EPS = 1e-5
"""The epsilon of every megascale norm (megatron-core's ``layernorm_epsilon`` default)."""


class ConversionError(ValueError):
    """A model that cannot cross between megascale and ``transformers`` as asked; the message names
    the option or tensor and why, on one line (``export.ExportError`` is this class)."""


def split_qkv(
    fused: torch.Tensor, heads: int, groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's fused QKV weight ``[(heads + 2 * groups) * d, ...]`` (or bias) -> q, k, v.

    Rows are grouped per query group ``g``: its ``heads // groups`` query heads, then its key head,
    then its value head. Query head ``g * (heads // groups) + i`` attends with key/value head ``g``,
    which is ``transformers``' ``repeat_kv`` convention.
    """
    per_group = heads // groups
    head_dim = fused.shape[0] // (heads + 2 * groups)
    rest = fused.shape[1:]
    grouped = fused.reshape(groups, (per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(heads * head_dim, *rest),
        k.reshape(groups * head_dim, *rest),
        v.reshape(groups * head_dim, *rest),
    )


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int
) -> torch.Tensor:
    """The inverse of ``split_qkv``: separate q, k, v projections -> megatron's fused rows."""
    import torch

    head_dim = k.shape[0] // groups
    rest = q.shape[1:]
    q = q.reshape(groups, (heads // groups) * head_dim, *rest)
    k, v = k.reshape(groups, head_dim, *rest), v.reshape(groups, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape((heads + 2 * groups) * head_dim, *rest)


def is_llama(m: ModelConfig) -> bool:
    """Whether ``m`` exports as Llama (SwiGLU); ``check_exportable`` then says if it can."""
    return m.swiglu


def check_exportable(m: ModelConfig) -> None:
    """ConversionError naming the first option of a SwiGLU model ``LlamaForCausalLM`` lacks."""
    if m.normalization != "RMSNorm":
        raise ConversionError(
            f"model.normalization = {m.normalization!r} with model.swiglu = true: SwiGLU models "
            "export as LlamaForCausalLM, which normalises with RMSNorm; only 'RMSNorm' is exported"
        )
    if m.parallel_block:
        raise ConversionError(
            "model.parallel_block = true with model.swiglu = true: LlamaForCausalLM has the serial "
            "block only; not exported"
        )
    if m.window_size is not None:
        raise ConversionError(
            f"model.window_size = {m.window_size}: LlamaForCausalLM has no sliding-window "
            "attention; not exported"
        )


def config_fields(m: ModelConfig, facts: dict) -> dict:
    """``LlamaConfig`` fields for ``m`` given ``export.model_facts`` (+ ``eos_token_id``).

    ``model.hidden_dropout`` is not carried (Llama has no residual dropout; inference applies
    none either way)."""
    if facts["rotary_percent"] != 1.0:
        raise ConversionError(
            f"rotary_percent={facts['rotary_percent']}: {ARCHITECTURE} rotates whole heads"
        )
    return {
        "vocab_size": m.vocab_size,  # the padding rows are cut
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size or 4 * m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_query_groups or m.num_heads,
        "head_dim": m.hidden_size // m.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": m.seq_length,
        "rms_norm_eps": facts["eps"],
        "rope_parameters": {"rope_type": "default", "rope_theta": facts["rotary_base"]},
        "attention_bias": m.bias,
        "mlp_bias": m.bias,
        "attention_dropout": m.attention_dropout,
        "tie_word_embeddings": m.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": facts["eos_token_id"],
        "pad_token_id": None,
        "dtype": "bfloat16" if m.params_dtype == "bf16" else "float32",
    }


_LAYER = "decoder.layers."
_PLAIN = {  # megascale module in decoder.layers.N -> Llama module in model.layers.N
    "input_layernorm.norm": "input_layernorm",
    "self_attention.linear_proj": "self_attn.o_proj",
    "pre_mlp_layernorm.norm": "post_attention_layernorm",
    "mlp.linear_fc2": "mlp.down_proj",
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.norm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def to_hf(state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """megascale's 1-process ``GPTModel.state_dict()`` -> ``LlamaForCausalLM`` tensors
    (contiguous copies; vocabulary rows cut to ``m.vocab_size``). A tensor with no place in Llama
    raises ConversionError naming it, so a model feature added later is refused, not dropped."""
    heads, groups = m.num_heads, m.num_query_groups or m.num_heads
    out = {}
    for name, tensor in state.items():
        if name.endswith("._extra_state"):
            continue
        index, _, inner = name.removeprefix(_LAYER).partition(".")
        module, _, leaf = inner.rpartition(".")
        prefix = f"model.layers.{index}."
        if name in _TOP:
            out[_TOP[name]] = tensor[: m.vocab_size] if name in _VOCAB_ROWS else tensor
        elif not (name.startswith(_LAYER) and index.isdigit() and leaf in ("weight", "bias")):
            raise ConversionError(f"parameter {name!r} has no counterpart in {ARCHITECTURE}")
        elif module == "self_attention.linear_qkv":
            for proj, part in zip("qkv", split_qkv(tensor, heads, groups), strict=True):
                out[f"{prefix}self_attn.{proj}_proj.{leaf}"] = part
        elif module == "mlp.linear_fc1":
            gate, up = tensor.chunk(2, dim=0)
            out[f"{prefix}mlp.gate_proj.{leaf}"], out[f"{prefix}mlp.up_proj.{leaf}"] = gate, up
        elif module in _PLAIN:
            out[f"{prefix}{_PLAIN[module]}.{leaf}"] = tensor
        else:
            raise ConversionError(f"parameter {name!r} has no counterpart in {ARCHITECTURE}")
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}


def from_hf(
    tensors: dict[str, torch.Tensor], m: ModelConfig, padded_vocab: int
) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` tensors -> megascale's 1-process ``GPTModel.state_dict()`` names.

    Every tensor megascale's model of ``m`` holds must be there (ConversionError naming the first
    missing one) and every given tensor must be used (ConversionError naming it). The vocabulary
    rows are padded to ``padded_vocab`` with zeros (padding ids never occur as inputs; their
    logits are 0). Rotary ``inv_freq`` buffers, which some checkpoints hold, are skipped."""
    import torch

    heads, groups = m.num_heads, m.num_query_groups or m.num_heads
    left = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}

    def take(name: str) -> torch.Tensor:
        if name not in left:
            raise ConversionError(f"tensor {name!r} is missing from the Hugging Face model")
        return left.pop(name)

    def padded(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] != m.vocab_size:
            raise ConversionError(
                f"a vocabulary matrix has {t.shape[0]} rows; config.json says vocab_size = "
                f"{m.vocab_size}"
            )
        return torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])

    leaves = ("weight", "bias") if m.bias else ("weight",)
    out = {"embedding.word_embeddings.weight": padded(take("model.embed_tokens.weight"))}
    for i in range(m.num_layers):
        src, dst = f"model.layers.{i}.", f"{_LAYER}{i}."
        for leaf in leaves:
            q, k, v = (take(f"{src}self_attn.{p}_proj.{leaf}") for p in "qkv")
            out[f"{dst}self_attention.linear_qkv.{leaf}"] = fuse_qkv(q, k, v, heads, groups)
            gate, up = take(f"{src}mlp.gate_proj.{leaf}"), take(f"{src}mlp.up_proj.{leaf}")
            out[f"{dst}mlp.linear_fc1.{leaf}"] = torch.cat([gate, up])
        for ours, theirs in _PLAIN.items():
            for leaf in leaves if not ours.endswith(".norm") else ("weight",):
                out[f"{dst}{ours}.{leaf}"] = take(f"{src}{theirs}.{leaf}")
    out["decoder.final_layernorm.norm.weight"] = take("model.norm.weight")
    if not m.tie_embeddings:
        out["output_layer.weight"] = padded(take("lm_head.weight"))
    else:
        left.pop("lm_head.weight", None)  # a tied model may store the shared matrix twice
    if left:
        raise ConversionError(
            f"tensor {sorted(left)[0]!r} of the Hugging Face model has no place in megascale's "
            f"model ({len(left)} unused tensors)"
        )
    return out


def model_fields(config: dict) -> dict:
    """megascale ``model`` fields for a ``LlamaForCausalLM`` ``config.json`` (as a dict), or
    ConversionError naming the field it cannot express. Reads both config styles: ``rope_theta`` /
    ``rope_scaling`` (transformers < 5) and ``rope_parameters`` (5.x)."""
    archs, model_type = config.get("architectures") or [], config.get("model_type")
    if model_type != MODEL_TYPE and ARCHITECTURE not in archs:
        raise ConversionError(
            f"model_type {model_type!r} (architectures {archs}): import reads {ARCHITECTURE} "
            "(model_type 'llama') only"
        )
    rope = {}
    for field in ("rope_scaling", "rope_parameters"):
        rope.update(config.get(field) or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ConversionError(
                f"{field} type {kind!r}: megascale's RoPE has no scaling (only 'default' is "
                "imported)"
            )
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if theta != int(theta):
        raise ConversionError(f"rope_theta = {theta}: megascale's model.rotary_base is an integer")
    if (act := config.get("hidden_act", "silu")) != "silu":
        raise ConversionError(f"hidden_act = {act!r}: megascale's SwiGLU uses 'silu'")
    bias = bool(config.get("attention_bias", False))
    if bool(config.get("mlp_bias", False)) != bias:
        raise ConversionError(
            f"attention_bias = {bias} and mlp_bias = {not bias}: megascale's model.bias is one "
            "switch for every linear layer"
        )
    eps = float(config.get("rms_norm_eps", 1e-6))
    if not math.isclose(eps, NORM_EPS, rel_tol=1e-6):
        raise ConversionError(f"rms_norm_eps = {eps}: megascale's norms use {NORM_EPS}")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if config.get("head_dim") not in (None, hidden // heads) or hidden % heads:
        raise ConversionError(
            f"head_dim = {config.get('head_dim')}: megascale's heads are hidden_size / "
            f"num_attention_heads = {hidden / heads:g} wide"
        )
    groups = int(config.get("num_key_value_heads") or heads)
    dtype = config.get("dtype", config.get("torch_dtype")) or "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConversionError(f"dtype = {dtype!r}: megascale trains in float32 or bfloat16")
    return {
        "num_layers": int(config["num_hidden_layers"]),
        "hidden_size": hidden,
        "num_heads": heads,
        "num_query_groups": None if groups == heads else groups,
        "ffn_hidden_size": int(config["intermediate_size"]),
        "seq_length": int(config.get("max_position_embeddings", 2048)),
        "vocab_size": int(config["vocab_size"]),
        "parallel_block": False,
        "window_size": None,
        "swiglu": True,
        "normalization": "RMSNorm",
        "bias": bias,
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "rotary_base": int(theta),
        "params_dtype": "bf16" if dtype == "bfloat16" else "fp32",  # float16 is exact in fp32
        "attention_dropout": float(config.get("attention_dropout", 0.0)),
    }
