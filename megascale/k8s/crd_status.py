"""The MegaScaleJob CRD's schema building blocks, its ``.status`` schema and its printer columns
(``kubectl get megascalejobs``); ``megascale.k8s.crd`` assembles the whole CRD from them.

The status is written by the operator only (``megascale.k8s.status.decide``), from what the
controller publishes in etcd: its ``state`` snapshot and its ``summary`` of the job's figures.
"""

from __future__ import annotations

from typing import Any

PHASES = ("Pending", "Starting", "Running", "Recovering", "Succeeded", "Failed", "Suspended")


# -- schema building blocks ----------------------------------------------------------------------


def _int(description: str, *, minimum: int | None = None, default: int | None = None, **kw: Any):
    out: dict[str, Any] = {"type": "integer", "format": "int32", "description": description}
    if minimum is not None:
        out["minimum"] = minimum
    if default is not None:
        out["default"] = default
    return out | kw


def _str(description: str, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "description": description} | kw


def _obj(description: str, properties: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"type": "object", "description": description, "properties": properties} | kw


def _rule(rule: str, message: str, **kw: Any) -> dict[str, Any]:
    return {"rule": rule, "message": message} | kw


def status_schema() -> dict[str, Any]:
    """The openAPIV3Schema of ``.status`` (written by the operator only)."""
    condition = _obj(
        "A condition, as metav1.Condition.",
        {
            "type": _str("Created, Running, Recovering, Succeeded, Failed or Suspended."),
            "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": _str("CamelCase reason."),
            "message": _str("Human-readable detail."),
            "lastTransitionTime": _str("When status last changed.", format="date-time"),
            "observedGeneration": {"type": "integer", "format": "int64"},
        },
        required=["type", "status"],
    )
    evicted = _obj(
        "A node the controller evicted (its blocklist entry).",
        {
            "node": _str("Kubernetes node name (the agent's node name)."),
            "reason": _str("Why the controller evicted it."),
            "generation": {"type": "integer", "format": "int64"},
            "time": _str("When, RFC 3339.", format="date-time"),
            "pod": _str("The worker pod that ran there."),
        },
        required=["node"],
    )
    return _obj(
        "Observed state, mirrored from the controller's etcd state by the operator.",
        {
            "phase": _str("Summary of the conditions.", enum=list(PHASES)),
            "reason": _str("Why the job is in its phase (CamelCase)."),
            "conditions": {
                "type": "array",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "observedGeneration": {
                "type": "integer",
                "format": "int64",
                "description": "metadata.generation the operator last reconciled.",
            },
            "controllerState": _str("The controller state machine's state (e.g. running)."),
            "currentGeneration": {
                "type": "integer",
                "format": "int64",
                "description": "Training generation: 1 at the first start, +1 per restart.",
            },
            "restarts": {"type": "integer", "format": "int32"},
            "replacements": {
                "type": "integer",
                "format": "int32",
                "description": "Worker pods the operator replaced (counts against backoffLimit).",
            },
            "step": {"type": "integer", "format": "int64"},
            "activeNodes": {"type": "array", "items": {"type": "string"}},
            "spareNodes": {"type": "array", "items": {"type": "string"}},
            "evictedNodes": {"type": "array", "items": evicted},
            "lastCheckpoint": _obj(
                "The newest complete (durable: every rank's files and the manifest written) "
                "checkpoint the job reported.",
                {
                    "step": {"type": "integer", "format": "int64"},
                    "url": _str("Where it is."),
                    "time": _str("When it completed, RFC 3339.", format="date-time"),
                },
            ),
            "mfu": {
                "type": "number",
                "description": "Model FLOPs utilisation of the whole job, 0..1, against mfuPeak.",
            },
            "mfuPeak": _str(
                "The per-device peak MFU is measured against and where it came from "
                "(train.peak_tflops, the GPU's dense bf16 table peak, or measured:cpu <dtype>)."
            ),
            "tokensPerSecond": {"type": "number", "description": "Tokens/s of the whole job."},
            "faults": {
                "type": "integer",
                "format": "int32",
                "description": "Faults the controller detected since the job started.",
            },
            "effectiveTrainingTime": _obj(
                "Wall time that went into training progress that was kept (MegaScale's "
                "effective training time), counted by the leading controller.",
                {
                    "productiveSeconds": {"type": "number"},
                    "wallSeconds": {"type": "number"},
                    "ratio": {"type": "number", "description": "productive / wall, 0..1."},
                },
            ),
            "startTime": _str("When the job first ran.", format="date-time"),
            "completionTime": _str("When it succeeded or failed.", format="date-time"),
            "message": _str("Last fault or failure, in words."),
        },
    )


PRINTER_COLUMNS = [
    {"name": "Workers", "type": "integer", "jsonPath": ".spec.replicaSpecs.Worker.replicas"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "State", "type": "string", "jsonPath": ".status.controllerState"},
    {"name": "Gen", "type": "integer", "jsonPath": ".status.currentGeneration"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
    {"name": "MFU", "type": "number", "jsonPath": ".status.mfu"},
    {"name": "Tokens/s", "type": "number", "jsonPath": ".status.tokensPerSecond", "priority": 1},
    {
        "name": "Checkpoint",
        "type": "integer",
        "jsonPath": ".status.lastCheckpoint.step",
        "priority": 1,
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
