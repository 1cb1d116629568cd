"""What the megascale processes in a job's pods are given, by pure functions.

The agent and controller run with the flags of ``megascale agent`` / ``megascale controller``
(``agent_args``, ``controller_args``: a test parses them with the real CLI; ``store_args`` their
etcd options); the etcd password comes from ``$MEGASCALE_ETCD_PASSWORD``. Their environment and
volumes (the resolved config, the etcd TLS Secret) are added to the main container of the user's
template, ours winning by name. ``faultTolerance`` reaches the training config as ``--set``
overrides (its ``fault_tolerance`` section, one mapping: ``fault_tolerance_settings``; checkpoint
interval and URL: ``training_overrides``), the operator resolves and validates it
(``resolve_training_config``), and ``/etc/megascale/job.json`` holds the whole policy
(``job_policy``; the controller reads its ``faultTolerance`` as its section's base). The objects themselves are built in ``megascale/k8s/builders.py``.
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megascale.k8s.job import (
    CONFIG_DIR,
    ETCD_TLS_DIR,
    MAIN_CONTAINER,
    METRICS_PORT,
    RUN_DIR,
    BuildError,
    Job,
    config_name,
    etcd_endpoints,
    metrics_container_port,
    worker_address,
    workers_service_name,
)

if TYPE_CHECKING:
    from megascale.config import JobConfig

# -- training config --------------------------------------------------------------------------


def resolve_training_config(toml_text: str, overrides: Sequence[str], world_size: int) -> str:
    """The fully resolved training config (``megascale.config``: defaults < TOML < overrides),
    validated for ``world_size`` ranks, as TOML. Raises ``ConfigError`` naming the field."""
    from megascale import config

    cfg = _load_text(toml_text, overrides)
    backend = "gloo" if cfg.train.device == "cpu" else "nccl"
    return config.to_toml(config.validate(cfg, world_size, backend))


def training_config_hash(resolved_toml: str) -> str:
    """The config hash every agent pod registers (``agent.identity.config_hash`` of the
    ConfigMap's ``config.toml``, which ``agent_args`` passes with no ``--set``), from the same
    text: what the controller compares registrations with (``controller_args``)."""
    from megascale.config import hash_of

    return hash_of(_load_text(resolved_toml))


def _load_text(toml_text: str, overrides: Sequence[str] = ()) -> JobConfig:
    """``config.load`` of ``toml_text`` as a file, with ``overrides``."""
    from megascale import config

    with tempfile.TemporaryDirectory(prefix="megascale-k8s-") as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(toml_text)
        return config.load(path, list(overrides))


FT_SETTINGS: dict[str, str] = {
    "maxRestarts": "max_restarts",
    "restartWindowSeconds": "restart_window_s",
    "policy": "policy",
    "nodeWaitTimeoutSeconds": "node_wait_timeout_s",
    "selfCheck.tests": "selfcheck_tests",
    "selfCheck.timeoutSeconds": "selfcheck_timeout_s",
    "straggler.threshold": "straggler_threshold",
    "straggler.action": "straggler_action",
}
"""``spec.faultTolerance`` field -> its key in the config's ``fault_tolerance`` section."""

FT_OTHER_READERS: dict[str, str] = {
    "heartbeatIntervalSeconds": "agent_args, controller_args: --heartbeat-interval",
    "spareNodes": "job.Job.spares: worker pods beyond replicas",
    "cordonEvictedNodes": "status.decide: cordon and label evicted nodes",
    "selfCheck.requirePassedNode": "builders: the workers' node affinity",
    "checkpoint.intervalSteps": "training_overrides: checkpoint.interval",
    "checkpoint.url": "training_overrides: checkpoint.url",
}
"""The other ``spec.faultTolerance`` fields and what reads them (a test keeps both tables
covering every field of the CRD)."""


def _get(spec: Mapping[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(spec, Mapping) or part not in spec:
            return None
        spec = spec[part]
    return spec


def fault_tolerance_settings(ft: Mapping[str, Any]) -> dict[str, Any]:
    """The config's ``fault_tolerance`` keys a (defaulted) ``spec.faultTolerance`` sets: the one
    mapping of the CRD onto that section, read by the training config (``training_overrides``)
    and by the controller (``controller_args``, and ``job.json`` through
    ``$MEGASCALE_JOB_SPEC``). Fields left out (``nodeWaitTimeoutSeconds``) are not set."""
    out: dict[str, Any] = {}
    for path, key in FT_SETTINGS.items():
        value = _get(ft, path)
        if value is None:
            continue
        if key.endswith("_s") or key == "straggler_threshold":
            value = float(value)
        out[key] = list(value) if isinstance(value, list) else value
    return out


def training_overrides(job: Job) -> list[str]:
    """``--set`` items for the training config: the ``fault_tolerance`` section and the
    checkpoints ``faultTolerance`` sets, then the spec's own ``config.overrides`` (which win)."""
    ft = job.spec["faultTolerance"]
    out = [
        f"fault_tolerance.{key}={json.dumps(value)}"
        for key, value in fault_tolerance_settings(ft).items()
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


# -- the megascale containers -----------------------------------------------------------------


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _megascale_env(job: Job) -> list[dict[str, Any]]:
    """Environment of the controller and agents: the pod's identity (for ``$(VAR)`` in their
    arguments), the etcd credentials, and where the job policy is."""
    env: list[dict[str, Any]] = [
        _field_env("MEGASCALE_POD_NAME", "metadata.name"),
        _field_env("MEGASCALE_NODE_NAME", "spec.nodeName"),
        _field_env("MEGASCALE_POD_IP", "status.podIP"),
        {"name": "MEGASCALE_JOB_SPEC", "value": f"{CONFIG_DIR}/job.json"},
    ]
    if job.etcd.get("authSecret"):
        for var, key in (("USERNAME", "username"), ("PASSWORD", "password")):
            ref = {"secretKeyRef": {"name": job.etcd["authSecret"], "key": key}}
            env.append({"name": f"MEGASCALE_ETCD_{var}", "valueFrom": ref})
    return env


def store_args(job: Job) -> list[str]:
    """The etcd options of ``megascale agent`` and ``megascale controller``
    (``process.add_store_arguments``); the password comes from
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
    out["ports"] = _merge_named(out.get("ports", []), [metrics_container_port()])
    return out


def metrics_args() -> list[str]:
    """``/metrics`` on the pod's IP at the declared, fixed port (``job.METRICS_PORT``)."""
    return ["--metrics-port", str(METRICS_PORT), "--metrics-addr", "$(MEGASCALE_POD_IP)"]


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
        *metrics_args(),
        *store_args(job),
    ]


TRAIN_FLAGS = {
    "global_batch_size": "--global-batch-size",
    "micro_batch_size": "--micro-batch-size",
    "steps": "--train-steps",
}
"""The controller's flags from the resolved ``[train]`` table (``controller_args``)."""


def controller_args(
    job: Job,
    tp: int = 1,
    pp: int = 1,
    train: Mapping[str, Any] | None = None,
    vpp: int = 1,
    config_hash: str | None = None,
) -> list[str]:
    """The controller's command line (``controller.command.add_arguments``). ``train``: the
    resolved training config's ``[train]`` table, whose batch sizes a shrink keeps and whose
    ``steps`` bound a heartbeat's step; ``config_hash``: the agents' (``training_config_hash``),
    so that an agent of another config is refused."""
    ft, train = job.spec["faultTolerance"], train or {}
    settings = fault_tolerance_settings(ft)
    batch = []
    for key, flag in TRAIN_FLAGS.items():
        if train.get(key) is not None:
            batch += [flag, str(int(train[key]))]
    if config_hash:
        batch += ["--config-hash", config_hash]
    wait = settings.get("node_wait_timeout_s")
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
        str(settings["max_restarts"]),
        "--restart-window",
        str(settings["restart_window_s"]),
        "--fault-policy",
        str(settings["policy"]),
        *(["--node-wait-timeout", str(wait)] if wait is not None else []),
        "--vpp",
        str(vpp),
        *batch,
        "--straggler-threshold",
        str(settings["straggler_threshold"]),
        "--straggler-action",
        str(settings["straggler_action"]),
        *metrics_args(),
        *store_args(job),
    ]
