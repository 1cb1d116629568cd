"""What the self-check DaemonSet may run on a node: the full check only where nothing trains.

The full self-check loads every GPU (a bf16 matmul and a 1 GiB copy per GPU for seconds, a CUDA
context on each, NCCL all-to-all among them). Run every hour on a node whose GPUs a training job
holds, it would slow that job's step (a straggler of our own making) and could run it out of GPU
memory. So before each run the DaemonSet counts the megascale worker pods scheduled on its node:

* none: the full check (GPU, host, network), as configured;
* one or more: only the light host checks (``--only host.*``: memory bandwidth, the checkpoint
  disk, free space), which never touch a GPU (``megascale selfcheck`` creates no CUDA context when
  no ``gpu.*`` check is selected). The node keeps its label; the summary says the GPU checks were
  deferred. A node that is training is also watched by the job's own controller and agents
  (heartbeats, NVML health, stalls), and the full check runs again once its workers are gone.

``selfcheck_command`` is the decision (pure); ``workers_on_node`` asks the API server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megascale.k8s.job import LABEL_COMPONENT, LABEL_MANAGED_BY, OPERATOR_NAME

LIGHT_CHECKS = ("host.*",)
"""Shell patterns of the checks that run on a node with training pods: no GPU, no network load."""

WORKER_LABELS = {LABEL_MANAGED_BY: OPERATOR_NAME, LABEL_COMPONENT: "worker"}
"""The labels every megascale worker pod carries (``megascale.k8s.builders.worker_pod``)."""


def _without_only(command: Sequence[str]) -> list[str]:
    """``command`` without its ``--only PATTERN`` / ``--only=PATTERN`` selections."""
    out, skip = [], False
    for arg in command:
        if skip:
            skip = False
        elif arg == "--only":
            skip = True
        elif not arg.startswith("--only="):
            out.append(arg)
    return out


def selfcheck_command(command: Sequence[str], workers: int | None) -> tuple[list[str], str]:
    """(the self-check to run, a note for the node's summary) given the megascale ``workers``
    running on the node (None: they could not be counted): the full ``command`` on an idle node,
    the light host checks otherwise (any ``--only`` of ``command`` replaced: it could select GPU
    checks). When in doubt, the light checks: never compete with a job."""
    if workers == 0:
        return list(command), ""
    light = [arg for pattern in LIGHT_CHECKS for arg in ("--only", pattern)]
    if workers is None:
        note = "host checks only: this node's pods could not be listed"
    else:
        note = f"host checks only: {workers} megascale worker pod(s) on this node hold its GPUs"
    return [*_without_only(command), *light], note


def workers_on_node(client: Any, node: str) -> int:
    """Megascale worker pods on ``node`` that have not finished, in any namespace (lightkube
    ``Client``; the DaemonSet's ClusterRole may list pods)."""
    from lightkube import ALL_NS
    from lightkube.resources.core_v1 import Pod

    pods = client.list(Pod, namespace=ALL_NS, labels=WORKER_LABELS, fields={"spec.nodeName": node})
    return sum(
        1 for pod in pods if (pod.status and pod.status.phase) not in ("Succeeded", "Failed")
    )
