"""Which tensor-parallel overlap runs for a job: ours (chunked) on the local spec, Transformer
Engine's userbuffers on the TE spec.

The two layer specs cannot share one mechanism. The local spec's linears are megatron-core's own
``ColumnParallelLinear``/``RowParallelLinear``, which ``megascale.overlap.tp`` replaces by chunked,
pipelined versions. The TE spec's linears are TE modules whose all-gather and reduce-scatter happen
inside TE's own kernels, so our chunking cannot reach them; TE overlaps them itself when megatron-core
passes ``tp_comm_overlap`` (``ub_overlap_ag``/``ub_overlap_rs``/bulk dgrad+wgrad, keyed by the
buffer names ``qkv``, ``proj``, ``fc1``, ``fc2``) and the process has registered TE's userbuffers
once, before the model is built (``transformer_engine.pytorch.module.base.initialize_ub``).

``plan_tp_overlap`` is the whole decision and is pure (tested on CPU without TE);
``init_te_userbuffers`` carries out a TE plan on a GPU (tested in ``tests/gpu``).

Like the chunked overlap, TE's applies only where the job has something it can overlap, and is
otherwise inactive (logged with the reason, the job runs as before):

* sequence parallelism: the overlapped collectives are SP's all-gather and reduce-scatter (without
  SP, TP is an all-reduce that neither path overlaps);
* bf16 activations: the userbuffers are 16-bit (or FP8); an fp32 job (a correctness run) keeps
  TE's plain collectives.

Where it applies, what it needs besides is refused with a ``ConfigError`` naming the field:

* ``seq_length * micro_batch_size`` divisible by ``tp``: the buffer is that many rows, split evenly;
* the TP group inside one node (``tp`` divides the GPUs per node): the buffers are shared over
  CUDA IPC/NVLink between the TP ranks, which megascale's layout places on consecutive local ranks;
* TE >= 1.9: the first version that bootstraps the buffers over a torch process group (NCCL)
  rather than needing an MPI-enabled torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megascale.config import ConfigError, JobConfig

logger = logging.getLogger(__name__)

OFF, CHUNKED, TE_USERBUFFERS = "off", "chunked", "te-userbuffers"
TE_USERBUFFERS_MIN_VERSION = "1.9.0"


@dataclass(frozen=True)
class TPOverlapPlan:
    """The TP overlap of one job: ``mode`` (``off``, ``chunked``, ``te-userbuffers``) and why."""

    mode: str
    reason: str
    chunks: int = 1
    """Sequence chunks per FFN GEMM (``chunked`` only)."""
    megatron_flags: Mapping[str, Any] = field(default_factory=dict)
    """Extra ``TransformerConfig`` fields (``te-userbuffers``: ``tp_comm_overlap`` and friends)."""
    ub_shape: tuple[int, int] | None = None
    """``initialize_ub``'s ``shape``: [seq_length * micro_batch_size, hidden] (TE only)."""
    tp: int = 1


