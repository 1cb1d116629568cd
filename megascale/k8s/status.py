"""What the operator concludes from what it sees: pure functions, no I/O, time passed in.

``decide(job, status, pods, view, now)`` takes the job, its current ``.status``, its worker pods
and what the controller wrote to etcd (``EtcdView``: the ``state`` snapshot, the ``summary`` of the
job's figures, ``blocklist/``, ``heartbeats/`` and the newest ``events/``), and returns a ``Decision``: the new ``.status`` and the
effects to carry out, in order. The operator's timer runs it every few seconds; running it again on
the same inputs gives the same answer, and once its effects are visible it asks for nothing more.

Rules, in the order they apply:

* **Phase** from the controller's state (``init``/``waiting_for_nodes``/``starting`` -> Starting,
  ``running`` -> Running, ``stopping``/``diagnosing``/``restarting`` -> Recovering, ``finished`` ->
  Succeeded, ``failed`` -> Failed, reason JobFatal when a rank said the job cannot proceed, the
  message the controller's reason for failing); Pending before the controller wrote any; Suspended while
  ``runPolicy.suspend``; Failed when ``activeDeadlineSeconds`` has passed since ``startTime`` or
  when more pods were replaced than ``backoffLimit``. Succeeded and Failed are final.
* **Figures** from the controller's ``summary`` (``controller.job_summary``, refreshed while the
  job trains): ``step``, ``tokensPerSecond``, ``mfu`` and ``mfuPeak``, ``lastCheckpoint`` (step,
  time, url), ``faults``, ``effectiveTrainingTime``; each keeps its last value while etcd cannot
  be read or the controller has not published it. ``restarts`` and the generation come from the
  ``state`` snapshot (what a decision wrote); the summary of an older generation is not mixed in.
  The Running and Succeeded conditions' message is the step; the others' the fault or failure.
* **Evictions**: a node in the controller's blocklist has its worker pod deleted (it is
  recreated with the same name and identity, on another node, once gone), is cordoned and
  labelled when ``faultTolerance.cordonEvictedNodes`` (once, when first seen), and is listed in
  ``status.evictedNodes`` for good: the blocklist survives in the status if etcd is lost.
* **Workers**: one pod per index ``0 .. replicas + spareNodes - 1``; a missing one is created
  with every evicted node excluded; a Failed one is replaced; one not yet scheduled whose
  affinity predates an eviction is recreated; indices beyond the count are deleted (scale down).
  Suspended: all worker pods are deleted. Succeeded/Failed: running pods are deleted (GPUs freed),
  finished ones kept for their logs.
* **TTL**: ``ttlSecondsAfterFinished`` after ``completionTime`` the job itself is deleted (and
  with it, through owner references, everything it owns).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megascale.k8s.builders import ANNOTATION_EXCLUDED, LABEL_INDEX, Job
from megascale.messages import (
    BlockedNode,
    ControllerState,
    Event,
    Heartbeat,
    JobSummaryRecord,
)

STARTING_STATES = ("init", "waiting_for_nodes", "starting")
RECOVERING_STATES = ("stopping", "diagnosing", "restarting")
TERMINAL_PHASES = ("Succeeded", "Failed")
CONDITION_TYPES = ("Created", "Running", "Recovering", "Succeeded", "Failed", "Suspended")


# -- inputs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EtcdView:
    """What the controller wrote for one job, decoded (``megascale.messages``); ``events``
    newest first."""

    state: ControllerState | None = None
    summary: JobSummaryRecord | None = None
    blocklist: Mapping[str, BlockedNode] = field(default_factory=dict)
    heartbeats: Mapping[str, Heartbeat] = field(default_factory=dict)
    events: Sequence[Event] = ()


@dataclass(frozen=True)
class WorkerPod:
    """The parts of a worker pod the decisions read."""

    name: str
    index: int | None
    node: str | None
    phase: str = "Pending"
    deleting: bool = False
    excluded: frozenset[str] = frozenset()

    @classmethod
    def from_manifest(cls, pod: Mapping[str, Any]) -> WorkerPod:
        meta, spec = pod.get("metadata", {}), pod.get("spec", {})
        index = (meta.get("labels") or {}).get(LABEL_INDEX)
        excluded = (meta.get("annotations") or {}).get(ANNOTATION_EXCLUDED, "")
        return cls(
            name=meta["name"],
            index=int(index) if index is not None and str(index).isdigit() else None,
            node=spec.get("nodeName"),
            phase=(pod.get("status") or {}).get("phase", "Pending"),
            deleting=meta.get("deletionTimestamp") is not None,
            excluded=frozenset(filter(None, excluded.split(","))),
        )


# -- effects ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CreatePod:
    """Create worker pod ``index``, kept off ``excluded`` nodes."""

    index: int
    excluded: tuple[str, ...]


@dataclass(frozen=True)
class DeletePod:
    """Delete a worker pod; ``replace``: it counts as a replacement (against backoffLimit)."""

    name: str
    reason: str
    replace: bool = False


@dataclass(frozen=True)
class CordonNode:
    """Cordon an evicted node and label it ``megascale.io/evicted=<job>``."""

    node: str
    reason: str


@dataclass(frozen=True)
class DeleteJob:
    """Delete the MegaScaleJob itself (its TTL after finishing has passed)."""

    reason: str


Effect = CreatePod | DeletePod | CordonNode | DeleteJob


@dataclass(frozen=True)
class Decision:
    status: dict[str, Any]
    effects: list[Effect]


# -- helpers ----------------------------------------------------------------------------------


def rfc3339(t: float) -> str:
    """Epoch seconds as ``2025-01-02T03:04:05Z`` (what Kubernetes' date-time fields hold)."""
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str) -> float:
    return (
        datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ")
        .replace(tzinfo=datetime.UTC)
        .timestamp()
    )


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: float,
    observed_generation: int,
) -> list[dict[str, Any]]:
    """``conditions`` with ``type_`` set; its ``lastTransitionTime`` moves only when its status
    flips (Kubernetes' convention), so re-applying the same condition changes nothing."""
    value = "True" if status else "False"
    out, seen = [], False
    for cond in conditions:
        cond = dict(cond)
        if cond.get("type") == type_:
            seen = True
            if cond.get("status") != value:
                cond["lastTransitionTime"] = rfc3339(now)
            cond.update(status=value, reason=reason, message=message)
            cond["observedGeneration"] = observed_generation
        out.append(cond)
    if not seen:
        out.append(
            {
                "type": type_,
                "status": value,
                "reason": reason,
                "message": message,
                "lastTransitionTime": rfc3339(now),
                "observedGeneration": observed_generation,
            }
        )
    return out


