"""MegaScale's parallel transformer block: y = x + Attn(LN(x)) + MLP(LN(x)).

The serial block computes the MLP on the attention's output; the parallel block (GPT-J, PaLM,
MegaScale) feeds attention and MLP the same normalised input, so the two branches are independent
and their GEMMs (and, under tensor parallelism, their communication) can be scheduled together.
MegaScale credits it with +4.6 MFU points at 175B scale.

Parameters are the serial layer's minus ``pre_mlp_layernorm`` (the spec sets it to ``IdentityOp``),
so the same TP/SP sharding, checkpoints and parameter names apply.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor


class ParallelTransformerLayer(TransformerLayer):
    """A megatron-core ``TransformerLayer`` whose attention and MLP read the same LN(x)."""

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
