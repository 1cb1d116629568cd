"""Suite-wide setup.

The pytest process runs no parallel CPU kernels: torch's intra-op threads are GNU OpenMP's, and
libgomp's thread pool does not survive ``fork``. A process that has run an OpenMP parallel region
and then forks leaves its child hanging in the child's first parallel region (seen with the CUDA
build of torch: a forked rank stuck in ``torch.zeros``). The multi-rank tests fork their ranks
from this process, so it stays on one intra-op thread and never starts the pool; each rank sets
its own thread count (``train.run``), with a pool of its own.
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)