def phase_of(controller_state: str | None) -> str:
    """The phase the controller's state machine state stands for."""
    if controller_state is None:
        return "Pending"
    if controller_state in STARTING_STATES:
        return "Starting"
    if controller_state == "running":
        return "Running"
    if controller_state in RECOVERING_STATES:
        return "Recovering"
    if controller_state == "finished":
        return "Succeeded"
    if controller_state == "failed":
        return "Failed"
    raise ValueError(f"controller state = {controller_state!r}: not a known state")


def fault_message(state: ControllerState | None) -> str | None:
    fault = state.fault if state is not None else None
    if fault is None:
        return None
    where = [f"node {fault.node}"] if fault.node else []
    if fault.rank is not None:
        where.append(f"rank {fault.rank}")
    suspects = fault.suspects
    text = fault.kind + (f" on {', '.join(where)}" if where else "")
    # a stall's analysis: each named rank with its coordinates, node, group and op, or why none
    named = [str(c.get("text")) for c in fault.detail.get("culprits") or () if c.get("text")]
    named += [str(u.get("text")) for u in fault.detail.get("undecided") or () if u.get("text")]
    if named:
        return f"{text}: {'; '.join(named)}"
    return text + (f" (suspect ranks {suspects})" if suspects else "")


# -- worker pods ------------------------------------------------------------------------------


