"""Which worker faults are the job's rather than a node's (pure: no state, no I/O).

A fault of the job follows it to any node, so evicting a node for it would only burn spares:
``EXIT_JOB_FATAL`` (a rank's own verdict, ``probes.fatal``), a full disk (the job's storage; a
spare writes to the same place), and an uncaught exception that ended every rank of a generation
or a rank of an earlier generation too. Everything else is the node's (``worker_exit``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megascale.agent.logscan import storage_full
from megascale.controller.actions import Fault
from megascale.probes.fatal import EXIT_JOB_FATAL

STORAGE_FULL = "storage full: a job-level fault, no node is evicted (free space and resume)"


def storage_full_fault(
    node: str, rank: int | None, text: str, detail: Mapping[str, Any] | None = None
) -> Fault:
    detail = {**(detail or {}), "reason": f"{text[:400]} ({STORAGE_FULL})"}
    return Fault("job_fatal", node, rank, {**detail, "classified": STORAGE_FULL})


def worker_exit_fault(
    node: str,
    rank: int,
    code: int,
    *,
    fatal: str | None,
    error: Mapping[str, str] | None,
    everywhere: bool,
    first_generation: int | None,
    generation: int,
    world_size: int,
) -> Fault:
    """The fault of a worker that exited with ``code`` != 0. ``error``: its uncaught exception
    (``{"text", "signature"}``); ``everywhere``: that signature ended every rank of this
    generation; ``first_generation``: the generation that first saw the signature (None: never)."""
    if code == EXIT_JOB_FATAL:
        reason = fatal or f"exit code {code} (job-fatal) without a reason"
        return Fault("job_fatal", node, rank, {"exit_code": code, "reason": reason})
    detail: dict[str, Any] = {"exit_code": code}
    if error is None:
        return Fault("worker_exit", node, rank, detail)
    detail.update(error=error["text"], signature=error["signature"])
    if storage_full(error["text"]):
        return storage_full_fault(node, rank, error["text"], detail)
    if everywhere:
        why = f"the same error ended every rank ({world_size})"
    elif first_generation is not None and first_generation < generation:
        why = f"the same error again after a restart (generations {first_generation}, {generation})"
    else:
        return Fault("worker_exit", node, rank, detail)
    return Fault("job_fatal", node, rank, {**detail, "reason": f"{error['text']} ({why})",
                                           "classified": why})  # fmt: skip
