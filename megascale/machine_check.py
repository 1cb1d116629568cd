"""Rules that depend on the machine a job starts on, checked before anything starts.

``check_machine`` raises ``ConfigError`` (one line: the field or variable, its value, the rule)
when the job cannot run here: a megatron-core release outside the supported range
(``versions.MEGATRON_CORE_RANGE``); ``TMPDIR`` missing, not a directory, not writable or nearly
full; a ``data.path`` whose token files are not there; a ``checkpoint.url`` whose fsspec protocol
needs a package that is not installed; a model that does not fit in memory
(``estimate_rank_bytes``, compared with ``/proc/meminfo`` on CPU and with the GPU's memory from
NVML on CUDA: the parent never initialises CUDA, since the ranks it forks could not use it).

``config.rules.validate`` holds the machine-independent rules (a config can be validated away
from where it runs, e.g. in the Kubernetes operator); these run where the job starts.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from megascale.config import ConfigError, JobConfig

logger = logging.getLogger(__name__)

MIN_TMP_FREE_BYTES = 256 << 20
"""Free space ``TMPDIR`` must have: the embedded etcd preallocates a 64 MB write-ahead log there,
and torch and the data loader write scratch files."""

_GIB = 1 << 30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs, by part (rough: an upper-end estimate, not an allocation plan)."""

    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def describe(self) -> str:
        parts = ("params", "grads", "optimizer", "activations")
        return ", ".join(f"{p} {getattr(self, p) / _GIB:.2f}" for p in parts) + " GiB"