def plan_workers(
    job: Job,
    pods: Sequence[WorkerPod],
    blocklist: Mapping[str, str],
    phase: str,
) -> list[Effect]:
    """The pod effects that bring the worker pods in line (rules in the module docstring);
    ``blocklist``: evicted node -> why."""
    live = [p for p in pods if not p.deleting]
    if phase == "Suspended":
        return [DeletePod(p.name, "job suspended") for p in live]
    if phase in TERMINAL_PHASES:
        return [
            DeletePod(p.name, f"job {phase.lower()}")
            for p in live
            if p.phase in ("Pending", "Running", "Unknown")
        ]
    effects: list[Effect] = []
    evicted = set(blocklist)
    for pod in live:
        if pod.index is None or pod.index >= job.pods:
            effects.append(DeletePod(pod.name, "scaled down"))
        elif pod.node in evicted:
            reason = blocklist[pod.node]
            effects.append(DeletePod(pod.name, f"node {pod.node} evicted: {reason}", True))
        elif pod.phase == "Failed":
            effects.append(DeletePod(pod.name, "pod failed", True))
        elif pod.node is None and not evicted <= pod.excluded:
            effects.append(DeletePod(pod.name, "reschedule away from evicted nodes"))
    present = {p.index for p in pods}
    effects += [CreatePod(i, tuple(sorted(evicted))) for i in range(job.pods) if i not in present]
    return effects


# -- the status -------------------------------------------------------------------------------


def _evicted_nodes(
    blocklist: Mapping[str, BlockedNode],
    prior: Sequence[Mapping[str, Any]],
    pods: Sequence[WorkerPod],
) -> list[dict[str, Any]]:
    by_node = {e["node"]: dict(e) for e in prior}
    pod_on = {p.node: p.name for p in pods if p.node}
    for node, info in blocklist.items():
        entry = by_node.setdefault(node, {"node": node})
        entry.update(reason=info.reason, generation=info.generation, time=rfc3339(info.time))
        if node in pod_on and "pod" not in entry:
            entry["pod"] = pod_on[node]
    return [by_node[n] for n in sorted(by_node)]


def _figures(summary: JobSummaryRecord) -> dict[str, Any]:
    """The status fields of the controller's ``summary`` (``controller.job_summary``): only
    those it has a value for, so that an absent figure keeps the status' last one."""
    out: dict[str, Any] = {"faults": summary.faults}
    if summary.step is not None:
        out["step"] = summary.step
    if summary.tokens_per_s is not None:
        out["tokensPerSecond"] = float(summary.tokens_per_s)
    if summary.mfu is not None:
        out["mfu"] = float(summary.mfu)
        if summary.mfu_peak:
            out["mfuPeak"] = summary.mfu_peak
    mark = summary.last_checkpoint
    if mark is not None:
        out["lastCheckpoint"] = {"step": mark.step, "time": rfc3339(mark.time)}
        if mark.url:
            out["lastCheckpoint"]["url"] = mark.url
    effective = summary.effective
    if effective is not None and effective.wall_s:
        out["effectiveTrainingTime"] = {
            "productiveSeconds": round(effective.productive_s, 3),
            "wallSeconds": round(effective.wall_s, 3),
            "ratio": round(effective.ratio, 4),
        }
    return out


def _failure(
    job: Job, status: Mapping[str, Any], replacements: int, now: float
) -> tuple[str, str] | None:
    """(reason, message) when the run policy fails the job."""
    policy = job.spec["runPolicy"]
    deadline, start = policy.get("activeDeadlineSeconds"), status.get("startTime")
    if deadline is not None and start and now - parse_rfc3339(start) > deadline:
        return "DeadlineExceeded", f"running longer than activeDeadlineSeconds = {deadline}"
    limit = policy.get("backoffLimit")
    if limit is not None and replacements > limit:
        return (
            "BackoffLimitExceeded",
            f"{replacements} worker pods replaced, more than backoffLimit = {limit}",
        )
    return None


def _camel(word: str) -> str:
    return "".join(part.capitalize() for part in word.split("_"))


