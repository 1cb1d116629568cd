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

import json
import logging
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from megascale.k8s import builders
from megascale.k8s.job import LABEL_COMPONENT, LABEL_MANAGED_BY, OPERATOR_NAME
from megascale.k8s.status import rfc3339

logger = logging.getLogger(__name__)

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


def summarize_selfcheck(output: str) -> str:
    """A one-line summary of ``megascale selfcheck --json`` output (``{"checks": [{"name",
    "status": "pass"|"fail"|"skipped", ...}], ...}``), e.g. ``"7 passed, 2 skipped, 1 failed:
    network"``; the output's last line when it is not that JSON."""
    try:
        report = json.loads(output)
    except ValueError:
        lines = [line for line in output.strip().splitlines() if line.strip()]
        return lines[-1] if lines else ""
    checks = report.get("checks") if isinstance(report, dict) else None
    if not isinstance(checks, list):
        return json.dumps(report)[:200]
    checks = [c for c in checks if isinstance(c, dict)]
    counts = {s: sum(1 for c in checks if c.get("status") == s) for s in ("pass", "skipped")}
    failed = [str(c.get("name")) for c in checks if c.get("status") == "fail"]
    text = f"{counts['pass']} passed, {counts['skipped']} skipped, {len(failed)} failed"
    return text + (f": {', '.join(failed)}" if failed else "")


def label_node_with_selfcheck(
    kube: Any,
    node: str,
    command: Sequence[str],
    timeout_s: float,
    clock: Callable[[], float] = time.time,
    note: str = "",
) -> bool:
    """Run the self-check once and label ``node`` ``megascale.io/selfcheck=passed|failed`` (a
    timeout or a crash is ``failed``); ``note`` heads the summary annotation. Returns whether it
    passed."""
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_s)
        passed, summary = done.returncode == 0, summarize_selfcheck(done.stdout)
        if not passed and not summary:
            summary = f"exit code {done.returncode}: {done.stderr.strip()[-200:]}"
    except subprocess.TimeoutExpired:
        passed, summary = False, f"timed out after {timeout_s} s"
    except OSError as e:
        passed, summary = False, f"could not run {command[0]!r}: {e}"
    summary = f"{note}; {summary}" if note else summary
    patch = builders.selfcheck_node_patch(passed, rfc3339(clock()), summary)
    kube.patch("v1", "Node", node, patch, None)
    logger.info("node %s: self-check %s (%s)", node, "passed" if passed else "failed", summary)
    return passed


def selfcheck_daemon(
    kube: Any,
    node: str,
    command: Sequence[str],
    interval_s: float,
    timeout_s: float,
    once: bool,
    workers: Callable[[], int] = lambda: 0,
) -> int:
    """The DaemonSet's loop: check and label, then every ``interval_s`` seconds again. Before
    each check ``workers()`` counts the megascale worker pods on the node: with any, or when it
    fails, only the light host checks run (``selfcheck_command``)."""
    while True:
        try:
            count: int | None = workers()
        except Exception:  # the API server is unreachable or RBAC is missing: assume busy
            logger.warning("node %s: could not count megascale workers", node, exc_info=True)
            count = None
        now, note = selfcheck_command(command, count)
        passed = label_node_with_selfcheck(kube, node, now, timeout_s, note=note)
        if once:
            return 0 if passed else 1
        time.sleep(interval_s)
