"""What a GPU run computes is what the CPU run computes: one seed gives one initial model on any
device, and the MLP's GeLU is the exact one on CUDA too (the one ``megascale export`` declares)."""

from __future__ import annotations

import torch

from megascale.config import load
from megascale.model import gpt


def test_initial_weights_are_drawn_on_the_cpu_generator_whatever_the_device():
    name, shape = "decoder.layers.0.mlp.linear_fc1.weight", (8, 4)
    on_cpu = gpt._full_tensor(name, shape, 1234, 0.02, 2, torch.device("cpu"))
    # The meta device has no generator of its own: drawing there needs the CPU's, as CUDA does.
    on_meta = gpt._full_tensor(name, shape, 1234, 0.02, 2, torch.device("meta"))
    assert on_meta.device.type == "meta" and on_meta.shape == on_cpu.shape
    again = gpt._full_tensor(name, shape, 1234, 0.02, 2, torch.device("cpu"))
    assert torch.equal(on_cpu, again) and on_cpu.std() > 0


def test_the_mlp_gelu_is_never_the_fused_tanh_approximation_on_cuda():
    for swiglu in ("false", "true"):
        job = load("tiny", [f"model.swiglu={swiglu}"])
        assert gpt.transformer_config(job, "cuda").bias_activation_fusion is False
        assert gpt.transformer_config(job, "cpu").bias_activation_fusion is False
