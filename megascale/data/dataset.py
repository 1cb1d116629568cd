"""GPT samples from a token file, in a seeded global order, sharded over data-parallel ranks.

Sampling (``GPTDataset``): the token file's documents, each ending with the EOD id, form one
stream. Sample ``i`` is the ``seq_length + 1`` tokens starting at ``i * seq_length`` (consecutive
samples share one token, so every token except the first is a label exactly once per epoch);
``tokens = sample[:-1]`` and ``labels = sample[1:]``. Samples cross document boundaries; the EOD
token tells the model where one ends. ``loss_mask`` is all ones and ``position_ids`` are
``0..seq_length-1`` for every sample (no per-document position or attention reset).

Order (``epoch_order``): epoch ``e`` visits all samples once, in the permutation drawn by
``numpy.random.default_rng((seed, e))``. Global sample ``g`` of the run is sample
``epoch_order(n, seed, g // n)[g % n]``, where ``n = len(dataset)``. The order depends on
nothing but ``seed`` and the dataset, never on the parallel layout or batch sizes.

Sharding (``ShardedBatches``): optimizer step ``k`` consumes global samples
``consumed .. consumed + global_batch_size - 1``. Data-parallel rank ``r`` of ``dp_size`` takes
the *contiguous* block ``r * per_rank .. (r + 1) * per_rank - 1`` of them
(``per_rank = global_batch_size // dp_size``) and cuts it into micro-batches of
``micro_batch_size`` in order. Concatenating the ranks' micro-batches rank by rank therefore gives
exactly the samples, in the same order, of a 1-process run with the same global batch size; this is
what the distributed-vs-1-process equivalence tests rely on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import lru_cache

import numpy as np
import torch

from megascale.data.token_file import TokenFile, TokenFileError

logger = logging.getLogger(__name__)


class GPTDataset:
    """Fixed-length samples of ``seq_length + 1`` tokens cut from a token file's stream.

    ``len(ds)`` is ``(num_tokens - 1) // seq_length``; the tail that does not fill a sample is
    never used. ``ds[i]`` returns an int64 array of ``seq_length + 1`` token ids.
    """

    def __init__(self, token_file: TokenFile, seq_length: int):
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length}; accepted: >= 1")
        self.token_file = token_file
        self.seq_length = seq_length
        self._num_samples = (token_file.num_tokens - 1) // seq_length
        if self._num_samples < 1:
            raise TokenFileError(
                f"{token_file.prefix}: {token_file.num_tokens} tokens, need at least "
                f"{seq_length + 1} for one sample of seq_length={seq_length}"
            )

    def __len__(self) -> int:
        return self._num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self._num_samples:
            raise IndexError(f"sample {i} out of range (dataset has {self._num_samples})")
        start = i * self.seq_length
        return np.asarray(self.token_file.tokens[start : start + self.seq_length + 1], np.int64)


@lru_cache(maxsize=4)
def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of ``range(num_samples)`` for ``epoch``; a pure function of its arguments.

    Seeded with ``numpy.random.default_rng((seed, epoch))``. Read-only result (it is cached).
    """
    perm = np.random.default_rng((seed, epoch)).permutation(num_samples)
    perm.flags.writeable = False
    return perm


def global_sample_index(dataset_len: int, seed: int, g: int) -> int:
    """The dataset index of global sample ``g`` (across epochs) of a run seeded with ``seed``."""
    epoch, pos = divmod(g, dataset_len)
    return int(epoch_order(dataset_len, seed, epoch)[pos])


def collate(samples: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """One micro-batch dict from samples of ``seq_length + 1`` tokens (CPU tensors).

    Keys: ``tokens`` and ``labels`` (int64 [mbs, seq]), ``loss_mask`` (float32 [mbs, seq], ones),
    ``position_ids`` (int64 [mbs, seq], 0..seq-1 in every row).
    """
    stacked = torch.from_numpy(np.stack(samples))
    mbs, seq = stacked.shape[0], stacked.shape[1] - 1
    return {
        "tokens": stacked[:, :-1].contiguous(),
        "labels": stacked[:, 1:].contiguous(),
        "loss_mask": torch.ones(mbs, seq, dtype=torch.float32),
        "position_ids": torch.arange(seq, dtype=torch.int64).expand(mbs, seq).contiguous(),
    }


class ShardedBatches:
    """This data-parallel rank's micro-batches, step by step, resumable from plain-int state.

    Contract: call ``next_step()`` once per optimizer step; it returns
    ``global_batch_size // (dp_size * micro_batch_size)`` micro-batch dicts (see ``collate``).
    ``state_dict()`` after k steps and ``load_state_dict`` into a fresh instance (any dp layout)
    continue with exactly the samples an uninterrupted run would have used. Raises ValueError if
    ``global_batch_size`` is not a multiple of ``dp_size * micro_batch_size``.
    """

    def __init__(
        self,
        dataset: GPTDataset,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank}, dp_size={dp_size}; need 0 <= dp_rank < dp_size")
        if micro_batch_size < 1 or global_batch_size % (dp_size * micro_batch_size):
            raise ValueError(
                f"global_batch_size={global_batch_size} must be a positive multiple of "
                f"dp_size * micro_batch_size = {dp_size} * {micro_batch_size}"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.step = 0
        self.consumed_samples = 0

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step on this rank."""
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)

    def sample_indices(self, step_start: int) -> list[int]:
        """Dataset indices of this rank's samples for the step starting at global sample
        ``step_start``, in micro-batch order."""
        per_rank = self.global_batch_size // self.dp_size
        first = step_start + self.dp_rank * per_rank
        n = len(self.dataset)
        return [global_sample_index(n, self.seed, g) for g in range(first, first + per_rank)]

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches for the next optimizer step; advances the state."""
        idx = self.sample_indices(self.consumed_samples)
        mbs = self.micro_batch_size
        batches = [
            collate([self.dataset[i] for i in idx[j : j + mbs]]) for j in range(0, len(idx), mbs)
        ]
        self.step += 1
        self.consumed_samples += self.global_batch_size
        return batches

    def state_dict(self) -> dict[str, int]:
        """Plain ints: ``step``, ``consumed_samples`` (global, over all ranks) and ``seed``."""
        return {"step": self.step, "consumed_samples": self.consumed_samples, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from ``state``. ``consumed_samples`` decides the next sample, so resuming with
        another dp layout or global batch size stays on the same global order. The saved seed
        wins over the constructor's (a resumed run keeps its order); a difference is logged."""
        for key in ("step", "consumed_samples", "seed"):
            if key not in state:
                raise KeyError(f"data loader state has no {key!r} (got keys {sorted(state)})")
        if int(state["seed"]) != self.seed:
            logger.warning(
                "data loader state has seed %d, constructed with %d: using %d",
                state["seed"],
                self.seed,
                state["seed"],
            )
        self.step = int(state["step"])
        self.consumed_samples = int(state["consumed_samples"])
        self.seed = int(state["seed"])
