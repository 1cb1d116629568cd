"""``LocalNorm``, the local spec's LayerNorm / RMSNorm: its parameters are made in the model's
``params_dtype`` (nothing casts the model later, and a CUDA LayerNorm refuses bf16 activations
with fp32 weights), and marked for sequence parallelism as the config says."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megascale.model.norm import LocalNorm


def _config(normalization: str, dtype: torch.dtype, sequence_parallel: bool = False):
    """The fields of megatron-core's TransformerConfig that ``LocalNorm`` reads."""
    return SimpleNamespace(
        normalization=normalization, params_dtype=dtype, sequence_parallel=sequence_parallel
    )


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_norm_parameters_are_made_in_the_models_dtype(normalization, dtype):
    norm = LocalNorm(_config(normalization, dtype, sequence_parallel=True), hidden_size=8)
    params = dict(norm.named_parameters())
    assert params, "a norm without parameters"
    assert {name: p.dtype for name, p in params.items()} == dict.fromkeys(params, dtype)
    assert all(p.sequence_parallel for p in params.values())
    x = torch.randn(2, 8, dtype=dtype)
    assert norm(x).dtype == dtype


def test_an_unknown_normalization_is_refused_naming_it():
    with pytest.raises(ValueError, match="normalization='BatchNorm'.*LayerNorm or RMSNorm"):
        LocalNorm(_config("BatchNorm", torch.float32), hidden_size=8)
