"""The MegaScaleJob as the builders read it, and what all of its objects share.

``Job`` is the custom resource with schema defaults applied; the rest is what every builder in
``megascale/k8s/builders.py`` (and the processes set up by ``megascale/k8s/launch.py``) names
alike: the labels, annotations, paths and ports; a child object's metadata (the job's labels and a
controller owner reference to the job); and the name of every object (``<name>-etcd``,
``<name>-worker-<i>``, ...) and of the etcd endpoints. Pure functions, no cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megascale.k8s import crd
from megascale.k8s.validation import apply_defaults

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_JOB = "megascale.io/job-name"
LABEL_INDEX = "megascale.io/replica-index"
LABEL_SELFCHECK = "megascale.io/selfcheck"
"""Node label the self-check DaemonSet sets: ``passed`` or ``failed``."""
LABEL_EVICTED = "megascale.io/evicted"
"""Node label the operator sets on a node the controller evicted (value: the job's name)."""
ANNOTATION_EXCLUDED = "megascale.io/excluded-nodes"
"""Worker pod annotation: the comma-separated nodes its affinity excludes."""
OPERATOR_NAME = "megascale-operator"
FIELD_MANAGER = OPERATOR_NAME

CONFIG_DIR = "/etc/megascale"
ETCD_TLS_DIR = "/etc/megascale/etcd-tls"
RUN_DIR = "/var/run/megascale"
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
DIST_PORT = 29500
METRICS_PORT = 9400
"""The agents' and the controller's Prometheus ``/metrics`` port in pods, on the pod's IP."""
METRICS_PORT_NAME = "metrics"
"""The name of that container port: what the chart's PodMonitor scrapes."""
MAIN_CONTAINER = "megascale"


class BuildError(ValueError):
    """The job cannot be turned into objects (names the field, the value, what is accepted)."""


# -- the job ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """A MegaScaleJob as the builders read it: identity plus the spec with defaults applied."""

    name: str
    namespace: str
    uid: str
    spec: Mapping[str, Any]
    generation: int = 1

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Job:
        """From the resource (a dict or kopf's body); schema defaults filled in."""
        plain = apply_defaults(_plain(body))
        meta = plain.get("metadata", {})
        return cls(
            name=meta["name"],
            namespace=meta.get("namespace") or "default",
            uid=meta.get("uid", ""),
            spec=plain["spec"],
            generation=int(meta.get("generation", 1)),
        )

    @property
    def id(self) -> str:
        """The job id in etcd (``/megascale/<id>/``): unique across namespaces."""
        return f"{self.namespace}.{self.name}"

    @property
    def replicas(self) -> int:
        return int(self.spec["replicaSpecs"]["Worker"]["replicas"])

    @property
    def spares(self) -> int:
        return int(self.spec["faultTolerance"]["spareNodes"])

    @property
    def nproc(self) -> int:
        return int(self.spec["nprocPerNode"])

    @property
    def pods(self) -> int:
        """Worker pods wanted: replicas plus spares."""
        return self.replicas + self.spares

    @property
    def suspended(self) -> bool:
        return bool(self.spec["runPolicy"]["suspend"])

    @property
    def gang(self) -> str:
        return self.spec["runPolicy"]["scheduling"]["gang"]

    @property
    def etcd(self) -> Mapping[str, Any]:
        return self.spec["etcd"]

    @property
    def template(self) -> Mapping[str, Any]:
        return self.spec["replicaSpecs"]["Worker"]["template"]


def _plain(value: Any) -> Any:
    """Mappings and sequences as dicts and lists (kopf hands out read-only views)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# -- shared metadata helpers ------------------------------------------------------------------


def owner_reference(job: Job) -> dict[str, Any]:
    """The controller owner reference to the job: deleting the job deletes the object."""
    return {
        "apiVersion": crd.API_VERSION,
        "kind": crd.KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def selector_labels(job: Job, component: str) -> dict[str, str]:
    """The labels that select one component of one job (Service and workload selectors)."""
    return {LABEL_JOB: job.name, LABEL_COMPONENT: component}


def labels(job: Job, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: "megascale",
        LABEL_INSTANCE: job.name,
        LABEL_MANAGED_BY: OPERATOR_NAME,
        **selector_labels(job, component),
    }


def scrape_annotations() -> dict[str, str]:
    """The ``prometheus.io/*`` annotations that a Prometheus with the common
    ``kubernetes-pods`` scrape config (no Prometheus operator) follows to ``/metrics``."""
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(METRICS_PORT),
        "prometheus.io/path": "/metrics",
    }


def metrics_container_port() -> dict[str, Any]:
    """The named ``/metrics`` port declared on the agent's and the controller's container."""
    return {"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"}


def metadata(
    job: Job,
    name: str,
    component: str,
    *,
    extra_labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Metadata of a child object: its name in the job's namespace, the job's labels (after any
    ``extra_labels``, which cannot override them), and the owner reference."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": job.namespace,
        "labels": {**(extra_labels or {}), **labels(job, component)},
        "ownerReferences": [owner_reference(job)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def _object(api_version: str, kind: str, meta: dict[str, Any], **body: Any) -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind, "metadata": meta, **body}


# -- names ------------------------------------------------------------------------------------


def etcd_name(job: Job) -> str:
    return f"{job.name}-etcd"


def config_name(job: Job) -> str:
    return f"{job.name}-resolved-config"


def controller_name(job: Job) -> str:
    return f"{job.name}-controller"


def worker_account_name(job: Job) -> str:
    return f"{job.name}-worker"


def workers_service_name(job: Job) -> str:
    return f"{job.name}-workers"


def worker_name(job: Job, index: int) -> str:
    return f"{job.name}-worker-{index}"


def worker_address(job: Job, index: int) -> str:
    """Worker ``index``'s stable DNS name (headless Service + hostname/subdomain)."""
    return f"{worker_name(job, index)}.{workers_service_name(job)}.{job.namespace}.svc"


def etcd_endpoints(job: Job) -> list[str]:
    """Client URLs of the job's etcd: every member of a managed one, or the external ones."""
    if not job.etcd["managed"]:
        return list(job.etcd["endpoints"])
    svc = f"{etcd_name(job)}.{job.namespace}.svc"
    return [
        f"http://{etcd_name(job)}-{i}.{svc}:{ETCD_CLIENT_PORT}" for i in range(job.etcd["replicas"])
    ]
