"""Every Kubernetes object the operator makes for a MegaScaleJob, built by pure functions.

Each builder takes a ``Job`` (the custom resource, defaults applied) and returns a plain dict
manifest; nothing here talks to a cluster, so every object is unit-tested and validated offline
(``kubernetes-validate --strict``). The operator applies them (``megascale/k8s/operator.py``).

What a job is made of, by name (``<name>`` is the MegaScaleJob's)::

    <name>-etcd          StatefulSet + headless Service (+ NetworkPolicy)   managed etcd only
    <name>-resolved-config  ConfigMap: config.toml (resolved training config), job.json (policy)
    <name>-controller    ServiceAccount, Role, RoleBinding, Deployment (`megascale controller`)
    <name>-worker        ServiceAccount of the workers (no API access, no token mounted)
    <name>-workers       headless Service: <name>-worker-<i>.<name>-workers.<ns>.svc
    <name>-worker-<i>    Pod, i in 0 .. replicas + spareNodes - 1 (`megascale agent`)
    <name>               PodGroup (gang: volcano | coscheduling)

Every object carries the job's labels and a controller owner reference to the job, so deleting the
job deletes all of it (Kubernetes' garbage collector). Worker pods are one per Kubernetes node
(required pod anti-affinity) and the agent's node name is the Kubernetes node name, so the
controller's blocklist (``blocklist/<node>``) names Kubernetes nodes: a replacement pod is kept off
them with a required node affinity (``metadata.name NotIn [...]``) and off nodes the self-check
DaemonSet labelled ``megascale.io/selfcheck=failed``.

The agent and controller run with the flags of ``megascale agent`` / ``megascale controller``
(``agent_args``, ``controller_args``: a test parses them with the real CLI); the etcd password
comes from ``$MEGASCALE_ETCD_PASSWORD``. ``faultTolerance`` reaches the training config as
``--set`` overrides (checkpoint interval and URL, straggler threshold; ``training_overrides``) and
``/etc/megascale/job.json`` holds the whole policy.
"""

from __future__ import annotations

import copy
import json
import tempfile
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
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
MAIN_CONTAINER = "megascale"

VOLCANO = ("scheduling.volcano.sh/v1beta1", "volcano")
COSCHEDULING = ("scheduling.x-k8s.io/v1alpha1", "scheduler-plugins-scheduler")
CUSTOM_KINDS = (
    # (group, version, kind, plural): kinds kubernetes-validate and lightkube do not know.
    (crd.GROUP, crd.VERSION, crd.KIND, crd.PLURAL),
    ("scheduling.volcano.sh", "v1beta1", "PodGroup", "podgroups"),
    ("scheduling.x-k8s.io", "v1alpha1", "PodGroup", "podgroups"),
)


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


# -- training config --------------------------------------------------------------------------


def resolve_training_config(toml_text: str, overrides: Sequence[str], world_size: int) -> str:
    """The fully resolved training config (``megascale.config``: defaults < TOML < overrides),
    validated for ``world_size`` ranks, as TOML. Raises ``ConfigError`` naming the field."""
    from megascale import config

    with tempfile.TemporaryDirectory(prefix="megascale-k8s-") as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(toml_text)
        cfg = config.load(path, list(overrides))
    backend = "gloo" if cfg.train.device == "cpu" else "nccl"
    return config.to_toml(config.validate(cfg, world_size, backend))


def training_overrides(job: Job) -> list[str]:
    """``--set`` items for the training config: what ``faultTolerance`` says about checkpoints
    and stragglers, then the spec's own ``config.overrides`` (which win)."""
    ft = job.spec["faultTolerance"]
    straggler = ft["straggler"]
    out = [
        f"diagnostics.straggler_threshold={float(straggler['threshold'])}",
        f"diagnostics.straggler_action={json.dumps(straggler['action'])}",
    ]
    checkpoint = ft["checkpoint"]
    if checkpoint["intervalSteps"]:
        out.append(f"checkpoint.interval={int(checkpoint['intervalSteps'])}")
    if checkpoint.get("url"):
        out.append(f"checkpoint.url={json.dumps(checkpoint['url'])}")
    return out + list(job.spec["config"].get("overrides", []))


