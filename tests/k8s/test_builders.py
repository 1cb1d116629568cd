"""Every builder, without a cluster: names, labels, owner references, the agent and controller
command lines, etcd wiring, worker identity and affinity, gang scheduling, suspend, config."""

from __future__ import annotations

import argparse
import copy
import json
import tomllib

import pytest
from k8s_support import example_config, example_jobs

from megascale.config import ConfigError
from megascale.k8s import builders, crd
from megascale.k8s.builders import BuildError, Job


def job_of(stem: str, change=None) -> Job:
    body = copy.deepcopy(example_jobs()[stem])
    if change is not None:
        change(body)
    return Job.from_body(body)


def resolved(stem: str) -> str:
    job = job_of(stem)
    return builders.resolve_training_config(
        example_config(stem), builders.training_overrides(job), job.replicas * job.nproc
    )


def all_objects(stem: str, change=None) -> list[dict]:
    job = job_of(stem, change)
    return builders.managed_objects(job, resolved(stem)) + builders.worker_pods(job)


def container(pod: dict, name: str = "megascale") -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == name)


def env(c: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


# -- shared helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize("stem", sorted(example_jobs()))
def test_every_object_is_owned_by_the_job_and_labelled(stem):
    job = job_of(stem)
    for obj in all_objects(stem):
        meta = obj["metadata"]
        assert meta["namespace"] == job.namespace
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "megascale.io/v1alpha1",
                "kind": "MegaScaleJob",
                "name": job.name,
                "uid": job.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], "deleting the job must delete it (garbage collection by owner reference)"
        assert meta["labels"][builders.LABEL_JOB] == job.name
        assert meta["labels"][builders.LABEL_MANAGED_BY] == "megascale-operator"
        assert len(meta["name"]) <= 63


def test_user_labels_cannot_override_the_job_labels():
    job = job_of("minimal-cpu")
    meta = builders.metadata(
        job, "x", "worker", extra_labels={builders.LABEL_JOB: "other", "team": "a"}
    )
    assert meta["labels"][builders.LABEL_JOB] == "tiny"
    assert meta["labels"]["team"] == "a"


def test_job_identity_and_defaults():
    job = job_of("gpu-volcano")
    assert (job.name, job.namespace, job.id) == ("gpt-7b", "training", "training.gpt-7b")
    assert (job.replicas, job.spares, job.pods, job.nproc) == (4, 1, 5, 8)
    assert job.gang == "volcano" and not job.suspended


# -- etcd -------------------------------------------------------------------------------------


def test_managed_etcd_statefulset_service_and_endpoints():
    job = job_of("gpu-volcano")
    endpoints = builders.etcd_endpoints(job)
    assert endpoints == [f"http://gpt-7b-etcd-{i}.gpt-7b-etcd.training.svc:2379" for i in range(3)]
    sts = builders.etcd_statefulset(job)
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["serviceName"] == "gpt-7b-etcd"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert (
        "--initial-cluster=gpt-7b-etcd-0=http://gpt-7b-etcd-0.gpt-7b-etcd.training.svc:2380,"
        "gpt-7b-etcd-1=http://gpt-7b-etcd-1.gpt-7b-etcd.training.svc:2380,"
        "gpt-7b-etcd-2=http://gpt-7b-etcd-2.gpt-7b-etcd.training.svc:2380" in args
    )
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert "volumes" not in sts["spec"]["template"]["spec"]
    svc = builders.etcd_service(job)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    assert sts["spec"]["template"]["metadata"]["labels"].items() >= svc["spec"]["selector"].items()


def test_managed_etcd_without_storage_uses_an_emptydir():
    sts = builders.etcd_statefulset(job_of("minimal-cpu"))
    assert "volumeClaimTemplates" not in sts["spec"]
    assert sts["spec"]["template"]["spec"]["volumes"] == [{"name": "data", "emptyDir": {}}]


def test_etcd_network_policy_admits_the_job_and_the_operator_only():
    policy = builders.etcd_network_policy(job_of("minimal-cpu"))
    client, peer = policy["spec"]["ingress"]
    assert client["ports"] == [{"port": 2379}] and peer["ports"] == [{"port": 2380}]
    assert {"podSelector": {"matchLabels": {builders.LABEL_JOB: "tiny"}}} in client["from"]
    assert any(
        f.get("podSelector", {}).get("matchLabels") == {builders.LABEL_NAME: "megascale-operator"}
        for f in client["from"]
    )


