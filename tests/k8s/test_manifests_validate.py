"""Every manifest the operator generates, for every example resource and a few variants, passes
``kubernetes-validate --strict`` (offline OpenAPI schemas of Kubernetes 1.32: unknown fields are
errors). Kinds the validator has no schema for are skipped explicitly, with the reason:

* ``PodGroup`` (scheduling.volcano.sh/v1beta1, scheduling.x-k8s.io/v1alpha1): a CRD of Volcano /
  scheduler-plugins, not part of Kubernetes; its spec fields are asserted in test_builders.
* ``MegaScaleJob``: our CRD; validated against its own schema (jsonschema + CEL) in test_crd.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml
from k8s_support import EXAMPLES, K8S_VERSION, example_config, example_jobs, load_docs

from megascale.k8s import builders
from megascale.k8s.builders import Job

CUSTOM_KINDS = {
    ("scheduling.volcano.sh/v1beta1", "PodGroup"): "Volcano's CRD, not in Kubernetes' schemas",
    ("scheduling.x-k8s.io/v1alpha1", "PodGroup"): "scheduler-plugins' CRD, not in Kubernetes",
    ("megascale.io/v1alpha1", "MegaScaleJob"): "our CRD: validated against its schema in test_crd",
}


def _suspended(body):
    body["spec"]["runPolicy"] = {"suspend": True}


def _no_gang_many_spares(body):
    body["spec"]["runPolicy"] = {"scheduling": {"gang": "none"}}
    body["spec"]["faultTolerance"]["spareNodes"] = 4


VARIANTS = {
    "as-is": None,
    "suspended": _suspended,
    "no-gang-spares": _no_gang_many_spares,
}


def manifests(stem: str, variant: str) -> list[dict]:
    body = copy.deepcopy(example_jobs()[stem])
    if VARIANTS[variant] is not None:
        body["spec"].setdefault("faultTolerance", {})
        VARIANTS[variant](body)
    job = Job.from_body(body)
    toml = builders.resolve_training_config(
        example_config(stem), builders.training_overrides(job), job.replicas * job.nproc
    )
    pods = [builders.worker_pod(job, i, excluded=["node-7"] if i else []) for i in range(job.pods)]
    return builders.managed_objects(job, toml) + pods


def validate(obj: dict) -> str:
    """'passed' or 'skipped: <reason>'; raises on a validation error."""
    reason = CUSTOM_KINDS.get((obj["apiVersion"], obj["kind"]))
    if reason is not None:
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        return f"skipped: {reason}"
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return "passed"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("stem", sorted(example_jobs()))
def test_generated_manifests_pass_kubernetes_validate_strict(stem, variant):
    results = {}
    for obj in manifests(stem, variant):
        try:
            results[obj["kind"], obj["metadata"]["name"]] = validate(obj)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {e.message} at {list(e.path)}")
    skipped = {k for k, v in results.items() if v.startswith("skipped")}
    assert {kind for kind, _ in skipped} <= {"PodGroup"}
    assert sum(1 for k in results if k[0] == "Pod") >= 2


def test_the_validator_catches_a_broken_manifest():
    """Strict mode really rejects an unknown field and a wrong type (the test above can fail)."""
    pod = manifests("minimal-cpu", "as-is")[-1]
    bad = copy.deepcopy(pod)
    bad["spec"]["hostnme"] = "typo"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = copy.deepcopy(pod)
    bad["spec"]["containers"][0]["args"] = "megascale agent"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_example_files_other_kinds_validate():
    """The ConfigMap and Secret that come with the examples."""
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in load_docs(path):
            assert validate(doc) in (
                "passed",
                f"skipped: {CUSTOM_KINDS.get(('megascale.io/v1alpha1', 'MegaScaleJob'))}",
            )


def test_kubernetes_validate_cli_strict_on_written_files(tmp_path):
    """The command line tool itself, on one YAML stream per example (warnings for the custom
    kinds, exit 0)."""
    files = []
    for stem in sorted(example_jobs()):
        path = tmp_path / f"{stem}.yaml"
        path.write_text(yaml.safe_dump_all(manifests(stem, "as-is"), sort_keys=False))
        files.append(str(path))
    done = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_VERSION, *files],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ERROR" not in done.stdout
    assert done.stdout.count("passed") >= 20
    for line in done.stdout.splitlines():
        if line.startswith("WARN"):
            assert "podgroup" in line.lower(), line
