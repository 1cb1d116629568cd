"""The Helm chart, without helm (not installable here): values.yaml against values.schema.json,
then every template rendered by ``gotemplate`` (a Go-template subset renderer that refuses what it
does not know) and every rendered manifest through ``kubernetes-validate --strict``; RBAC checked
to be least privilege and sufficient for what the operator does."""

from __future__ import annotations

import copy
import json

import jsonschema
import kubernetes_validate
import pytest
import yaml
from gotemplate import Files, TemplateError, parse, render_chart
from k8s_support import CHART, K8S_VERSION, example_jobs

from megascale.k8s import builders, crd
from megascale.k8s.builders import Job

VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def render(values=None, files=None) -> list[dict]:
    out = render_chart(CHART, values, files=files)
    return [doc for text in out.values() for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


# -- chart files and values -------------------------------------------------------------------


def test_chart_yaml():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "megascale-operator"
    assert chart["type"] == "application" and chart["version"] and chart["appVersion"]


def test_values_yaml_is_valid_against_its_schema():
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.validate(VALUES, SCHEMA)


@pytest.mark.parametrize(
    "path, value",
    [
        ("image.pullPolicy", "Sometimes"),
        ("operator.syncIntervalSeconds", 0),
        ("selfCheck.intervalSeconds", 5),
        ("installCRDs", "yes"),
        ("operator.watchNamespace", ["typo"]),  # unknown key
    ],
)
def test_bad_values_are_rejected(path, value):
    values = copy.deepcopy(VALUES)
    *parents, last = path.split(".")
    target = values
    for name in parents:
        target = target[name]
    target[last] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(values, SCHEMA)


def test_templates_without_templating_parse_as_yaml():
    plain = [p for p in (CHART / "templates").glob("*.yaml") if "{{" not in p.read_text()]
    for path in plain:
        assert list(yaml.safe_load_all(path.read_text()))
    # every other template is parsed by the renderer (no construct outside its subset)
    for path in (CHART / "templates").iterdir():
        parse(path.read_text())


def test_renderer_refuses_what_it_does_not_support():
    with pytest.raises(TemplateError, match="outside the supported subset"):
        parse("{{ with .Values.x }}{{ . }}{{ end }}")
    with pytest.raises(TemplateError, match="outside the supported subset"):
        render_chart_text("{{ .Values.x | b64enc }}")


def render_chart_text(text: str) -> str:
    from gotemplate import Renderer

    nodes, defines = parse(text)
    return Renderer(defines).render(nodes, {"Values": {"x": "a"}}, {})


# -- rendered manifests -----------------------------------------------------------------------


VARIANTS = {
    "defaults": {},
    "namespaced-no-crd": {
        "installCRDs": False,
        "operator": {"watchNamespaces": ["training", "research"]},
        "serviceAccount": {"create": False, "name": "ops"},
    },
    "everything-set": {
        "imagePullSecrets": [{"name": "regcred"}],
        "image": {"tag": "0.1.0-cuda"},
        "operator": {
            "priorityClassName": "system-cluster-critical",
            "nodeSelector": {"node-role": "infra"},
            "tolerations": [{"key": "infra", "operator": "Exists"}],
        },
        "selfCheck": {
            "args": ["--quick"],
            "runtimeClassName": "nvidia",
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
        },
        "dashboards": {"namespace": "monitoring"},
        "podMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    },
    "selfcheck-off": {"selfCheck": {"enabled": False}, "dashboards": {"enabled": False}},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_manifests_pass_kubernetes_validate_strict(variant):
    values = VARIANTS[variant]
    jsonschema.validate(_merged(values), SCHEMA)
    docs = render(values)
    assert docs
    for doc in docs:
        if doc["kind"] == "PodMonitor":  # the Prometheus operator's kind: test_pod_monitor_...
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")


def _merged(values):
    from gotemplate import _merge

    return _merge(copy.deepcopy(VALUES), values)


def test_default_render_contents():
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "DaemonSet",
        ]
        + (["ConfigMap"] if list((CHART / "dashboards").glob("*.json")) else [])
    )
    (the_crd,) = by_kind(docs, "CustomResourceDefinition")
    expected = crd.crd()
    expected["metadata"]["annotations"] = {"helm.sh/resource-policy": "keep"}
    assert the_crd == expected
    (deployment,) = by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]
    # the label the managed etcd's NetworkPolicy admits
    assert pod["metadata"]["labels"][builders.LABEL_NAME] == builders.OPERATOR_NAME
    args = pod["spec"]["containers"][0]["args"]
    assert args[:3] == ["megascale", "operator", "run"]
    assert not [a for a in args if a.startswith("--namespace")]  # all namespaces
    assert pod["spec"]["containers"][0]["image"] == "ghcr.io/example/megascale:0.1.0"