def test_external_etcd_tls_and_credentials_reach_the_containers():
    job = job_of("external-etcd")
    kinds = [o["kind"] for o in builders.managed_objects(job, resolved("external-etcd"))]
    assert "StatefulSet" not in kinds and "NetworkPolicy" not in kinds
    assert builders.etcd_endpoints(job)[0] == "https://etcd-0.etcd.infra.svc:2379"
    pod = builders.worker_pod(job, 0)
    values = env(container(pod))
    # the password where controller.service reads it; the user through --user $(...)
    assert values["MEGASCALE_ETCD_PASSWORD"] == {
        "secretKeyRef": {"name": "etcd-auth", "key": "password"}
    }
    assert values["MEGASCALE_ETCD_USERNAME"] == {
        "secretKeyRef": {"name": "etcd-auth", "key": "username"}
    }
    tls = [
        "--endpoints",
        ",".join(builders.etcd_endpoints(job)),
        "--ca-file",
        "/etc/megascale/etcd-tls/ca.crt",
        "--cert-file",
        "/etc/megascale/etcd-tls/tls.crt",
        "--key-file",
        "/etc/megascale/etcd-tls/tls.key",
        "--user",
        "$(MEGASCALE_ETCD_USERNAME)",
    ]
    assert container(pod)["args"][-len(tls) :] == tls
    dep = builders.controller_deployment(job)
    assert dep["spec"]["template"]["spec"]["containers"][0]["args"][-len(tls) :] == tls
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["etcd-tls"]["secret"]["secretName"] == "etcd-tls"
    mounts = {m["name"]: m["mountPath"] for m in container(pod)["volumeMounts"]}
    assert mounts["etcd-tls"] == "/etc/megascale/etcd-tls"


# -- config -----------------------------------------------------------------------------------


def test_config_map_holds_the_resolved_config_and_the_policy():
    job = job_of("gpu-volcano")
    cm = builders.config_map(job, resolved("gpu-volcano"))
    assert cm["metadata"]["name"] == "gpt-7b-resolved-config"
    toml = cm["data"]["config.toml"]
    assert "lr = 0.0002" in toml  # the override won over the file
    # faultTolerance flows into the training config
    assert 'url = "s3://checkpoints/gpt-7b"' in toml and "interval = 200" in toml
    assert "straggler_threshold = 1.15" in toml and 'straggler_action = "evict"' in toml
    assert "dp = 2" in toml  # resolved for 4 nodes x 8 ranks with tp 8, pp 2
    policy = json.loads(cm["data"]["job.json"])
    assert policy["nodes"] == 4 and policy["spares"] == 1 and policy["nprocPerNode"] == 8
    assert policy["faultTolerance"]["straggler"] == {"threshold": 1.15, "action": "evict"}
    assert policy["etcdEndpoints"] == builders.etcd_endpoints(job)


def test_invalid_training_config_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="parallel.tp"):
        builders.resolve_training_config("[parallel]\ntp = 3\n", [], 8)
    with pytest.raises(ConfigError, match="did you mean"):
        builders.resolve_training_config("[trian]\nsteps = 1\n", [], 1)


# -- controller and RBAC ----------------------------------------------------------------------


def test_controller_deployment_runs_the_controller_with_the_worker_image():
    job = job_of("gpu-volcano")
    dep = builders.controller_deployment(job)
    spec = dep["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert c["image"] == "ghcr.io/example/megascale:0.1.0-cuda"
    assert c["args"] == [
        "megascale",
        "controller",
        "--job",
        "training.gpt-7b",
        "--run-dir",
        builders.RUN_DIR,
        "--nodes",
        "4",
        "--nproc-per-node",
        "8",
        "--tp",
        "1",
        "--pp",
        "1",
        "--heartbeat-interval",
        "1",
        "--max-restarts",
        "10",
        "--restart-window",
        "3600.0",
        "--fault-policy",
        "shrink",
        "--vpp",
        "1",
        "--straggler-threshold",
        "1.15",
        "--straggler-action",
        "evict",
        "--metrics-port",
        "9400",
        "--metrics-addr",
        "$(MEGASCALE_POD_IP)",
        "--endpoints",
        ",".join(builders.etcd_endpoints(job)),
    ]
    # through managed_objects, tp and pp come from the resolved training config
    (dep,) = [o for o in all_objects("gpu-volcano") if o["kind"] == "Deployment"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--tp") + 1] == "8" and args[args.index("--pp") + 1] == "2"
    assert spec["serviceAccountName"] == "gpt-7b-controller"
    assert spec["priorityClassName"] == "high-priority"
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    assert env(c)["MEGASCALE_JOB_SPEC"] == "/etc/megascale/job.json"


def test_controller_rbac_is_least_privilege():
    sa, role, binding = builders.controller_rbac(job_of("minimal-cpu"))
    assert (sa["kind"], role["kind"], binding["kind"]) == (
        "ServiceAccount",
        "Role",
        "RoleBinding",
    )
    verbs = {(r["resources"][0], v) for r in role["rules"] for v in r["verbs"]}
    assert verbs == {
        ("pods", "get"),
        ("pods", "list"),
        ("pods", "watch"),
        ("events", "create"),
        ("events", "patch"),
    }
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "tiny-controller", "namespace": "default"}
    ]
    worker_sa = builders.worker_service_account(job_of("minimal-cpu"))
    assert worker_sa["automountServiceAccountToken"] is False


