"""GPT samples from Megatron indexed datasets: blends, train/valid/test splits, DP-sharded batches.

Datasets (``build_splits``): megatron-core's ``BlendedMegatronDatasetBuilder`` builds ``GPTDataset``
splits of the blend (``data.blend``, or the one prefix ``data.path``, or the built-in corpus) with
``data.split`` (``"98,1,1"``: train/valid/test shares of each dataset's documents) and, for a
weighted blend, a ``BlendedDataset`` drawing from each corpus in proportion to its weight. Sample
``i`` of a split is ``seq_length + 1`` tokens (``tokens``/``labels`` shifted by one, ``loss_mask``
ones, ``position_ids`` 0..seq-1); samples cross document boundaries, the end-of-document id tells
the model where one ends. Samples are shuffled by megatron-core, seeded with ``train.seed``.

Memory: the shuffle, sample and blend indices are ``.npy`` files in the cache directory
(``data.cache_dir``, else ``RUN_DIR/data/index-cache``), memory-mapped by every rank; the tokens are
memory-mapped too, so a rank's memory does not grow with the dataset. One rank per machine builds
the missing index files, holding a file lock in the cache directory so that machines sharing it
never write at once, while the other ranks wait on a barrier (``build_once_per_machine``); later
runs reuse them.

Order: the train split is built for ``train.steps * train.global_batch_size`` samples (more epochs
when the data is smaller); global sample ``g`` of the run is sample ``g`` of it (modulo its length
when a run is extended past that). The order depends on the seed, the data, ``data.split``,
``model.seq_length`` and that sample count, never on the parallel layout.

Sharding (``ShardedBatches``): optimizer step ``k`` consumes global samples
``consumed .. consumed + global_batch_size - 1``. Data-parallel rank ``r`` of ``dp_size`` takes
the *contiguous* block ``r * per_rank .. (r + 1) * per_rank - 1`` of them
(``per_rank = global_batch_size // dp_size``) and cuts it into micro-batches of
``micro_batch_size`` in order. Concatenating the ranks' micro-batches rank by rank therefore gives
exactly the samples, in the same order, of a 1-process run with the same global batch size.

Validation (``eval_batches``): every evaluation reads the same first ``train.eval_steps`` global
batches of the valid split, sharded the same way, so values at different steps compare.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

import torch

from megascale.config import JobConfig
from megascale.data.blend import parse_blend, parse_split
from megascale.data.indexed import (
    SCAN_TOKENS,
    DataError,
    DatasetInfo,
    bin_path,
    check_prefix,
    open_indexed,
    sidecar_path,
    token_count,
)
from megascale.data.scan_cache import cached_max_token

logger = logging.getLogger(__name__)

_BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def data_sources(
    job: JobConfig, default_prefix: Path | None
) -> tuple[list[str], list[float] | None]:
    """The prefixes and weights a job trains on: ``data.blend``, else ``data.path``, else the
    built-in corpus at ``default_prefix``."""
    if job.data.blend is not None:
        return parse_blend(job.data.blend)
    if job.data.path is not None:
        return [job.data.path], None
    if default_prefix is None:
        raise DataError("no data: set data.path or data.blend, or build the built-in corpus")
    return [os.fspath(default_prefix)], None


def check_data(job: JobConfig, default_prefix: Path | None, *, scan: bool) -> DatasetInfo | None:
    """Check every dataset of the job before training: readable, consistent files, one tokenizer,
    vocabulary and largest token id within ``model.vocab_size``. DataError names the file or field.

    ``scan``: find the largest id of a dataset without a ``PREFIX.json`` by reading its ``.bin``
    (chunked); without it such datasets are trusted. Returns the common sidecar (None if none).
    """
    prefixes, _ = data_sources(job, default_prefix)
    parse_split(job.data.split)
    field = "data.blend" if job.data.blend is not None else "data.path"
    vocab = job.model.vocab_size
    infos: dict[str, DatasetInfo] = {}
    for prefix in prefixes:
        check_prefix(prefix, field)
        info = DatasetInfo.read(prefix)
        if info is not None:
            infos[prefix] = info
            if info.vocab_size > vocab:
                raise DataError(
                    f"{prefix}: built with a tokenizer of vocabulary {info.vocab_size}, larger "
                    f"than model.vocab_size = {vocab}; raise model.vocab_size to >= "
                    f"{info.vocab_size}"
                )
        _check_max_token(prefix, info, vocab, scan)
    _check_split_tokens(job, prefixes, built_splits(job))
    kinds = {(i.tokenizer, i.vocab_size, i.eod) for i in infos.values()}
    if len(kinds) > 1:
        raise DataError(
            f"{field}: datasets built with different tokenizers "
            f"({', '.join(f'{p}: {i.tokenizer}/vocab {i.vocab_size}' for p, i in infos.items())})"
        )
    return next(iter(infos.values()), None)


def _check_max_token(prefix: str, info: DatasetInfo | None, vocab: int, scan: bool) -> None:
    """DataError when a token id >= ``vocab``: per ``PREFIX.json``, and (``scan``) per the
    ``.bin``'s own content, so a stale sidecar is not trusted. The scan is bounded
    (``indexed.SCAN_TOKENS``) unless the sidecar's token count disagrees with the ``.bin``."""
    if info is not None and info.max_token >= vocab:
        raise DataError(
            f"{sidecar_path(prefix)}: token id {info.max_token} >= model.vocab_size = {vocab}; "
            f"accepted ids 0..{vocab - 1}"
        )
    if not scan:
        return
    stale = info is not None and info.tokens != token_count(prefix)
    top = cached_max_token(prefix, limit=None if info is None or stale else SCAN_TOKENS)
    if top >= vocab:
        raise DataError(
            f"{bin_path(prefix)}: token id {top} >= model.vocab_size = {vocab}; accepted ids "
            f"0..{vocab - 1}"
        )


