"""``release_model_caches``: megatron-core's class-level cache of ``RotaryEmbedding.forward`` keeps
every rotary module it has seen (and, through DDP's hooks, the whole model) alive until cleared."""

from __future__ import annotations

import gc
import weakref

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megascale.model.gpt import release_model_caches


class HostRotary(RotaryEmbedding):
    """The real cached ``forward``; only the table is built on the host (megatron-core's
    ``get_emb`` asks for the current CUDA device, which this process does not have)."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        return torch.zeros(max_seq_len, 1, 1, self.inv_freq.numel() * 2)


def test_release_lets_a_used_rotary_module_go():
    rotary = HostRotary(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    rotary(16)
    ref = weakref.ref(rotary)
    del rotary
    gc.collect()
    assert ref() is not None, "megatron-core no longer caches it: release_model_caches is moot"
    release_model_caches()
    gc.collect()
    assert ref() is None
