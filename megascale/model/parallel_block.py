"""MegaScale's parallel transformer block: y = x + Attn(LN(x)) + MLP(LN(x)).

The serial block computes the MLP on the attention's output; the parallel block (GPT-J, PaLM,
MegaScale) feeds attention and MLP the same normalised input, so the two branches are independent
and their GEMMs (and, under tensor parallelism, their communication) can be scheduled together.
MegaScale credits it with +4.6 MFU points at 175B scale.

Parameters are the serial layer's minus ``pre_mlp_layernorm`` (the spec sets it to ``IdentityOp``),
so the same TP/SP sharding, checkpoints and parameter names apply.

Shared communication (``fused_tp_comm``, local spec with sequence parallelism and ``overlap.tp``):
both branches read the same LN(x), so one all-gather of it serves both, and their row-parallel
outputs are partial sums that can be added before ONE reduce-scatter — half the serial block's
TP collectives per layer. The spec then builds the branches' linears as
``GatheredInputColumnParallelLinear`` / ``PartialRowParallelLinear`` (``megascale.overlap.tp``).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor


class ParallelTransformerLayer(TransformerLayer):
    """A megatron-core ``TransformerLayer`` whose attention and MLP read the same LN(x)."""

    def __init__(self, *args, fused_tp_comm: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fused_tp_comm = fused_tp_comm

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        **unused: Any,
    ) -> tuple[torch.Tensor, None]:
        if unused.get("context") is not None or unused.get("inference_context") is not None:
            raise NotImplementedError(
                "the parallel block supports training self-attention only "
                "(no cross-attention, no inference context)"
            )
        residual = hidden_states
        # With sequence parallelism hidden_states is this rank's [s/tp, b, h] slice; LN is local, and
        # each branch's column-parallel input all-gathers the sequence itself.
        normed = self.input_layernorm(hidden_states)
        if self.fused_tp_comm:
            return self._forward_fused_tp_comm(
                residual, normed, attention_mask, rotary_pos_emb, attention_bias, packed_seq_params
            )
        attention_out = self.self_attention(
            normed,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )
        mlp_out = self.mlp(normed)
        with self.bias_dropout_add_exec_handler():
            hidden = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
                attention_out, residual, self.hidden_dropout
            )
            hidden = self.mlp_bda(self.training, self.config.bias_dropout_fusion)(
                mlp_out, hidden, self.hidden_dropout
            )
        output = make_viewless_tensor(
            inp=hidden, requires_grad=hidden.requires_grad, keep_graph=True
        )
        return output, None

    def _forward_fused_tp_comm(
        self, residual, normed, attention_mask, rotary_pos_emb, attention_bias, packed_seq_params
    ) -> tuple[torch.Tensor, None]:
        group = self.pg_collection.tp
        # One all-gather of LN(x) for both branches (backward: one reduce-scatter of their grads).
        full = gather_from_sequence_parallel_region(normed, group=group)
        attention_partial, attention_bias_out = self.self_attention(
            full,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )
        mlp_partial, mlp_bias = self.mlp(full)
        # One reduce-scatter of the summed partial outputs; biases (replicated) added after it.
        out = reduce_scatter_to_sequence_parallel_region(
            attention_partial + mlp_partial, group=group
        )
        bias = _add(attention_bias_out, mlp_bias)
        with self.bias_dropout_add_exec_handler():
            hidden = self.mlp_bda(self.training, self.config.bias_dropout_fusion)(
                (out, bias), residual, self.hidden_dropout
            )
        output = make_viewless_tensor(
            inp=hidden, requires_grad=hidden.requires_grad, keep_graph=True
        )
        return output, None


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b