def job_policy(job: Job) -> dict[str, Any]:
    """``job.json``: what the controller and agents need besides the training config."""
    return {
        "job": job.id,
        "nodes": job.replicas,
        "spares": job.spares,
        "nprocPerNode": job.nproc,
        "faultTolerance": copy.deepcopy(job.spec["faultTolerance"]),
        "etcdEndpoints": etcd_endpoints(job),
        "workersService": f"{workers_service_name(job)}.{job.namespace}.svc",
    }


def config_map(job: Job, resolved_toml: str) -> dict[str, Any]:
    """``<name>-resolved-config``: the resolved training config and the job policy."""
    data = {"config.toml": resolved_toml, "job.json": json.dumps(job_policy(job), indent=2)}
    return _object("v1", "ConfigMap", metadata(job, config_name(job), "config"), data=data)


# -- etcd -------------------------------------------------------------------------------------


def etcd_service(job: Job) -> dict[str, Any]:
    """Headless Service of a managed etcd: stable member DNS names, also before they are ready
    (members find their peers while bootstrapping)."""
    return _object(
        "v1",
        "Service",
        metadata(job, etcd_name(job), "etcd"),
        spec={
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(job, "etcd"),
            "ports": [
                {"name": "client", "port": ETCD_CLIENT_PORT, "targetPort": ETCD_CLIENT_PORT},
                {"name": "peer", "port": ETCD_PEER_PORT, "targetPort": ETCD_PEER_PORT},
            ],
        },
    )


def etcd_statefulset(job: Job) -> dict[str, Any]:
    """A managed etcd: ``etcd.replicas`` members, data on a PVC (``etcd.storageSize``) or an
    emptyDir, plain HTTP inside the cluster (the NetworkPolicy limits who may connect)."""
    name, svc = etcd_name(job), f"{etcd_name(job)}.{job.namespace}.svc"
    members = [f"{name}-{i}" for i in range(job.etcd["replicas"])]
    initial = ",".join(f"{m}=http://{m}.{svc}:{ETCD_PEER_PORT}" for m in members)
    args = [
        "--name=$(POD_NAME)",
        "--data-dir=/var/lib/etcd/data",
        f"--listen-client-urls=http://0.0.0.0:{ETCD_CLIENT_PORT}",
        f"--advertise-client-urls=http://$(POD_NAME).{svc}:{ETCD_CLIENT_PORT}",
        f"--listen-peer-urls=http://0.0.0.0:{ETCD_PEER_PORT}",
        f"--initial-advertise-peer-urls=http://$(POD_NAME).{svc}:{ETCD_PEER_PORT}",
        f"--initial-cluster={initial}",
        "--initial-cluster-state=new",
        f"--initial-cluster-token={job.id}",
    ]
    container = {
        "name": "etcd",
        "image": job.etcd["image"],
        "command": ["etcd"],
        "args": args,
        "env": [_field_env("POD_NAME", "metadata.name")],
        "ports": [
            {"name": "client", "containerPort": ETCD_CLIENT_PORT},
            {"name": "peer", "containerPort": ETCD_PEER_PORT},
        ],
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": ETCD_CLIENT_PORT},
            "periodSeconds": 5,
        },
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}},
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    pod_spec: dict[str, Any] = {"containers": [container]}
    if job.spec["runPolicy"]["scheduling"].get("priorityClass"):
        pod_spec["priorityClassName"] = job.spec["runPolicy"]["scheduling"]["priorityClass"]
    spec: dict[str, Any] = {
        "serviceName": name,
        "replicas": job.etcd["replicas"],
        "podManagementPolicy": "Parallel",  # members bootstrap together
        "selector": {"matchLabels": selector_labels(job, "etcd")},
        "template": {"metadata": {"labels": labels(job, "etcd")}, "spec": pod_spec},
    }
    size = job.etcd.get("storageSize")
    if size is not None:
        spec["volumeClaimTemplates"] = [
            {
                "metadata": {"name": "data"},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": str(size)}},
                },
            }
        ]
    else:
        pod_spec["volumes"] = [{"name": "data", "emptyDir": {}}]
    return _object("apps/v1", "StatefulSet", metadata(job, name, "etcd"), spec=spec)