def _phase(job: Job, prior: Mapping[str, Any], state: ControllerState | None) -> tuple[str, str]:
    """(phase, reason) before the run policy is applied."""
    if prior.get("phase") in TERMINAL_PHASES:
        return prior["phase"], prior.get("reason", "Finished")
    if job.suspended:
        return "Suspended", "Suspended"
    if state is not None:
        fault = state.fault
        if state.state == "failed" and fault is not None and fault.kind == "job_fatal":
            return "Failed", "JobFatal"  # the job itself cannot proceed (probes/fatal.py)
        return phase_of(state.state), f"Controller{_camel(state.state)}"
    if prior.get("phase") in (None, "Suspended"):  # new, or resumed: until the controller says
        return "Pending", "WaitingForController"
    return prior["phase"], prior.get("reason", "WaitingForController")


def decide(
    job: Job,
    status: Mapping[str, Any],
    pods: Sequence[WorkerPod],
    view: EtcdView | None,
    now: float,
) -> Decision:
    """The new status and the effects (see the module docstring). ``view`` None: etcd could not
    be read; the mirrored fields keep their values and pods are still kept in line."""
    prior = dict(status or {})
    view = view or EtcdView()
    state = view.state
    known = {e["node"] for e in prior.get("evictedNodes", [])}
    blocklist = dict.fromkeys(known, "evicted") | {n: b.reason for n, b in view.blocklist.items()}

    out: dict[str, Any] = {**prior, "observedGeneration": job.generation}
    if not job.suspended and "startTime" not in out:
        out["startTime"] = rfc3339(now)
    phase, reason = _phase(job, prior, state)
    failed = state.failure if state is not None else None
    message = failed or fault_message(state) or prior.get("message", "")
    pod_effects = plan_workers(job, pods, blocklist, phase)
    replacements = int(prior.get("replacements", 0))
    replacements += sum(1 for e in pod_effects if isinstance(e, DeletePod) and e.replace)
    if phase not in TERMINAL_PHASES and phase != "Suspended":
        failure = _failure(job, out, replacements, now)
        if failure is not None:
            (reason, message), phase = failure, "Failed"
            replacements = int(prior.get("replacements", 0))
            pod_effects = plan_workers(job, pods, blocklist, phase)

    effects: list[Effect] = []
    if job.spec["faultTolerance"]["cordonEvictedNodes"]:
        new = sorted(set(view.blocklist) - known)
        effects += [CordonNode(n, view.blocklist[n].reason) for n in new]
    effects += pod_effects

    out.update(phase=phase, reason=reason, replacements=replacements)
    if message:
        out["message"] = message
    if phase in TERMINAL_PHASES and "completionTime" not in out:
        out["completionTime"] = rfc3339(now)
    if state is not None:
        out["controllerState"] = state.state
        out["currentGeneration"] = state.generation
        out["restarts"] = state.restarts
        if state.step is not None:
            out["step"] = state.step
        out["activeNodes"] = list(state.order)
        out["spareNodes"] = list(state.spares)
    if view.summary is not None and (state is None or view.summary.generation == state.generation):
        out.update(_figures(view.summary))
    out["evictedNodes"] = _evicted_nodes(view.blocklist, prior.get("evictedNodes", []), pods)
    if phase in ("Running", "Succeeded") and out.get("step") is not None:
        message = f"step {out['step']}" + (" (training finished)" if phase == "Succeeded" else "")
    out["conditions"] = _conditions(prior.get("conditions", []), phase, reason, message, now, job)

    ttl = job.spec["runPolicy"].get("ttlSecondsAfterFinished")
    if phase in TERMINAL_PHASES and ttl is not None:
        if now - parse_rfc3339(out["completionTime"]) >= ttl:
            effects.append(DeleteJob(f"ttlSecondsAfterFinished = {ttl} passed"))
    return Decision(out, effects)


def _conditions(
    prior: Sequence[Mapping[str, Any]], phase: str, reason: str, message: str, now: float, job: Job
) -> list[dict[str, Any]]:
    """Created is True once reconciled; exactly one of the others, the phase's, is True."""
    conditions = set_condition(prior, "Created", True, "Reconciled", "", now, job.generation)
    for type_ in CONDITION_TYPES[1:]:
        on = phase == type_
        conditions = set_condition(
            conditions,
            type_,
            on,
            reason if on else f"Not{type_}",
            message if on else "",
            now,
            job.generation,
        )
    return conditions
