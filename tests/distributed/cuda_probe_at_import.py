"""Imported by a zygote in tests/distributed/test_fork_safety.py: probes CUDA at import time, as
megatron-core and Transformer Engine do."""

import torch

AVAILABLE = torch.cuda.is_available()