def etcd_network_policy(job: Job) -> dict[str, Any]:
    """Only the job's pods and the operator reach a managed etcd's client port; only its members
    its peer port."""
    client_from = [
        {"podSelector": {"matchLabels": {LABEL_JOB: job.name}}},
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {LABEL_NAME: OPERATOR_NAME}}},
    ]
    peer_from = [{"podSelector": {"matchLabels": selector_labels(job, "etcd")}}]
    return _object(
        "networking.k8s.io/v1",
        "NetworkPolicy",
        metadata(job, etcd_name(job), "etcd"),
        spec={
            "podSelector": {"matchLabels": selector_labels(job, "etcd")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": client_from, "ports": [{"port": ETCD_CLIENT_PORT}]},
                {"from": peer_from, "ports": [{"port": ETCD_PEER_PORT}]},
            ],
        },
    )


# -- RBAC -------------------------------------------------------------------------------------


def controller_rbac(job: Job) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding of the controller: read the job's pods, write Events.
    Everything else it does goes through etcd."""
    name = controller_name(job)
    meta = metadata(job, name, "controller")
    rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    ]
    return [
        _object("v1", "ServiceAccount", copy.deepcopy(meta)),
        _object("rbac.authorization.k8s.io/v1", "Role", copy.deepcopy(meta), rules=rules),
        _object(
            "rbac.authorization.k8s.io/v1",
            "RoleBinding",
            copy.deepcopy(meta),
            roleRef={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            subjects=[{"kind": "ServiceAccount", "name": name, "namespace": job.namespace}],
        ),
    ]


def worker_service_account(job: Job) -> dict[str, Any]:
    """The workers' ServiceAccount: no Role, and its token is not mounted."""
    meta = metadata(job, worker_account_name(job), "worker")
    return _object("v1", "ServiceAccount", meta, automountServiceAccountToken=False)


# -- the megascale containers -----------------------------------------------------------------


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _megascale_env(job: Job) -> list[dict[str, Any]]:
    """Environment of the controller and agents: the pod's identity (for ``$(VAR)`` in their
    arguments), the etcd credentials, and where the job policy is."""
    env: list[dict[str, Any]] = [
        _field_env("MEGASCALE_POD_NAME", "metadata.name"),
        _field_env("MEGASCALE_NODE_NAME", "spec.nodeName"),
        {"name": "MEGASCALE_JOB_SPEC", "value": f"{CONFIG_DIR}/job.json"},
    ]
    if job.etcd.get("authSecret"):
        for var, key in (("USERNAME", "username"), ("PASSWORD", "password")):
            ref = {"secretKeyRef": {"name": job.etcd["authSecret"], "key": key}}
            env.append({"name": f"MEGASCALE_ETCD_{var}", "valueFrom": ref})
    return env


def store_args(job: Job) -> list[str]:
    """The etcd options of ``megascale agent`` and ``megascale controller``
    (``robustness.service.add_store_arguments``); the password comes from
    ``$MEGASCALE_ETCD_PASSWORD``."""
    args = ["--endpoints", ",".join(etcd_endpoints(job))]
    if job.etcd.get("tlsSecret"):
        args += [
            "--ca-file",
            f"{ETCD_TLS_DIR}/ca.crt",
            "--cert-file",
            f"{ETCD_TLS_DIR}/tls.crt",
            "--key-file",
            f"{ETCD_TLS_DIR}/tls.key",
        ]
    if job.etcd.get("authSecret"):
        args += ["--user", "$(MEGASCALE_ETCD_USERNAME)"]
    return args


