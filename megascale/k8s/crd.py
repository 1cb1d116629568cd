"""The ``MegaScaleJob`` custom resource definition, as data, and what the API server would say.

``crd()`` is the CustomResourceDefinition (``megascale.io/v1alpha1``, kind ``MegaScaleJob``,
namespaced) with a full structural ``openAPIV3Schema``: defaults, ranges, enums, CEL rules
(``x-kubernetes-validations``), a status subresource and printer columns. The committed YAML files
are generated from it (``python -m megascale.k8s.crd --write``); a test keeps them equal.

The shape, what users know from Kubeflow's PyTorchJob and JobSet::

    spec:
      replicaSpecs: {Worker: {replicas: 4, template: <PodTemplateSpec>}}   # one pod per node
      nprocPerNode: 8                                                      # ranks per pod
      runPolicy: {activeDeadlineSeconds, backoffLimit, suspend, ttlSecondsAfterFinished,
                  scheduling: {gang: volcano|coscheduling|none, queue, priorityClass, ...}}
      faultTolerance: {heartbeatIntervalSeconds, maxRestarts, restartWindowSeconds,
                       policy: wait|shrink|fail, nodeWaitTimeoutSeconds, spareNodes,
                       cordonEvictedNodes,
                       selfCheck: {tests, timeoutSeconds, requirePassedNode},
                       straggler: {threshold, action: report|evict},
                       checkpoint: {intervalSteps, url}}
      etcd: {managed: true, replicas, image, storageSize}  |  {managed: false, endpoints, tlsSecret,
                                                               authSecret}
      config: {inline: "<TOML>"} | {configMapRef: {name, key}},  overrides: ["section.key=value"]

What the API server would say about a resource, offline: ``megascale.k8s.validation``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from megascale.config import FaultToleranceConfig
from megascale.config.rules import NODE_LOSS_POLICIES, STRAGGLER_ACTIONS
from megascale.k8s.crd_status import (  # noqa: F401  (status_schema, PRINTER_COLUMNS re-exported)
    PHASES,
    PRINTER_COLUMNS,
    _int,
    _obj,
    _rule,
    _str,
    status_schema,
)

logger = logging.getLogger(__name__)

GROUP = "megascale.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MegaScaleJob"
PLURAL = "megascalejobs"
SINGULAR = "megascalejob"
SHORT_NAMES = ["msj"]
CRD_NAME = f"{PLURAL}.{GROUP}"

MAX_NAME = 40
"""Longest job name: worker pods are ``<name>-worker-<index>`` and their hostname is a DNS label
(at most 63 characters)."""
GANG_SCHEDULERS = ("none", "volcano", "coscheduling")
DEFAULT_ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = REPO_ROOT / "k8s" / "crd" / "megascalejob.yaml"
HELM_CRD_FILE = REPO_ROOT / "k8s" / "helm" / "megascale-operator" / "templates" / "crd.yaml"


_NAME_REF = _str("Name of an object in the job's namespace.", maxLength=253, minLength=1)
_ENDPOINT_PATTERN = r"^(https?://)?[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}$"


def _worker_schema() -> dict[str, Any]:
    return _obj(
        "The worker pods: one per node, each running `megascale agent`, which starts "
        "nprocPerNode training processes.",
        {
            "replicas": _int(
                "Nodes that train (M); spares (faultTolerance.spareNodes) come on top.", minimum=1
            ),
            "template": {
                "type": "object",
                "description": "Pod template (a PodTemplateSpec) for the worker pods. The "
                "container named `megascale` (else the first one) runs the agent; its image "
                "also runs the controller.",
                "x-kubernetes-preserve-unknown-fields": True,
            },
        },
        required=["replicas", "template"],
    )


def _scheduling_schema() -> dict[str, Any]:
    return _obj(
        "Where and how the worker pods are scheduled.",
        {
            "gang": _str(
                "Gang scheduling: `volcano` (scheduling.volcano.sh PodGroup), `coscheduling` "
                "(the scheduler-plugins PodGroup) or `none`.",
                enum=list(GANG_SCHEDULERS),
                default="none",
            ),
            "queue": _str("Volcano queue of the PodGroup.", maxLength=253),
            "priorityClass": _str("PriorityClass of every pod of the job.", maxLength=253),
            "schedulerName": _str(
                "Scheduler of the worker pods; default: `volcano` for gang volcano, "
                "`scheduler-plugins-scheduler` for coscheduling, the cluster default otherwise.",
                maxLength=253,
            ),
            "scheduleTimeoutSeconds": _int(
                "How long the gang may wait to be scheduled as a whole.", minimum=1
            ),
        },
        default={},
        **{
            "x-kubernetes-validations": [
                _rule(
                    "!has(self.queue) || self.gang == 'volcano'",
                    "scheduling.queue needs gang: volcano (queues are Volcano's)",
                    fieldPath=".queue",
                )
            ]
        },
    )


def _run_policy_schema() -> dict[str, Any]:
    return _obj(
        "Job-level policy, as in Kubeflow's RunPolicy.",
        {
            "activeDeadlineSeconds": _int(
                "The job fails (reason DeadlineExceeded) this long after it started running.",
                minimum=1,
            ),
            "backoffLimit": _int(
                "Worker pods the operator may replace (evicted or failed pods) before the job "
                "fails (reason BackoffLimitExceeded); unlimited when unset.",
                minimum=0,
            ),
            "suspend": {
                "type": "boolean",
                "default": False,
                "description": "Suspended: the controller and worker pods are deleted; etcd, "
                "its state and the config stay. Resuming recreates them.",
            },
            "ttlSecondsAfterFinished": _int(
                "Delete the job (and, by owner references, everything it made) this long after "
                "it succeeded or failed.",
                minimum=0,
            ),
            "scheduling": _scheduling_schema(),
        },
        default={},
    )


def _fault_tolerance_schema() -> dict[str, Any]:
    """``spec.faultTolerance``; its defaults are the config's (``FaultToleranceConfig``)."""
    ft = FaultToleranceConfig()
    self_check = _obj(
        "The node self-check the controller runs on every node after a fault.",
        {
            "tests": {
                "type": "array",
                "description": "Checks of `megascale selfcheck` the agents' full self-check "
                "runs after a fault: a group (gpu, host, net), a check name (gpu.matmul) or a "
                "shell pattern (net.*); empty: all of them.",
                "maxItems": 32,
                "items": _str("A self-check test name.", maxLength=64, pattern="^[a-z0-9_.-]+$"),
                "default": [],
            },
            "timeoutSeconds": _int(
                "A node that has not reported its self-check within this is evicted.",
                minimum=1,
                default=int(ft.selfcheck_timeout_s),
            ),
            "requirePassedNode": {
                "type": "boolean",
                "default": False,
                "description": "Schedule workers only on nodes the self-check DaemonSet "
                "labelled megascale.io/selfcheck=passed (they always avoid `failed` ones).",
            },
        },
        default={},
    )
    straggler = _obj(
        "Straggler detection: a node slower than its peers' median by this factor.",
        {
            "threshold": {
                "type": "number",
                "description": "Slowdown factor vs the median of its peers (1.1 = 10% slower).",
                "default": ft.straggler_threshold,
            },
            "action": _str(
                "`report` (event and metric) or `evict` (blocklist and replace the node).",
                enum=list(STRAGGLER_ACTIONS),
                default=ft.straggler_action,
            ),
        },
        default={},
        **{
            "x-kubernetes-validations": [
                _rule(
                    "self.threshold > 1.0",
                    "straggler.threshold must be > 1.0",
                    fieldPath=".threshold",
                )
            ]
        },
    )
    checkpoint = _obj(
        "Periodic checkpoints the job restarts from.",
        {
            "intervalSteps": _int("Steps between checkpoints; 0: none.", minimum=0, default=0),
            "url": _str(
                "Directory or fsspec URL (file://, s3://, gs://...) the checkpoints go to.",
                maxLength=2048,
            ),
        },
        default={},
        **{
            "x-kubernetes-validations": [
                _rule(
                    "self.intervalSteps == 0 || has(self.url)",
                    "checkpoint.url is required when checkpoint.intervalSteps > 0",
                    fieldPath=".url",
                )
            ]
        },
    )
    return _obj(
        "How faults are detected and recovered from (the robust-training controller).",
        {
            "heartbeatIntervalSeconds": _int(
                "Seconds between an agent's heartbeats.", minimum=1, maximum=60, default=1
            ),
            "maxRestarts": _int(
                "Restarts allowed within any restartWindowSeconds; the fault that would exceed "
                "it fails the job.",
                minimum=0,
                default=ft.max_restarts,
            ),
            "restartWindowSeconds": _int(
                "The sliding window maxRestarts counts restarts in.",
                minimum=1,
                default=int(ft.restart_window_s),
            ),
            "policy": _str(
                "A node lost or evicted with no spare: `wait` for a replacement (up to "
                "nodeWaitTimeoutSeconds), `shrink` to the nodes left at the largest data-parallel "
                "size the global batch allows (more micro-batches per rank; grows back at the "
                "next restart once enough nodes are registered), or `fail` the job.",
                enum=list(NODE_LOSS_POLICIES),
                default=ft.policy,
            ),
            "nodeWaitTimeoutSeconds": _int(
                "Longest the job waits for enough nodes before it fails; unset: no limit.",
                minimum=1,
            ),
            "spareNodes": _int(
                "Worker pods beyond replicas, started and self-checked, that replace an evicted "
                "node without waiting for scheduling.",
                minimum=0,
                default=0,
            ),
            "cordonEvictedNodes": {
                "type": "boolean",
                "default": False,
                "description": "Cordon a node the controller evicted, and label it "
                "megascale.io/evicted=<job>.",
            },
            "selfCheck": self_check,
            "straggler": straggler,
            "checkpoint": checkpoint,
        },
        default={},
    )


