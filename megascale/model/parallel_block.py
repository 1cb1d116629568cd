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
With ``tp_overlap_chunks > 1`` both shared collectives are also chunked and pipelined with the GEMMs:
QKV and fc1 run chunk by chunk as the gather of LN(x) lands, and the output projection and fc2 run
chunk by chunk with each chunk's reduce-scatter in flight behind the next (backward likewise).
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

from megascale.overlap.tp import all_gather_linears, linears_reduce_scatter


class ParallelTransformerLayer(TransformerLayer):
    """A megatron-core ``TransformerLayer`` whose attention and MLP read the same LN(x)."""

    def __init__(
        self, *args, fused_tp_comm: bool = False, tp_overlap_chunks: int = 1, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.fused_tp_comm = fused_tp_comm
        self.tp_overlap_chunks = tp_overlap_chunks

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
        k = self.tp_overlap_chunks
        pipelined = k > 1 and normed.shape[0] % k == 0
        qkv, proj = self.self_attention.linear_qkv, self.self_attention.linear_proj
        fc1, fc2 = self.mlp.linear_fc1, self.mlp.linear_fc2
        if pipelined:
            _run_forward_pre_hooks(qkv, fc1)
            # One chunked gather of LN(x), each chunk's QKV and fc1 GEMMs run as it lands; the
            # branches' linears then return these outputs, and their row-parallel inputs
            # (deferred) come back for the chunked GEMM + reduce-scatter below.
            qkv.precomputed, fc1.precomputed = all_gather_linears(
                normed, [qkv.weight, fc1.weight], k, group
            )
            full = normed  # unused by the linears: they hold their outputs already
        else:
            # One all-gather of LN(x) for both branches (backward: one reduce-scatter of grads).
            full = gather_from_sequence_parallel_region(normed, group=group)
        proj.defer_gemm = fc2.defer_gemm = pipelined
        try:
            attention_partial, attention_bias_out = self.self_attention(
                full,
                attention_mask=attention_mask,
                rotary_pos_emb=rotary_pos_emb,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )
            mlp_partial, mlp_bias = self.mlp(full)
        finally:
            proj.defer_gemm = fc2.defer_gemm = False
            qkv.precomputed = fc1.precomputed = None
        # One reduce-scatter of the summed partial outputs; biases (replicated) added after it.
        if pipelined:
            pairs = [(attention_partial, proj.weight), (mlp_partial, fc2.weight)]
            out = linears_reduce_scatter(pairs, k, group)
        else:
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


def _run_forward_pre_hooks(*modules: torch.nn.Module) -> None:
    """Run the modules' forward pre-hooks now: their weights are read before their own forward
    runs, and the distributed optimizer's overlapped param all-gather is waited for in those hooks
    (idempotent: running them again at the modules' forward is harmless)."""
    for module in modules:
        for key, hook in list(module._forward_pre_hooks.items()):
            if key in module._forward_pre_hooks_with_kwargs:
                hook(module, (), {})
            else:
                hook(module, ())


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b
