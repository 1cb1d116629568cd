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

The job itself, its labels and the names of its objects are in ``megascale/k8s/job.py``; what the
megascale processes are given (command lines, environment, volumes, the training config and job
policy) is in ``megascale/k8s/launch.py``. The names callers use are importable from here too.
"""

from __future__ import annotations

import copy
import json
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from megascale.k8s import crd
from megascale.k8s.job import (
    ANNOTATION_EXCLUDED,
    DIST_PORT,
    ETCD_CLIENT_PORT,
    ETCD_PEER_PORT,
    FIELD_MANAGER,  # noqa: F401  (re-exported)
    LABEL_EVICTED,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_MANAGED_BY,  # noqa: F401  (re-exported)
    LABEL_NAME,
    LABEL_SELFCHECK,
    METRICS_PORT,  # noqa: F401  (re-exported)
    METRICS_PORT_NAME,  # noqa: F401  (re-exported)
    OPERATOR_NAME,
    RUN_DIR,
    BuildError,
    Job,
    _object,
    _plain,
    config_name,
    controller_name,
    etcd_endpoints,  # noqa: F401  (re-exported)
    etcd_name,
    labels,
    metadata,
    metrics_container_port,
    scrape_annotations,
    selector_labels,
    worker_account_name,
    worker_name,
    workers_service_name,
)
from megascale.k8s.launch import (
    _field_env,
    _megascale_container,
    _megascale_env,
    _megascale_volumes,
    _merge_named,
    agent_args,
    controller_args,
    job_policy,
    main_container_index,
    resolve_training_config,  # noqa: F401  (re-exported)
    training_config_hash,
    training_overrides,  # noqa: F401  (re-exported)
)

VOLCANO = ("scheduling.volcano.sh/v1beta1", "volcano")
COSCHEDULING = ("scheduling.x-k8s.io/v1alpha1", "scheduler-plugins-scheduler")
CUSTOM_KINDS = (
    # (group, version, kind, plural): kinds kubernetes-validate and lightkube do not know.
    (crd.GROUP, crd.VERSION, crd.KIND, crd.PLURAL),
    ("scheduling.volcano.sh", "v1beta1", "PodGroup", "podgroups"),
    ("scheduling.x-k8s.io", "v1alpha1", "PodGroup", "podgroups"),
)


# -- resolved config --------------------------------------------------------------------------


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


# -- controller -------------------------------------------------------------------------------


def controller_deployment(job: Job, **training: Any) -> dict[str, Any]:
    """The controller: one pod (0 while suspended), the workers' image, Recreate on change so two
    never overlap (its etcd election would fence a second one anyway). ``training``: what its
    command line takes from the training config (``controller_args``: ``tp``/``pp`` to name
    ranks by their (dp, pp, tp) coordinates, the ``[train]`` table and ``vpp`` that a shrink
    keeps, the step bound, the agents' config hash)."""
    template = job.template
    main = template["spec"]["containers"][main_container_index(template)]
    volumes, mounts = _megascale_volumes(job)
    volumes.append({"name": "run", "emptyDir": {}})
    container = {
        "name": "controller",
        "image": main["image"],
        "args": controller_args(job, **training),
        "env": _megascale_env(job),
        "volumeMounts": [*mounts, {"name": "run", "mountPath": RUN_DIR}],
        "ports": [metrics_container_port()],
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
        "template": {
            "metadata": {"labels": labels(job, "controller"), "annotations": scrape_annotations()},
            "spec": pod_spec,
        },
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
        **scrape_annotations(),
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
    resolved = tomllib.loads(resolved_toml)
    parallel = resolved.get("parallel", {})
    objects.append(
        controller_deployment(
            job,
            tp=parallel.get("tp", 1),
            pp=parallel.get("pp", 1),
            train=resolved.get("train", {}),
            vpp=parallel.get("vpp", 1),
            config_hash=training_config_hash(resolved_toml),
        )
    )
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