def _megascale_volumes(job: Job) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): the config ConfigMap, and the etcd TLS Secret when there is one."""
    volumes: list[dict[str, Any]] = [
        {"name": "megascale-config", "configMap": {"name": config_name(job)}}
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "megascale-config", "mountPath": CONFIG_DIR, "readOnly": True}
    ]
    if job.etcd.get("tlsSecret"):
        volumes.append(
            {
                "name": "etcd-tls",
                "secret": {"secretName": job.etcd["tlsSecret"], "defaultMode": 0o400},
            }
        )
        mounts.append({"name": "etcd-tls", "mountPath": ETCD_TLS_DIR, "readOnly": True})
    return volumes, mounts


def _merge_named(base: Iterable[Mapping[str, Any]], ours: Iterable[dict]) -> list[dict]:
    """``base`` entries (env vars, volumes, mounts...) with ours appended; ours win by name."""
    names = {item["name"] for item in ours}
    return [dict(item) for item in base if item.get("name") not in names] + list(ours)


def main_container_index(template: Mapping[str, Any]) -> int:
    """Index of the container that runs megascale: the one named ``megascale``, else the first."""
    containers = template.get("spec", {}).get("containers") or []
    if not containers:
        raise BuildError(
            "spec.replicaSpecs.Worker.template.spec.containers is empty: give at least one "
            f"container (the one named {MAIN_CONTAINER!r}, else the first, runs the agent)"
        )
    names = [c.get("name") for c in containers]
    return names.index(MAIN_CONTAINER) if MAIN_CONTAINER in names else 0


def _megascale_container(
    job: Job, container: Mapping[str, Any], args: list[str], mounts: list[dict]
) -> dict[str, Any]:
    out = copy.deepcopy(dict(container))
    out["args"] = args
    out.pop("command", None)
    out["env"] = _merge_named(out.get("env", []), _megascale_env(job))
    out["volumeMounts"] = _merge_named(out.get("volumeMounts", []), mounts)
    return out


def agent_args(job: Job, index: int) -> list[str]:
    """Worker ``index``'s command line: the agent, named after its Kubernetes node (so the
    controller's blocklist names nodes), reachable at its stable DNS name."""
    ft = job.spec["faultTolerance"]
    return [
        "megascale",
        "agent",
        f"{CONFIG_DIR}/config.toml",
        "--job",
        job.id,
        "--node",
        "$(MEGASCALE_NODE_NAME)",
        "--nproc-per-node",
        str(job.nproc),
        "--run-dir",
        RUN_DIR,
        "--heartbeat-interval",
        str(ft["heartbeatIntervalSeconds"]),
        "--addr",
        worker_address(job, index),
        *store_args(job),
    ]


def controller_args(job: Job, tp: int = 1, pp: int = 1) -> list[str]:
    """The controller's command line (``robustness.service.add_arguments``)."""
    ft = job.spec["faultTolerance"]
    return [
        "megascale",
        "controller",
        "--job",
        job.id,
        "--run-dir",
        RUN_DIR,
        "--nodes",
        str(job.replicas),
        "--nproc-per-node",
        str(job.nproc),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--heartbeat-interval",
        str(ft["heartbeatIntervalSeconds"]),
        "--max-restarts",
        str(ft["maxRestarts"]),
        "--straggler-threshold",
        str(float(ft["straggler"]["threshold"])),
        "--straggler-action",
        str(ft["straggler"]["action"]),
        *store_args(job),
    ]


# -- controller -------------------------------------------------------------------------------


