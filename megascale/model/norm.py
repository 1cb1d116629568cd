"""LayerNorm / RMSNorm for megatron-core's local spec that also works with sequence parallelism."""

from __future__ import annotations

import torch


class LocalNorm(torch.nn.Module):
    """torch's LayerNorm (or RMSNorm) that marks its parameters for sequence parallelism.

    megatron-core's ``WrappedTorchNorm`` refuses ``sequence_parallel``: with SP each TP rank normalises
    a different slice of the sequence, so the norm's weight gradients differ per rank and must be
    all-reduced over the TP group. ``finalize_model_grads`` does that for parameters carrying
    ``sequence_parallel = True``, which this class sets.

    Its parameters are made in ``config.params_dtype``, as megatron-core's own layers make theirs:
    nothing casts the model afterwards, and CUDA's LayerNorm refuses bf16 activations with fp32
    weights (only the CPU kernel mixes them).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused: object) -> None:
        super().__init__()
        dtype = config.params_dtype
        if config.normalization == "RMSNorm":
            self.norm: torch.nn.Module = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=dtype)
        elif config.normalization == "LayerNorm":
            self.norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)
        else:
            raise ValueError(
                f"normalization={config.normalization!r} is not supported; use LayerNorm or RMSNorm"
            )
        for param in self.norm.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden_states)