def _etcd_schema() -> dict[str, Any]:
    return _obj(
        "The control plane's etcd: managed by the operator (a StatefulSet per job) or external.",
        {
            "managed": {
                "type": "boolean",
                "default": True,
                "description": "The operator runs etcd for this job; false: give endpoints.",
            },
            "replicas": _int("Members of a managed etcd.", default=1, enum=[1, 3, 5]),
            "image": _str("Image of a managed etcd.", default=DEFAULT_ETCD_IMAGE, maxLength=512),
            "storageSize": {
                "description": "PersistentVolumeClaim size for a managed etcd's data; "
                "an emptyDir when unset.",
                "anyOf": [{"type": "integer"}, {"type": "string"}],
                "x-kubernetes-int-or-string": True,
                "pattern": r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$",
            },
            "endpoints": {
                "type": "array",
                "description": "External etcd: host:port or http(s)://host:port.",
                "maxItems": 16,
                "items": _str("An etcd client URL.", maxLength=256, pattern=_ENDPOINT_PATTERN),
            },
            "tlsSecret": _NAME_REF
            | {
                "description": "External etcd: Secret with ca.crt (and tls.crt/tls.key for "
                "client-certificate auth)."
            },
            "authSecret": _NAME_REF
            | {"description": "External etcd: Secret with username and password."},
        },
        default={},
        **{
            "x-kubernetes-validations": [
                _rule(
                    "self.managed != (has(self.endpoints) && size(self.endpoints) > 0)",
                    "etcd: set managed: true, or managed: false with endpoints (exactly one)",
                ),
                _rule(
                    "!self.managed || (!has(self.tlsSecret) && !has(self.authSecret))",
                    "etcd.tlsSecret and etcd.authSecret are for external etcd (managed: false)",
                ),
                _rule("self == oldSelf", "etcd is immutable once the job exists"),
            ]
        },
    )