# -- workers ----------------------------------------------------------------------------------


def test_worker_pod_runs_the_agent_with_a_stable_identity():
    job = job_of("gpu-volcano")
    pod = builders.worker_pod(job, 3)
    spec = pod["spec"]
    assert pod["metadata"]["name"] == "gpt-7b-worker-3"
    assert spec["hostname"] == "gpt-7b-worker-3" and spec["subdomain"] == "gpt-7b-workers"
    assert pod["metadata"]["labels"][builders.LABEL_INDEX] == "3"
    assert pod["metadata"]["labels"]["team"] == "pretraining"  # the template's labels kept
    c = container(pod)
    assert c["args"] == [
        "megascale",
        "agent",
        "/etc/megascale/config.toml",
        "--job",
        "training.gpt-7b",
        "--node",
        "$(MEGASCALE_NODE_NAME)",
        "--nproc-per-node",
        "8",
        "--run-dir",
        builders.RUN_DIR,
        "--heartbeat-interval",
        "1",
        "--addr",
        "gpt-7b-worker-3.gpt-7b-workers.training.svc",
        "--metrics-port",
        "9400",
        "--metrics-addr",
        "$(MEGASCALE_POD_IP)",
        "--endpoints",
        ",".join(builders.etcd_endpoints(job)),
    ]
    assert env(c)["MEGASCALE_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8  # the template's resources kept
    mounts = [m["name"] for m in c["volumeMounts"]]
    assert mounts == ["dshm", "megascale-config", "run"]
    assert [v["name"] for v in spec["volumes"]] == ["dshm", "megascale-config", "run"]
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec["restartPolicy"] == "OnFailure"
    assert spec["automountServiceAccountToken"] is False


def test_agents_and_controller_are_scrapeable_on_the_pod_address():
    """A fixed, named /metrics port on the pod's IP, declared on the container, with the common
    prometheus.io annotations on the pod; the agent and controller CLIs accept those flags."""
    from megascale.agent.service import add_arguments as agent_arguments
    from megascale.controller.command import add_arguments as controller_arguments

    job = job_of("gpu-volcano")
    worker = builders.worker_pod(job, 0)
    dep = builders.controller_deployment(job)
    template = dep["spec"]["template"]
    for meta, c, add in (
        (worker["metadata"], container(worker), agent_arguments),
        (template["metadata"], template["spec"]["containers"][0], controller_arguments),
    ):
        port = {"name": "metrics", "containerPort": 9400, "protocol": "TCP"}
        assert port in c["ports"], c["ports"]
        assert meta["annotations"]["prometheus.io/scrape"] == "true"
        assert meta["annotations"]["prometheus.io/port"] == "9400"
        assert meta["annotations"]["prometheus.io/path"] == "/metrics"
        assert env(c)["MEGASCALE_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        parser = argparse.ArgumentParser()
        add(parser)
        known, _ = parser.parse_known_args(c["args"][2:])
        assert (known.metrics_port, known.metrics_addr) == (9400, "$(MEGASCALE_POD_IP)")
    assert container(worker)["ports"].count(port) == 1  # merged by name, never twice
    local = argparse.ArgumentParser()
    controller_arguments(local)
    assert local.get_default("metrics_addr") == "127.0.0.1"  # the local cluster: loopback


def test_headless_service_selects_the_worker_pods():
    job = job_of("minimal-cpu")
    svc = builders.workers_service(job)
    pod = builders.worker_pod(job, 0)
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["metadata"]["name"] == pod["spec"]["subdomain"]
    assert pod["metadata"]["labels"].items() >= svc["spec"]["selector"].items()


def test_worker_affinity_one_per_node_and_off_evicted_and_failed_nodes():
    job = job_of("minimal-cpu")
    pod = builders.worker_pod(job, 1, excluded=["node-b", "node-a", "node-b"])
    affinity = pod["spec"]["affinity"]
    (term,) = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchFields"] == [
        {"key": "metadata.name", "operator": "NotIn", "values": ["node-a", "node-b"]}
    ]
    assert term["matchExpressions"] == [
        {"key": "megascale.io/selfcheck", "operator": "NotIn", "values": ["failed"]}
    ]
    (anti,) = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"] == builders.selector_labels(job, "worker")
    assert pod["metadata"]["annotations"][builders.ANNOTATION_EXCLUDED] == "node-a,node-b"
    fresh = builders.worker_pod(job, 1)
    (term,) = fresh["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert "matchFields" not in term  # NotIn with no values is invalid


def test_worker_affinity_is_added_to_every_user_term_and_can_require_passed_nodes():
    def change(body):
        body["spec"]["faultTolerance"] = {"selfCheck": {"requirePassedNode": True}}
        body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                    ]
                }
            }
        }

    job = job_of("minimal-cpu", change)
    pod = builders.worker_pod(job, 0, excluded=["bad"])
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert len(terms) == 2
    for term in terms:
        assert term["matchExpressions"][1] == {
            "key": "megascale.io/selfcheck",
            "operator": "In",
            "values": ["passed"],
        }
        assert term["matchFields"][0]["values"] == ["bad"]
    # the job's template is not modified by building a pod
    template = job.template["spec"]["affinity"]["nodeAffinity"]
    assert (
        len(
            template["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
                "matchExpressions"
            ]
        )
        == 1
    )