class _TokenizerInfo:
    """What megatron-core's GPTDataset needs of a tokenizer: its vocabulary size and EOD id."""

    def __init__(self, vocab_size: int, eod: int) -> None:
        self.vocab_size, self.eod = vocab_size, eod
        # Part of megatron-core's cache key (MegatronDataset.unique_description).
        self.unique_identifiers = {"vocab_size": vocab_size, "eod": eod}


def split_sizes(job: JobConfig) -> list[int]:
    """Samples to build per split: the whole run for train, one evaluation's for valid."""
    t = job.train
    valid = t.eval_steps * t.global_batch_size if t.eval_interval else 0
    return [t.steps * t.global_batch_size, valid, 0]


def built_splits(job: JobConfig) -> list[tuple[float, float] | None]:
    """megatron-core's split matrix for ``data.split`` (bounds of each share in [0, 1]), with the
    shares never read set to None: the test share always, the valid share without evaluation.
    The train and valid bounds are those of the full split."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
    )

    matrix = convert_split_vector_to_split_matrix(parse_split(job.data.split))
    sizes = split_sizes(job)
    return [b if i == 0 or (i == 1 and sizes[1]) else None for i, b in enumerate(matrix)]


def build_splits(job: JobConfig, default_prefix: Path | None, cache_dir: Path):
    """(train, valid) datasets of the job (valid None when ``data.split`` gives it no share).

    Collective when torch.distributed is initialised (every rank calls it; one rank per machine
    builds the index cache first). Raises DataError before any building for a bad dataset or setting.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    info = check_data(job, default_prefix, scan=False)
    prefixes, weights = data_sources(job, default_prefix)
    shares = parse_split(job.data.split)
    eod = info.eod if info is not None else 0
    config = GPTDatasetConfig(
        random_seed=job.train.seed,
        sequence_length=job.model.seq_length,
        blend=(prefixes, weights),
        split=",".join(f"{s:.6f}" for s in shares),
        path_to_cache=os.fspath(cache_dir),
        tokenizer=_TokenizerInfo(job.model.vocab_size, eod),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    config.split_matrix = built_splits(job)
    builder = BlendedMegatronDatasetBuilder(GPTDataset, split_sizes(job), lambda: True, config)
    train, valid, _test = build_once_per_machine(builder, cache_dir)
    if train is None or len(train) == 0:
        raise DataError(f"data.split = {job.data.split!r}: the train split has no samples")
    return train, valid


def build_once_per_machine(builder, cache_dir: Path) -> list:
    """``builder.build()`` with the index cache built once per dataset by one rank per machine.

    Without torch.distributed: a plain build. Otherwise (collective): the lowest rank of each
    machine (``probes.timers.node_name``) builds the missing index files while holding an
    exclusive lock on ``CACHE_DIR/.megascale-build.lock``, so machines sharing the cache directory
    never write it at once (the first builds, the others find the files), while the other ranks
    wait on a barrier; then every rank memory-maps the files. megatron-core's own rule (global
    rank 0 builds, its barriers) is switched off for these builds (``_one_process_view``).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return builder.build()
    from megascale.probes.timers import node_name

    nodes: list = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, node_name())
    if nodes.index(node_name()) == dist.get_rank():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with open(cache_dir / ".megascale-build.lock", "a") as lock, _one_process_view():
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
            builder.build()  # writes the missing index files; the datasets are dropped
    dist.barrier()
    with _one_process_view():
        return builder.build()  # every file is in the cache now: memory-mapped


class _OneProcessTorch:
    """``torch`` as megatron-core's dataset modules see it inside ``_one_process_view``."""

    distributed = SimpleNamespace(
        is_initialized=lambda: False, get_rank=lambda: 0, barrier=lambda *a, **k: None
    )

    def __getattr__(self, name: str):
        return getattr(torch, name)


@contextlib.contextmanager
def _one_process_view():
    """megatron-core's dataset builder, GPTDataset and BlendedDataset see one process (rank 0,
    no barriers) inside: they build missing index files or read the cached ones, and never call a
    collective. Only those modules' ``torch`` name is swapped (megatron-core 0.16)."""
    from megatron.core.datasets import (
        blended_dataset,
        blended_megatron_dataset_builder,
        gpt_dataset,
    )

    modules = (blended_dataset, blended_megatron_dataset_builder, gpt_dataset)
    for module in modules:
        module.torch = _OneProcessTorch()
    try:
        yield
    finally:
        for module in modules:
            module.torch = torch


def _check_split_tokens(job: JobConfig, prefixes: list[str], split_matrix: list) -> None:
    """DataError unless every split that is built holds one sample's tokens in every dataset
    (megatron-core would loop forever on an empty one). Documents are split as megatron-core
    does: split ``[b, e)`` of ``n`` is documents ``round(b * n) .. round(e * n) - 1``."""
    need = job.model.seq_length + 1
    for prefix in prefixes:
        dataset = open_indexed(prefix)  # keeps the memory map that ``lengths`` views open
        lengths = dataset.sequence_lengths
        n = len(lengths)
        for name, bounds in zip(("train", "valid"), split_matrix, strict=False):
            if bounds is None:
                continue
            beg, end = int(round(bounds[0] * n)), int(round(bounds[1] * n))
            tokens = int(lengths[beg:end].sum())
            if tokens < need:
                raise DataError(
                    f"data.split = {job.data.split!r}: the {name} split of {prefix} is "
                    f"{end - beg} of {n} documents, {tokens} tokens; it needs at least "
                    f"model.seq_length + 1 = {need} (more data, or a larger {name} share)"
                )


def collate(samples: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One micro-batch dict from megatron-core samples (CPU tensors).

    Keys: ``tokens`` and ``labels`` (int64 [mbs, seq]), ``loss_mask`` (float32 [mbs, seq]),
    ``position_ids`` (int64 [mbs, seq]).
    """
    return {key: torch.stack([s[key] for s in samples]) for key in _BATCH_KEYS}


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
        dataset,
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

    def sample_indices(self, step_start: int, dp_rank: int | None = None) -> list[int]:
        """Dataset indices of this rank's (or data-parallel rank ``dp_rank``'s) samples for the
        step starting at global sample ``step_start``, in micro-batch order."""
        per_rank = self.global_batch_size // self.dp_size
        first = step_start + (self.dp_rank if dp_rank is None else dp_rank) * per_rank
        n = len(self.dataset)
        return [g % n for g in range(first, first + per_rank)]

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
        another dp layout stays on the same global order. The order itself was fixed when the
        dataset was built (from the config's seed); a different saved seed is logged."""
        for key in ("step", "consumed_samples", "seed"):
            if key not in state:
                raise KeyError(f"data loader state has no {key!r} (got keys {sorted(state)})")
        if int(state["seed"]) != self.seed:
            logger.warning(
                "data loader state has seed %d, the dataset was built with train.seed = %d: the "
                "sample order follows the config",
                state["seed"],
                self.seed,
            )
        self.step = int(state["step"])
        self.consumed_samples = int(state["consumed_samples"])


def eval_batches(
    valid, job: JobConfig, dp_rank: int, dp_size: int
) -> list[list[dict[str, torch.Tensor]]]:
    """This rank's micro-batches for one evaluation: ``train.eval_steps`` lists of them, from the
    first ``eval_steps * global_batch_size`` samples of ``valid`` (the same at every evaluation)."""
    t = job.train
    batches = ShardedBatches(valid, t.global_batch_size, t.micro_batch_size, dp_rank, dp_size, 0)
    return [batches.next_step() for _ in range(t.eval_steps)]