def _config_schema() -> dict[str, Any]:
    return _obj(
        "The training config (megascale.config TOML): inline, or a key of a ConfigMap.",
        {
            "inline": _str("The TOML text.", maxLength=262144),
            "configMapRef": _obj(
                "A ConfigMap in the job's namespace holding the TOML.",
                {"name": _NAME_REF, "key": _str("Key in the ConfigMap.", default="config.toml")},
                required=["name"],
            ),
            "overrides": {
                "type": "array",
                "description": "`section.key=value` overrides applied after the TOML (as `--set`).",
                "maxItems": 64,
                "items": _str("One override.", maxLength=1024, pattern=r"^[a-z_]+\.[a-z_0-9]+=.*$"),
            },
        },
        **{
            "x-kubernetes-validations": [
                _rule(
                    "has(self.inline) != has(self.configMapRef)",
                    "config: give exactly one of inline or configMapRef",
                )
            ]
        },
    )


def spec_schema() -> dict[str, Any]:
    """The openAPIV3Schema of ``.spec``."""
    return _obj(
        "A fault-tolerant megascale pretraining job.",
        {
            "replicaSpecs": _obj(
                "Replica types; only Worker.", {"Worker": _worker_schema()}, required=["Worker"]
            ),
            "nprocPerNode": _int(
                "Training processes (ranks) per worker pod, usually its GPUs.",
                minimum=1,
                maximum=64,
                default=8,
                **{
                    "x-kubernetes-validations": [
                        _rule("self == oldSelf", "nprocPerNode is immutable")
                    ]
                },
            ),
            "runPolicy": _run_policy_schema(),
            "faultTolerance": _fault_tolerance_schema(),
            "etcd": _etcd_schema(),
            "config": _config_schema(),
        },
        required=["replicaSpecs", "config"],
        **{
            "x-kubernetes-validations": [
                _rule(
                    "self.faultTolerance.spareNodes <= self.replicaSpecs.Worker.replicas",
                    "faultTolerance.spareNodes must be <= replicaSpecs.Worker.replicas",
                    fieldPath=".faultTolerance.spareNodes",
                )
            ]
        },
    )