def test_worker_pods_are_replicas_plus_spares():
    job = job_of("gpu-volcano")
    names = [p["metadata"]["name"] for p in builders.worker_pods(job)]
    assert names == [f"gpt-7b-worker-{i}" for i in range(5)]
    with pytest.raises(BuildError, match=r"worker index = 5: must be in \[0, 5\)"):
        builders.worker_pod(job, 5)


def test_template_without_containers_is_refused():
    def change(body):
        body["spec"]["replicaSpecs"]["Worker"]["template"] = {"spec": {"containers": []}}

    with pytest.raises(BuildError, match="containers is empty"):
        builders.worker_pod(job_of("minimal-cpu", change), 0)


def test_main_container_is_the_one_named_megascale():
    def change(body):
        spec = body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]
        spec["containers"].insert(0, {"name": "sidecar", "image": "busybox"})

    pod = builders.worker_pod(job_of("minimal-cpu", change), 0)
    sidecar, main = pod["spec"]["containers"]
    assert "args" not in sidecar and main["args"][1] == "agent"


# -- gang scheduling --------------------------------------------------------------------------


def test_volcano_pod_group_and_pod_membership():
    job = job_of("gpu-volcano")
    group = builders.pod_group(job)
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert group["spec"] == {
        "minMember": 4,
        "queue": "pretraining",
        "priorityClassName": "high-priority",
    }
    pod = builders.worker_pod(job, 0)
    assert pod["spec"]["schedulerName"] == "volcano"
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "gpt-7b"


def test_coscheduling_pod_group_and_pod_membership():
    job = job_of("external-etcd")
    group = builders.pod_group(job)
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 600}
    pod = builders.worker_pod(job, 1)
    assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "ablation-swiglu"


def test_no_gang_means_no_pod_group_and_the_default_scheduler():
    job = job_of("minimal-cpu")
    assert builders.pod_group(job) is None
    assert "schedulerName" not in builders.worker_pod(job, 0)["spec"]


# -- the whole set, updates -------------------------------------------------------------------


def test_managed_objects_order_and_kinds():
    kinds = [o["kind"] for o in builders.managed_objects(job_of("gpu-volcano"), "")]
    assert kinds == [
        "Service",
        "StatefulSet",
        "NetworkPolicy",
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ServiceAccount",
        "Service",
        "PodGroup",
        "Deployment",
    ]
    names = [(o["kind"], o["metadata"]["name"]) for o in all_objects("gpu-volcano")]
    assert len(names) == len(set(names))