def _version_tuple(version: str) -> tuple[int, ...]:
    """Leading numeric release of a version string: ``"2.8.0.dev0+abc"`` -> (2, 8, 0)."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def plan_tp_overlap(
    job: JobConfig,
    use_te: bool,
    te_version: str | None = None,
    gpus_per_node: int | None = None,
) -> TPOverlapPlan:
    """Decide the TP overlap for ``job`` built with the TE spec (``use_te``) or the local one.

    ``te_version``: the installed Transformer Engine's version (TE spec only; None: unknown, refused
    when TE's overlap would be needed). ``gpus_per_node``: ranks per node (None: not checked).
    Raises ConfigError for a TE combination that cannot work; never on the local spec (its rules
    are ``config.rules``'s).
    """
    p, m, o = job.parallel, job.model, job.overlap
    if not o.tp:
        return TPOverlapPlan(OFF, "overlap.tp = false")
    if p.tp == 1:
        return TPOverlapPlan(OFF, "parallel.tp = 1: no tensor-parallel communication")
    if not p.sequence_parallel:
        return TPOverlapPlan(
            OFF, "parallel.sequence_parallel = false: TP all-reduces are not overlapped"
        )
    if not use_te:
        if o.tp_chunks < 2:
            return TPOverlapPlan(OFF, f"overlap.tp_chunks = {o.tp_chunks}: nothing to pipeline")
        return TPOverlapPlan(
            CHUNKED, f"local spec: chunked overlap, {o.tp_chunks} chunks", chunks=o.tp_chunks
        )
    if m.params_dtype != "bf16":
        return TPOverlapPlan(
            OFF, f"model.params_dtype = {m.params_dtype!r}: TE's userbuffers overlap is bf16-only"
        )
    _check_te(job, te_version, gpus_per_node)
    rows = m.seq_length * job.train.micro_batch_size
    return TPOverlapPlan(
        TE_USERBUFFERS,
        f"TE spec: Transformer Engine userbuffers overlap (TE {te_version}, tp {p.tp})",
        megatron_flags={
            "tp_comm_overlap": True,
            "tp_comm_overlap_ag": True,  # all-gather pipelined with the qkv/fc1 GEMMs
            "tp_comm_overlap_rs": True,  # reduce-scatter pipelined with the proj/fc2 GEMMs
            "tp_comm_bulk_dgrad": True,  # backward: all-gather under the dgrad GEMM
            "tp_comm_bulk_wgrad": True,  # backward: reduce-scatter under the wgrad GEMM
            "tp_comm_bootstrap_backend": "nccl",
        },
        ub_shape=(rows, m.hidden_size),
        tp=p.tp,
    )


def _check_te(job: JobConfig, te_version: str | None, gpus_per_node: int | None) -> None:
    """ConfigError naming each field that keeps TE's userbuffers from a job they apply to."""
    p, m = job.parallel, job.model
    off = "or set overlap.tp=false"
    problems = []
    rows = m.seq_length * job.train.micro_batch_size
    if rows % p.tp:
        problems.append(
            f"model.seq_length = {m.seq_length}: seq_length * train.micro_batch_size = {rows} "
            f"must be divisible by parallel.tp = {p.tp} for TE's userbuffers {off}"
        )
    if gpus_per_node is not None and gpus_per_node % p.tp:
        problems.append(
            f"parallel.tp = {p.tp}: TE's userbuffers need each TP group inside one node, and "
            f"{gpus_per_node} GPU(s) per node are not a multiple of it; {off}"
        )
    minimum = _version_tuple(TE_USERBUFFERS_MIN_VERSION)
    if te_version is None or _version_tuple(te_version) < minimum:
        problems.append(
            f"overlap.tp = true: the TE spec's TP overlap needs Transformer Engine >= "
            f"{TE_USERBUFFERS_MIN_VERSION} (installed: {te_version or 'unknown'}); upgrade the "
            f"gpu extra {off}"
        )
    if problems:
        raise ConfigError("; ".join(problems))


def transformer_engine_version() -> str | None:
    """The importable Transformer Engine's version, None without one."""
    try:
        from megatron.core.utils import get_te_version

        return str(get_te_version())
    except Exception:  # no TE, or a broken one: the TE spec refuses it elsewhere
        return None


def plan_for_this_rank(job: JobConfig, use_te: bool) -> TPOverlapPlan:
    """``plan_tp_overlap`` with this process's TE version and ranks per node (``LOCAL_WORLD_SIZE``
    from the launcher), logged once as an info line naming the overlap that runs and why."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    plan = plan_tp_overlap(
        job,
        use_te,
        transformer_engine_version() if use_te else None,
        int(local) if local and local.isdigit() else None,
    )
    logger.info("TP overlap: %s (%s)", plan.mode, plan.reason)
    return plan


def skip_multicast_unless_supported(environ: dict[str, str] | None = None) -> bool:
    """Set ``UB_SKIPMC=1`` (when unset) where the GPUs cannot do CUDA multicast; True when it did.

    TE's userbuffers use NVLS multicast by default, which needs NVSwitch with a fabric manager
    (HGX/DGX H100); on PCIe or NVL pairs ``initialize_ub`` raises "... does not support comm+GEMM
    overlap with CUDA Multicast. Launch app with UB_SKIPMC=1". Without multicast the same overlap
    runs over copy engines (slower, still overlapped), which is what ``UB_SKIPMC=1`` selects."""
    env = os.environ if environ is None else environ
    if "UB_SKIPMC" in env:
        return False
    try:
        import transformer_engine_torch as tex
    except ImportError:
        return False
    supports = getattr(tex, "device_supports_multicast", None)
    if supports is None or supports():
        return False
    env["UB_SKIPMC"] = "1"
    logger.info("TP overlap: these GPUs cannot do CUDA multicast: TE userbuffers without it")
    return True


def init_te_userbuffers(plan: TPOverlapPlan, dtype: Any) -> None:
    """Register TE's userbuffers for ``plan`` (``te-userbuffers`` only; a no-op otherwise).

    Collective over the whole job (TE creates its bootstrap group with ``new_group``): every rank
    calls it once, after ``torch.distributed`` and the TP groups exist and before the first TE
    module is built. CUDA only.
    """
    if plan.mode != TE_USERBUFFERS:
        return
    from transformer_engine.pytorch.module import base as te_base

    assert plan.ub_shape is not None
    if getattr(te_base, "_ub_communicators", None):  # TE allows one registration per process
        return
    skip_multicast_unless_supported()
    te_base.initialize_ub(
        shape=list(plan.ub_shape),
        tp_size=plan.tp,
        use_fp8=False,
        dtype=dtype,
        bootstrap_backend=plan.megatron_flags["tp_comm_bootstrap_backend"],
    )
    logger.info("TP overlap: TE userbuffers %s registered for tp %d", plan.ub_shape, plan.tp)