def controller_deployment(job: Job, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """The controller: one pod (0 while suspended), the workers' image, Recreate on change so two
    never overlap (its etcd election would fence a second one anyway). ``tp``/``pp``: the
    training config's, so that it names ranks by their (dp, pp, tp) coordinates."""
    template = job.template
    main = template["spec"]["containers"][main_container_index(template)]
    volumes, mounts = _megascale_volumes(job)
    volumes.append({"name": "run", "emptyDir": {}})
    container = {
        "name": "controller",
        "image": main["image"],
        "args": controller_args(job, tp, pp),
        "env": _megascale_env(job),
        "volumeMounts": [*mounts, {"name": "run", "mountPath": RUN_DIR}],
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    if "imagePullPolicy" in main:
        container["imagePullPolicy"] = main["imagePullPolicy"]
    pod_spec: dict[str, Any] = {
        "serviceAccountName": controller_name(job),
        "containers": [container],
        "volumes": volumes,
    }
    if template["spec"].get("imagePullSecrets"):
        pod_spec["imagePullSecrets"] = copy.deepcopy(template["spec"]["imagePullSecrets"])
    if job.spec["runPolicy"]["scheduling"].get("priorityClass"):
        pod_spec["priorityClassName"] = job.spec["runPolicy"]["scheduling"]["priorityClass"]
    spec = {
        "replicas": 0 if job.suspended else 1,
        "strategy": {"type": "Recreate"},
        "selector": {"matchLabels": selector_labels(job, "controller")},
        "template": {"metadata": {"labels": labels(job, "controller")}, "spec": pod_spec},
    }
    meta = metadata(job, controller_name(job), "controller")
    return _object("apps/v1", "Deployment", meta, spec=spec)


# -- workers ----------------------------------------------------------------------------------


def workers_service(job: Job) -> dict[str, Any]:
    """Headless Service giving each worker pod a stable DNS name."""
    return _object(
        "v1",
        "Service",
        metadata(job, workers_service_name(job), "worker"),
        spec={
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(job, "worker"),
            "ports": [{"name": "dist", "port": DIST_PORT, "targetPort": DIST_PORT}],
        },
    )


def _gang(job: Job) -> tuple[str | None, dict[str, str], dict[str, str]]:
    """(schedulerName, pod labels, pod annotations) that put a worker pod in the job's gang."""
    scheduling = job.spec["runPolicy"]["scheduling"]
    scheduler = scheduling.get("schedulerName")
    if job.gang == "volcano":
        return scheduler or VOLCANO[1], {}, {"scheduling.k8s.io/group-name": job.name}
    if job.gang == "coscheduling":
        return scheduler or COSCHEDULING[1], {"scheduling.x-k8s.io/pod-group": job.name}, {}
    return scheduler, {}, {}


def _worker_affinity(
    job: Job, excluded: Sequence[str], user: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The user's affinity plus ours: one worker per node; off excluded (evicted) nodes and
    nodes whose self-check failed (or, with requirePassedNode, on nodes whose self-check passed).
    Our node requirements are added to every one of the user's (ORed) node selector terms."""
    affinity = copy.deepcopy(dict(user or {}))
    require_passed = job.spec["faultTolerance"]["selfCheck"]["requirePassedNode"]
    expression = {
        "key": LABEL_SELFCHECK,
        "operator": "In" if require_passed else "NotIn",
        "values": ["passed"] if require_passed else ["failed"],
    }
    fields = [{"key": "metadata.name", "operator": "NotIn", "values": sorted(excluded)}]
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        term["matchExpressions"] = [*term.get("matchExpressions", []), expression]
        if excluded:
            term["matchFields"] = [*term.get("matchFields", []), *fields]
    required["nodeSelectorTerms"] = terms
    pod_anti = affinity.setdefault("podAntiAffinity", {})
    pod_anti["requiredDuringSchedulingIgnoredDuringExecution"] = [
        *pod_anti.get("requiredDuringSchedulingIgnoredDuringExecution", []),
        {
            "labelSelector": {"matchLabels": selector_labels(job, "worker")},
            "topologyKey": "kubernetes.io/hostname",
        },
    ]
    return affinity


def worker_pod(job: Job, index: int, excluded: Iterable[str] = ()) -> dict[str, Any]:
    """Worker pod ``index``: the user's template with the agent in its main container, a stable
    hostname under the headless Service, gang membership, and the affinity above.

    ``excluded``: Kubernetes nodes it must not run on (the controller's blocklist). Pods are
    immutable, so a pod made before a node was evicted is replaced, not updated.
    """
    if not 0 <= index < job.pods:
        raise BuildError(f"worker index = {index}: must be in [0, {job.pods})")
    excluded = sorted(set(excluded))
    template = _plain(job.template)
    user_meta, spec = template.get("metadata", {}), template.get("spec", {})
    scheduler, gang_labels, gang_annotations = _gang(job)
    annotations = {
        **user_meta.get("annotations", {}),
        **gang_annotations,
        ANNOTATION_EXCLUDED: ",".join(excluded),
    }
    meta = metadata(
        job,
        worker_name(job, index),
        "worker",
        extra_labels={**user_meta.get("labels", {}), **gang_labels, LABEL_INDEX: str(index)},
        annotations=annotations,
    )
    volumes, mounts = _megascale_volumes(job)
    volumes.append({"name": "run", "emptyDir": {}})
    mounts.append({"name": "run", "mountPath": RUN_DIR})
    main = main_container_index(template)
    spec["containers"][main] = _megascale_container(
        job, spec["containers"][main], agent_args(job, index), mounts
    )
    spec["volumes"] = _merge_named(spec.get("volumes", []), volumes)
    spec["hostname"] = worker_name(job, index)
    spec["subdomain"] = workers_service_name(job)
    spec["restartPolicy"] = "OnFailure"  # the agent restarts in place; a lost node is replaced
    spec["serviceAccountName"] = worker_account_name(job)
    spec["automountServiceAccountToken"] = False
    spec["affinity"] = _worker_affinity(job, excluded, spec.get("affinity"))
    if scheduler:
        spec["schedulerName"] = scheduler
    if job.spec["runPolicy"]["scheduling"].get("priorityClass"):
        spec["priorityClassName"] = job.spec["runPolicy"]["scheduling"]["priorityClass"]
    return _object("v1", "Pod", meta, spec=spec)


def worker_pods(job: Job, excluded: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Every worker pod of a fresh job: replicas + spares (spares run the agent too, register and
    pass self-check, so they are ready to take an evicted node's slot)."""
    excluded = list(excluded)
    return [worker_pod(job, i, excluded) for i in range(job.pods)]


def pod_group(job: Job) -> dict[str, Any] | None:
    """The gang: all ``replicas`` workers are scheduled together or not at all (spares are extra);
    None with gang ``none``."""
    scheduling = job.spec["runPolicy"]["scheduling"]
    spec: dict[str, Any] = {"minMember": job.replicas}
    if job.gang == "volcano":
        api_version = VOLCANO[0]
        if scheduling.get("queue"):
            spec["queue"] = scheduling["queue"]
        if scheduling.get("priorityClass"):
            spec["priorityClassName"] = scheduling["priorityClass"]
    elif job.gang == "coscheduling":
        api_version = COSCHEDULING[0]
        if scheduling.get("scheduleTimeoutSeconds"):
            spec["scheduleTimeoutSeconds"] = scheduling["scheduleTimeoutSeconds"]
    else:
        return None
    return _object(api_version, "PodGroup", metadata(job, job.name, "worker"), spec=spec)


# -- everything -------------------------------------------------------------------------------


def managed_objects(job: Job, resolved_toml: str) -> list[dict[str, Any]]:
    """Every object of the job except the worker pods, in apply order (what a pod needs
    first). Applying them again is a no-op; a suspended job keeps them with the controller
    scaled to zero."""
    objects: list[dict[str, Any]] = []
    if job.etcd["managed"]:
        objects += [etcd_service(job), etcd_statefulset(job), etcd_network_policy(job)]
    objects.append(config_map(job, resolved_toml))
    objects += controller_rbac(job)
    objects.append(worker_service_account(job))
    objects.append(workers_service(job))
    group = pod_group(job)
    if group is not None:
        objects.append(group)
    parallel = tomllib.loads(resolved_toml).get("parallel", {})
    objects.append(controller_deployment(job, parallel.get("tp", 1), parallel.get("pp", 1)))
    return objects


# -- node patches -----------------------------------------------------------------------------

ANNOTATION_EVICTED_REASON = "megascale.io/evicted-reason"
ANNOTATION_SELFCHECK_TIME = "megascale.io/selfcheck-time"
ANNOTATION_SELFCHECK_SUMMARY = "megascale.io/selfcheck-summary"


def evicted_node_patch(job: Job, reason: str) -> dict[str, Any]:
    """Merge patch for a node the controller evicted: cordoned, labelled with the job's name,
    the reason in an annotation. An administrator uncordons it after repair."""
    return {
        "metadata": {
            "labels": {LABEL_EVICTED: job.name},
            "annotations": {ANNOTATION_EVICTED_REASON: f"{job.id}: {reason}"[:1024]},
        },
        "spec": {"unschedulable": True},
    }


def selfcheck_node_patch(passed: bool, when: str, summary: str) -> dict[str, Any]:
    """Merge patch the self-check DaemonSet puts on its node: ``megascale.io/selfcheck=passed``
    or ``failed``, with the time (RFC 3339) and a short summary in annotations."""
    return {
        "metadata": {
            "labels": {LABEL_SELFCHECK: "passed" if passed else "failed"},
            "annotations": {
                ANNOTATION_SELFCHECK_TIME: when,
                ANNOTATION_SELFCHECK_SUMMARY: summary[:1024],
            },
        }
    }