def test_builders_are_pure_and_deterministic():
    body = example_jobs()["gpu-volcano"]
    before = copy.deepcopy(body)
    first = all_objects("gpu-volcano")
    assert all_objects("gpu-volcano") == first
    assert body == before


def test_suspend_scales_the_controller_to_zero_and_keeps_the_rest():
    def suspend(body):
        body["spec"]["runPolicy"]["suspend"] = True

    running = builders.managed_objects(job_of("gpu-volcano"), "")
    suspended = builders.managed_objects(job_of("gpu-volcano", suspend), "")
    assert [o["kind"] for o in suspended] == [o["kind"] for o in running]
    dep = next(o for o in suspended if o["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 0


def test_update_changes_only_what_the_spec_changed():
    def more_spares(body):
        body["spec"]["faultTolerance"]["spareNodes"] = 2

    before = {(o["kind"], o["metadata"]["name"]): o for o in all_objects("gpu-volcano")}
    after = {(o["kind"], o["metadata"]["name"]): o for o in all_objects("gpu-volcano", more_spares)}
    added = set(after) - set(before)
    changed = {k for k in before if k in after and before[k] != after[k]}
    assert added == {("Pod", "gpt-7b-worker-5")}
    assert changed == {("ConfigMap", "gpt-7b-resolved-config")}  # job.json carries the spare count


def test_node_patches():
    job = job_of("minimal-cpu")
    patch = builders.evicted_node_patch(job, "selfcheck failed: gpu")
    assert patch["spec"] == {"unschedulable": True}
    assert patch["metadata"]["labels"] == {"megascale.io/evicted": "tiny"}
    assert patch["metadata"]["annotations"]["megascale.io/evicted-reason"] == (
        "default.tiny: selfcheck failed: gpu"
    )
    passed = builders.selfcheck_node_patch(True, "2025-01-01T00:00:00Z", "9 of 9 ok")
    assert passed["metadata"]["labels"] == {"megascale.io/selfcheck": "passed"}
    failed = builders.selfcheck_node_patch(False, "2025-01-01T00:00:00Z", "x" * 5000)
    assert failed["metadata"]["labels"] == {"megascale.io/selfcheck": "failed"}
    assert len(failed["metadata"]["annotations"]["megascale.io/selfcheck-summary"]) == 1024


def test_custom_kinds_are_declared_for_the_client():
    kinds = {(g, k) for g, _, k, _ in builders.CUSTOM_KINDS}
    assert (crd.GROUP, crd.KIND) in kinds
    assert ("scheduling.volcano.sh", "PodGroup") in kinds


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """What the kubelet does to ``$(VAR)`` in container arguments."""
    out = []
    for arg in args:
        for name, value in env.items():
            arg = arg.replace(f"$({name})", value)
        out.append(arg)
    return out


@pytest.mark.parametrize("stem", sorted(example_jobs()))
def test_generated_command_lines_parse_with_the_real_cli(stem):
    """The agent's and the controller's arguments are accepted by ``megascale``'s own parser."""
    from megascale.cli import build_parser

    parser = build_parser()
    job = job_of(stem)
    env = {"MEGASCALE_NODE_NAME": "node-1", "MEGASCALE_ETCD_USERNAME": "megascale"}
    objects = all_objects(stem)
    pod = next(o for o in objects if o["kind"] == "Pod")
    agent = parser.parse_args(_expand(container(pod)["args"], env)[1:])
    assert (agent.command, agent.job, agent.node) == ("agent", job.id, "node-1")
    assert agent.config == "/etc/megascale/config.toml"
    assert agent.nproc_per_node == job.nproc
    assert agent.endpoints == ",".join(builders.etcd_endpoints(job))
    dep = next(o for o in objects if o["kind"] == "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    controller = parser.parse_args(_expand(args, env)[1:])
    assert (controller.command, controller.job, controller.nodes) == (
        "controller",
        job.id,
        job.replicas,
    )
    ft = job.spec["faultTolerance"]
    assert controller.max_restarts == ft["maxRestarts"]
    assert controller.restart_window == ft["restartWindowSeconds"]
    assert controller.fault_policy == ft["policy"]
    train = tomllib.loads(resolved(stem))["train"]
    assert controller.global_batch_size == train["global_batch_size"]
    assert controller.micro_batch_size == train["micro_batch_size"]
    if job.etcd.get("authSecret"):
        assert agent.user == controller.user == "megascale"