def open_api_schema() -> dict[str, Any]:
    """The whole object's openAPIV3Schema (root rules may read ``self.metadata.name``); every
    object's ``default`` holds its nested defaults too (``with_full_defaults``)."""
    return with_full_defaults(
        {
            "type": "object",
            "description": "MegaScaleJob: fault-tolerant LLM pretraining on megatron-core.",
            "properties": {
                "apiVersion": {"type": "string"},
                "kind": {"type": "string"},
                "metadata": {"type": "object"},
                "spec": spec_schema(),
                "status": status_schema(),
            },
            "required": ["spec"],
            "x-kubernetes-validations": [
                _rule(
                    f"size(self.metadata.name) <= {MAX_NAME}",
                    f"metadata.name must be at most {MAX_NAME} characters (worker pods are "
                    "<name>-worker-<index>, a 63-character DNS label)",
                ),
                _rule(
                    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
                    "metadata.name must be a DNS-1035 label (it names Services)",
                ),
            ],
        }
    )


def with_full_defaults(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with each object's ``default`` completed by its properties' defaults, nested.

    The API server checks a CRD's defaults when it is created: it evaluates the object's CEL rules
    on the ``default`` value as written, without defaulting inside it, so ``default: {}`` fails
    any rule that reads a field (``no such key: managed``) and the CRD is refused (422). Spelled
    out, a default is what a job that omits the object gets anyway (the server would default
    inside it on a real object). Modifies and returns ``schema``.
    """
    for sub in schema.get("properties", {}).values():
        with_full_defaults(sub)
    if isinstance(schema.get("items"), dict):
        with_full_defaults(schema["items"])
    default = schema.get("default")
    if isinstance(default, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in default and "default" in sub:
                default[name] = copy.deepcopy(sub["default"])
    return schema


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition manifest."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/part-of": "megascale"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["all", "megascale"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": open_api_schema()},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                }
            ],
        },
    }


# -- the committed files ----------------------------------------------------------------------

_HEADER = (
    "# GENERATED by `python -m megascale.k8s.crd --write` from megascale/k8s/crd.py; do not edit.\n"
)


def crd_yaml() -> str:
    """k8s/crd/megascalejob.yaml."""
    return _HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100)


def helm_crd_template() -> str:
    """The chart's templates/crd.yaml: the same CRD, kept on uninstall, behind installCRDs."""
    obj = crd()
    obj["metadata"]["annotations"] = {"helm.sh/resource-policy": "keep"}
    body = yaml.safe_dump(obj, sort_keys=False, width=100)
    if "{{" in body:  # Helm would treat it as template text
        raise ValueError("the CRD contains '{{': escape it before putting it in a Helm template")
    return _HEADER + "{{- if .Values.installCRDs }}\n" + body + "{{- end }}\n"


def generated_files() -> dict[Path, str]:
    return {CRD_FILE: crd_yaml(), HELM_CRD_FILE: helm_crd_template()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megascale.k8s.crd", description=__doc__)
    parser.add_argument("--write", action="store_true", help="write the committed YAML files")
    args = parser.parse_args(argv)
    if not args.write:
        sys.stdout.write(crd_yaml())
        return 0
    for path, text in generated_files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
