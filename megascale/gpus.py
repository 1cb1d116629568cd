"""Counting GPUs without initialising CUDA, and keeping CUDA out of every process that forks.

A process that has initialised CUDA cannot hand it to a forked child: the child's first CUDA call
fails with "Cannot re-initialize CUDA in forked subprocess". megascale forks in three places — the
local launcher (``megascale train --nproc-per-node N``), the agent's zygote and the local cluster
— so everything those parents do before forking must leave CUDA alone: ``torch.cuda.is_available``
and ``torch.cuda.device_count`` both call ``cudaGetDeviceCount`` (which runs ``cuInit``) unless
NVML answers first. Here GPUs are counted through NVML (the driver's management library, no CUDA
context), or ``nvidia-smi -L`` where NVML cannot be loaded from Python.

Contract for pre-fork code: call ``visible_gpu_count`` (never ``torch.cuda.*``), call
``prefer_nvml_checks`` before importing libraries that probe CUDA at import time, and call
``check_fork_safe`` right before forking (it names the problem if CUDA was initialised anyway).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

logger = logging.getLogger(__name__)


def prefer_nvml_checks() -> None:
    """Make ``torch.cuda.is_available()`` ask NVML instead of initialising CUDA in this process and
    its children (``PYTORCH_NVML_BASED_CUDA_CHECK=1``; a value already set is kept). Libraries that
    probe ``is_available()`` at import time (megatron-core through ``torch.utils.cpp_extension``,
    Transformer Engine) then stay fork-safe. On a machine without a driver, CUDA is hidden too
    (``hide_cuda_without_a_driver``): there NVML cannot answer, and torch falls back to
    ``cudaGetDeviceCount``.
    """
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    hide_cuda_without_a_driver()


def hide_cuda_without_a_driver() -> bool:
    """With a CUDA build of torch on a machine without a usable GPU (NVML cannot be loaded and
    ``nvidia-smi -L`` lists none), set ``CUDA_VISIBLE_DEVICES=""`` for this process and its
    children; True when it did. A value already set is kept.

    Why: torch's ``device_count()`` asks NVML first and, when NVML cannot be loaded (no driver:
    ``_device_count_nvml() == -1``), falls back to ``cudaGetDeviceCount``, which marks the
    process as having touched CUDA: every child it forks then fails at its first CUDA question
    ("Cannot re-initialize CUDA in forked subprocess"), and ``import megatron.core`` asks at import
    time. With the empty list torch answers 0 from the environment alone, so a CPU run never
    thinks CUDA is there, in the parent or in a rank. On a machine with a driver this does
    nothing (NVML answers).
    """
    import torch

    if not torch.cuda._is_compiled() or "CUDA_VISIBLE_DEVICES" in os.environ:
        return False
    if getattr(torch.cuda, "_device_count_nvml", lambda: -1)() >= 0 or _nvidia_smi_count():
        return False
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    logger.debug("no NVIDIA driver (NVML cannot be loaded, nvidia-smi lists no GPU): CUDA hidden")
    return True


def _visible_subset(physical: int) -> int:
    """How many of ``physical`` GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible (a list of indices or
    UUIDs, cut at the first invalid entry as CUDA does; unset = all)."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return physical
    count = 0
    for item in (s.strip() for s in spec.split(",")):
        if item.isdigit() and int(item) < physical:
            count += 1
        elif item.startswith(("GPU-", "MIG-")):
            count += 1
        else:
            break
    return count


def _nvidia_smi_count() -> int:
    """Physical GPUs listed by ``nvidia-smi -L``; 0 when it is missing or fails."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if out.returncode:
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def visible_gpu_count() -> int:
    """GPUs this process may use (``CUDA_VISIBLE_DEVICES`` honoured), counted without initialising
    CUDA. 0 with a CPU-only torch build, without a driver, or when nothing can count them.

    Order: torch's NVML-based count (what ``torch.cuda.device_count`` itself uses before CUDA is
    initialised, minus its ``cudaGetDeviceCount`` fallback), then ``nvidia-smi -L``.
    """
    import torch

    if not torch.cuda._is_compiled():
        return 0
    nvml_count = getattr(torch.cuda, "_device_count_nvml", lambda: -1)()
    if nvml_count >= 0:
        return nvml_count
    return _visible_subset(_nvidia_smi_count())


def physical_gpu_count() -> int:
    """Every GPU of this machine (``nvidia-smi -L``), ignoring ``CUDA_VISIBLE_DEVICES``: what a local
    cluster splits among its nodes. No CUDA initialisation."""
    return _nvidia_smi_count()


def cuda_initialised() -> bool:
    """Whether this process has initialised CUDA (False when torch is not even imported)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def check_fork_safe(what: str) -> bool:
    """Call right before forking ``what``: False, with a warning naming the cause, if this process
    initialised CUDA (children that use CUDA will then fail with "Cannot re-initialize CUDA in
    forked subprocess"; children on CPU are unaffected, so this does not refuse)."""
    if not cuda_initialised():
        return True
    logger.warning(
        "CUDA was initialised in process %d before forking %s: a forked child cannot use CUDA "
        "then. Count GPUs with megascale.gpus.visible_gpu_count(), never torch.cuda.*, "
        "before forking",
        os.getpid(),
        what,
    )
    return False
