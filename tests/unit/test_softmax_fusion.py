"""The fused masked softmax never drops the sliding window (``model.gpt.use_masked_softmax_fusion``).

megatron-core 0.16's fused causal softmax kernel ignores ``window_size``; on CUDA in bf16/fp16 with
its kernels importable, turning the fusion on would silently train full causal attention.
"""

from __future__ import annotations

import pytest

from megascale.config import load
from megascale.model import gpt


@pytest.mark.parametrize(
    ("on_cuda", "kernels", "window", "fused"),
    [
        (True, True, None, True),  # full causal attention: the fused kernel is exact
        (True, True, 16, False),  # its causal kernel ignores window_size: never
        (True, True, 4096, False),
        (True, False, None, False),
        (False, True, None, False),
        (False, False, 16, False),
    ],
)
def test_masked_softmax_fusion_decision(on_cuda, kernels, window, fused):
    assert gpt.use_masked_softmax_fusion(on_cuda, kernels, window) is fused


@pytest.mark.parametrize("window", [None, 16])
def test_cuda_bf16_config_keeps_the_window_when_fused_kernels_import(monkeypatch, window):
    """What a GPU with megatron's softmax kernels gets (the config only: nothing runs on CUDA)."""
    monkeypatch.setattr(gpt, "_softmax_kernels_available", lambda: True)
    sets = ["model.params_dtype=bf16"] + ([f"model.window_size={window}"] if window else [])
    tconf = gpt.transformer_config(load("tiny", sets), "cuda")
    assert tconf.masked_softmax_fusion is (window is None)
    assert tconf.window_size == (None if window is None else (window - 1, 0))