def _selects(selector: dict, labels: dict) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions with In) selects."""
    if not selector["matchLabels"].items() <= labels.items():
        return False
    return all(
        e["operator"] == "In" and labels.get(e["key"]) in e["values"]
        for e in selector.get("matchExpressions", [])
    )


@pytest.mark.parametrize("watch", [[], ["training"]])
def test_pod_monitor_scrapes_the_metrics_port_of_every_job_pod(watch):
    assert not by_kind(render(), "PodMonitor")  # off by default: the kind may not exist
    values = {"podMonitor": {"enabled": True, "labels": {"release": "prometheus"}}}
    values["operator"] = {"watchNamespaces": watch}
    jsonschema.validate(_merged(values), SCHEMA)
    (monitor,) = by_kind(render(values), "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": builders.METRICS_PORT_NAME, "path": "/metrics", "interval": "15s"}
    expected = {"matchNames": watch} if watch else {"any": True}
    assert monitor["spec"]["namespaceSelector"] == expected
    job = Job.from_body(example_jobs()["minimal-cpu"])
    worker = builders.worker_pod(job, 0)
    controller = builders.controller_deployment(job)["spec"]["template"]
    etcd = builders.etcd_statefulset(job)["spec"]["template"]
    selector = monitor["spec"]["selector"]
    for pod in (worker, controller):
        assert _selects(selector, pod["metadata"]["labels"])
        ports = [p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]
        assert endpoint["port"] in ports
    assert not _selects(selector, etcd["metadata"]["labels"])
    bad = _merged({"podMonitor": {"interval": "often"}})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA)


def test_watch_namespaces_and_no_crd():
    docs = render(VARIANTS["namespaced-no-crd"])
    assert not by_kind(docs, "CustomResourceDefinition")
    (deployment,) = by_kind(docs, "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "ops"
    assert spec["containers"][0]["args"][-2:] == ["--namespace=training", "--namespace=research"]
    operator_accounts = [
        d for d in by_kind(docs, "ServiceAccount") if "selfcheck" not in d["metadata"]["name"]
    ]
    assert operator_accounts == []


def test_selfcheck_daemonset_labels_its_node():
    docs = render(VARIANTS["everything-set"])
    (ds,) = by_kind(docs, "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["args"] == [
        "megascale",
        "operator",
        "selfcheck-label",
        "--node=$(NODE_NAME)",
        "--interval=3600",
        "--timeout=600",
        "--",
        "megascale",
        "selfcheck",
        "--json",
        "--quick",
    ]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    role = next(d for d in by_kind(docs, "ClusterRole") if "selfcheck" in d["metadata"]["name"])
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},  # workers on its node
    ]
    assert not by_kind(render(VARIANTS["selfcheck-off"]), "DaemonSet")


def test_dashboards_config_map_includes_the_json_files_present():
    files = Files(
        CHART, {"dashboards/a.json": '{"title": "A"}', "dashboards/b.json": "{}", "x": ""}
    )
    docs = render({"dashboards": {"namespace": "monitoring"}}, files=files)
    (cm,) = by_kind(docs, "ConfigMap")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert {k: json.loads(v) for k, v in cm["data"].items()} == {
        "a.json": {"title": "A"},
        "b.json": {},
    }
    assert not by_kind(render(files=Files(CHART, {})), "ConfigMap")  # none present: no ConfigMap
    assert not by_kind(render({"dashboards": {"enabled": False}}, files=files), "ConfigMap")


def test_dashboards_from_the_repository_when_exported():
    exported = sorted((CHART / "dashboards").glob("*.json"))
    docs = render()
    if not exported:
        assert not by_kind(docs, "ConfigMap")
        return
    (cm,) = by_kind(docs, "ConfigMap")
    assert sorted(cm["data"]) == [p.name for p in exported]
    for path in exported:
        assert json.loads(cm["data"][path.name]) == json.loads(path.read_text())


# -- RBAC -------------------------------------------------------------------------------------

PLURALS = {
    "Service": "services",
    "ConfigMap": "configmaps",
    "ServiceAccount": "serviceaccounts",
    "StatefulSet": "statefulsets",
    "Deployment": "deployments",
    "NetworkPolicy": "networkpolicies",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "PodGroup": "podgroups",
    "Pod": "pods",
}


def grants(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def operator_role() -> dict:
    return next(
        d for d in by_kind(render(), "ClusterRole") if "selfcheck" not in d["metadata"]["name"]
    )


def test_operator_rbac_has_no_wildcards():
    for rule in operator_role()["rules"]:
        assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"]


def test_operator_rbac_covers_everything_the_operator_does():
    granted = grants(operator_role()["rules"])
    needed = set()
    for stem_job in _all_variant_jobs():
        for obj in builders.managed_objects(stem_job, ""):
            group = obj["apiVersion"].rpartition("/")[0]
            for verb in ("get", "create", "patch"):  # server-side apply
                needed.add((group, PLURALS[obj["kind"]], verb))
    needed |= {
        ("", "pods", "create"),  # pods are created and deleted, never patched
        ("", "pods", "list"),
        ("", "pods", "delete"),
        ("", "nodes", "patch"),
        ("", "secrets", "get"),
        ("", "configmaps", "get"),
        ("megascale.io", "megascalejobs", "watch"),
        ("megascale.io", "megascalejobs", "delete"),
        ("megascale.io", "megascalejobs/status", "patch"),
    }
    assert needed - granted == set()


def test_operator_holds_every_permission_it_grants_the_controller():
    """RBAC refuses to let a subject create a Role with permissions it does not hold."""
    granted = grants(operator_role()["rules"])
    job = _all_variant_jobs()[0]
    _, role, _ = builders.controller_rbac(job)
    assert grants(role["rules"]) - granted == set()


def test_operator_rbac_has_nothing_unused():
    """Every (resource, verb) granted is used by the operator or needed by kopf."""
    used_resources = set(PLURALS.values()) | {
        "nodes",
        "secrets",
        "events",
        "namespaces",
        "customresourcedefinitions",
        "megascalejobs",
        "megascalejobs/status",
    }
    for _, resource, verb in grants(operator_role()["rules"]):
        assert resource in used_resources
        assert verb in ("get", "list", "watch", "create", "patch", "delete")
        if verb == "delete":
            assert resource in ("pods", "megascalejobs")  # the rest goes by owner reference


def _all_variant_jobs() -> list[Job]:
    from k8s_support import example_jobs

    return [Job.from_body(b) for b in example_jobs().values()]


CLUSTER_SCOPED = {"customresourcedefinitions", "namespaces", "nodes"}


def _operator_rbac(values) -> tuple[dict, list[dict], list[dict]]:
    docs = render(values)
    (cluster_role,) = [
        d for d in by_kind(docs, "ClusterRole") if "selfcheck" not in d["metadata"]["name"]
    ]
    return cluster_role, by_kind(docs, "Role"), by_kind(docs, "RoleBinding")


def test_watched_namespaces_get_roles_and_the_cluster_role_only_cluster_scoped_rules():
    values = {"operator": {"watchNamespaces": ["training", "research"]}}
    cluster_role, roles, bindings = _operator_rbac(values)
    # What no Role can grant stays cluster-wide: the CRD watch, namespaces, nodes.
    assert {r for _, r, _ in grants(cluster_role["rules"])} == CLUSTER_SCOPED
    assert ("", "secrets", "get") not in grants(cluster_role["rules"])
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["research", "training"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["research", "training"]
    everything = grants(operator_role()["rules"])  # the all-namespaces ClusterRole
    for role in roles:
        assert grants(role["rules"]) == {g for g in everything if g[1] not in CLUSTER_SCOPED}
    for binding in bindings:
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": roles[0]["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {
                "kind": "ServiceAccount",
                "name": "megascale-megascale-operator",
                "namespace": "megascale-system",
            }
        ]


def test_scoping_to_namespaces_keeps_every_permission_the_operator_needs():
    """Namespaced: the ClusterRole plus one Role grant exactly what the all-namespaces
    ClusterRole grants, so nothing the operator does in a watched namespace is lost."""
    cluster_role, roles, _ = _operator_rbac({"operator": {"watchNamespaces": ["training"]}})
    assert grants(cluster_role["rules"]) | grants(roles[0]["rules"]) == grants(
        operator_role()["rules"]
    )


def test_all_namespaces_needs_no_role():
    cluster_role, roles, bindings = _operator_rbac(None)
    assert roles == [] and bindings == []
    assert CLUSTER_SCOPED < {r for _, r, _ in grants(cluster_role["rules"])}