def estimate_rank_bytes(cfg: JobConfig, device: str) -> MemoryEstimate:
    """What the most loaded rank of a validated config holds (``parallel.dp`` filled in).

    Parameters are split over ``tp * pp`` (the first stage also holds the embedding); training
    keeps fp32 main gradients (4 bytes) and, for Adam or LAMB, two fp32 moments (plus an fp32
    main copy of bf16 parameters), sharded over ``dp`` by the distributed optimizer. Activations:
    per layer about ``34 * s * b * h`` bytes (Korthikanti et al. 2022, fp16) scaled to the
    parameter width, split over ``tp``, times the micro-batches a first pipeline stage holds in
    flight under 1F1B (up to ``pp``); the logits add ``s * b * vocab / tp`` floats."""
    from megascale.probes.flops import count_parameters, padded_vocab

    m, p, t = cfg.model, cfg.parallel, cfg.train
    dp = p.dp or 1
    width = 2 if m.params_dtype == "bf16" else 4
    embedding = padded_vocab(m.vocab_size, p.tp) * m.hidden_size
    layers = count_parameters(m, p.tp) - embedding
    per_rank = (layers // p.pp + embedding) // p.tp
    params = per_rank * width
    grads = per_rank * 4
    master = per_rank * 4 if width == 2 else 0
    optimizer = (per_rank * 8 + master) // (dp if p.distributed_optimizer else 1)
    tokens = m.seq_length * t.micro_batch_size
    microbatches = max(1, t.global_batch_size // (t.micro_batch_size * dp))
    in_flight = min(p.pp, microbatches)
    per_layer = 17 * width * tokens * m.hidden_size // p.tp  # 34 bytes at 2 bytes a value
    logits = tokens * padded_vocab(m.vocab_size, p.tp) // p.tp * 4 * 2  # values and grads
    activations = per_layer * (m.num_layers // p.pp) * in_flight + logits
    return MemoryEstimate(params, grads, optimizer, activations)


def resolve_device(requested: str) -> str:
    """ "auto" -> "cuda" when a GPU is visible, else "cpu"; ValueError for "cuda" without one.
    Never initialises CUDA (NVML counts the GPUs): ``megascale train --nproc-per-node N`` calls it
    before forking its ranks. Imports no torch or megatron-core: bad input is refused at once."""
    from megascale.gpus import visible_gpu_count

    if requested == "auto":
        return "cuda" if visible_gpu_count() else "cpu"
    if requested == "cuda" and not visible_gpu_count():
        raise ValueError("train.device='cuda' but no CUDA device is visible; use 'cpu' or 'auto'")
    return requested


def check_machine(cfg: JobConfig, device: str, ranks_here: int, started: bool = False) -> None:
    """Raise ConfigError when ``cfg`` (validated) cannot run on this machine with
    ``ranks_here`` ranks of it sharing the machine (see the module docstring). ``started``: the
    ranks may be allocating already (each rank under torchrun checks for itself), so memory is
    compared with the machine's total, not with what is available at this moment."""
    _check_megatron_core()
    check_tmpdir()
    _check_data(cfg)
    _check_checkpoint_url(cfg.checkpoint.url)
    check_memory(cfg, device, ranks_here, started)


def _check_megatron_core() -> None:
    """The installed megatron-core must be a supported release (``versions.MEGATRON_CORE_RANGE``)."""
    from megascale.versions import UnsupportedVersion, check_megatron_core

    try:
        check_megatron_core()
    except UnsupportedVersion as e:
        raise ConfigError(str(e)) from e


def check_tmpdir(environ: dict[str, str] | None = None) -> None:
    """``TMPDIR``, when set, must be an existing writable directory with free space."""
    env = os.environ if environ is None else environ
    tmp = env.get("TMPDIR")
    if tmp is None:
        return
    rule = f"must be a writable directory with at least {MIN_TMP_FREE_BYTES >> 20} MB free"
    if not os.path.isdir(tmp):
        raise ConfigError(f"TMPDIR = {tmp!r}: does not exist or is not a directory; {rule}")
    if not os.access(tmp, os.W_OK | os.X_OK):
        raise ConfigError(f"TMPDIR = {tmp!r}: not writable; {rule}")
    free = shutil.disk_usage(tmp).free
    if free < MIN_TMP_FREE_BYTES:
        raise ConfigError(f"TMPDIR = {tmp!r}: only {free >> 20} MB free; {rule}")


def _check_data(cfg: JobConfig) -> None:
    path = cfg.data.path
    if path is None:
        return
    missing = [s for s in (".bin", ".idx") if not os.path.isfile(path + s)]
    if missing:
        raise ConfigError(
            f"data.path = {path!r}: {' and '.join(path + s for s in missing)} not found; must be "
            "the prefix of a token file made by `megascale data build` (PREFIX.bin + PREFIX.idx)"
        )


def _check_checkpoint_url(url: str | None) -> None:
    """An fsspec URL's protocol must have its package installed here (``s3://``: s3fs)."""
    if url is None:
        return
    import fsspec

    protocol = fsspec.core.split_protocol(url)[0] or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        raise ConfigError(
            f"checkpoint.url = {url!r}: protocol {protocol!r} needs a package that is not "
            f"installed here ({e}); install it, or use a directory"
        ) from e
    except ValueError:
        return  # an unknown protocol: validate() names it


def check_memory(cfg: JobConfig, device: str, ranks_here: int, started: bool = False) -> None:
    """Refuse a model whose estimated per-rank memory (``estimate_rank_bytes``) exceeds the GPU's
    memory (CUDA), or whose ``ranks_here`` ranks together exceed the host's available memory
    (its total memory when ``started``)."""
    estimate = estimate_rank_bytes(cfg, device)
    m = cfg.model
    shape = (
        f"model.num_layers = {m.num_layers}, model.hidden_size = {m.hidden_size}, "
        f"model.vocab_size = {m.vocab_size}, model.seq_length = {m.seq_length}"
    )
    if device == "cuda":
        gpu = gpu_memory_bytes()
        if gpu is not None and estimate.total > gpu:
            raise ConfigError(
                f"{shape}: needs about {estimate.total / _GIB:.1f} GiB per rank "
                f"({estimate.describe()}), more than the GPU's {gpu / _GIB:.1f} GiB; use a "
                "smaller model or split it further (parallel.tp, parallel.pp)"
            )
        return
    available = host_memory_bytes("MemTotal" if started else "MemAvailable")
    need = estimate.total * max(1, ranks_here)
    if available is not None and need > available:
        raise ConfigError(
            f"{shape}: needs about {need / _GIB:.1f} GiB for {ranks_here} rank(s) on this "
            f"machine ({estimate.describe()} per rank), more than the {available / _GIB:.1f} GiB "
            "available; use a smaller model or more machines"
        )


def host_memory_bytes(
    field: str = "MemAvailable", meminfo: str | Path = "/proc/meminfo"
) -> int | None:
    """``field`` (else MemTotal) from ``/proc/meminfo``, in bytes; None where there is none."""
    try:
        lines = Path(meminfo).read_text().splitlines()
    except OSError:
        return None
    fields = {}
    for line in lines:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * 1024  # kB
    return fields.get(field, fields.get("MemTotal"))


def gpu_memory_bytes() -> int | None:
    """The smallest visible GPU's memory from NVML (no CUDA context); None without NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            sizes = [
                pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total
                for i in range(count)
            ]
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        logger.info("NVML unavailable (%s): GPU memory not checked", e)
        return None
    return min(sizes) if sizes else None


@functools.cache
def gpu_count() -> int:
    """GPUs on this machine, counted without initialising CUDA here: launchers fork later, and a
    forked child cannot use CUDA once its parent has."""
    from megascale.gpus import physical_gpu_count

    return physical_gpu_count()
