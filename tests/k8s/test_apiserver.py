"""The CRD against the real Kubernetes API server (``k8s.io/apiextensions-apiserver`` on a real
etcd, see ``real_apiserver.py``), not an emulation of it:

* the CRD file and the Helm chart's copy are accepted and become Established (the server checks
  each object's CEL rules on its raw default, so ``default: {}`` is refused: shown here too);
* every example job passes a strict server-side dry run (``fieldValidation=Strict``, which refuses
  unknown fields where the default only warns);
* every bad job of test_crd is refused, with the rule's (or the schema's) own words;
* the server's defaults equal ``validation.apply_defaults``;
* transition rules refuse changes of immutable fields on update, and allow the rest;
* the operator: its reconcile handler writes why a job cannot proceed into ``.status`` (through
  the status subresource), and the real operator (kopf) does so for a job it sees; a job deleted
  while the operator is down waits for the operator's finalizer. The server has no core/v1, so
  every child the operator makes is refused: exactly the "children refused" case.

Skipped, in one line, where the server binary could not be built (``make test`` builds it once:
tests/k8s/apiserver/build.sh).
"""

from __future__ import annotations

import asyncio
import copy
import re
import threading
import time
import uuid

import pytest
import yaml
from k8s_support import example_jobs
from real_apiserver import APIServer, established, find_binary, server_message
from test_crd import BAD, _changed, _set

from megascale.k8s import builders, crd, operator, validation

CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
NS = "default"
JOBS = f"/apis/{crd.API_VERSION}/namespaces/{NS}/{crd.PLURAL}"

BINARY, WHY_NOT = find_binary()
if BINARY is None:
    pytest.skip(f"no real API server: {WHY_NOT}", allow_module_level=True)


@pytest.fixture(scope="module")
def binary():
    return BINARY


@pytest.fixture(scope="module")
def server(binary, etcd):
    with APIServer(binary, etcd.client_url) as api:
        _establish(api, yaml.safe_load(crd.CRD_FILE.read_text()))
        yield api


def _establish(api: APIServer, the_crd: dict) -> dict:
    code, body = api.request("POST", CRDS, the_crd)
    assert code == 201, body
    return api.wait_for(f"{CRDS}/{the_crd['metadata']['name']}", established)


def _helm_crd() -> dict:
    text = crd.HELM_CRD_FILE.read_text()
    return yaml.safe_load(re.sub(r"(?m)^\{\{.*\}\}\n", "", text))


def _job(body: dict, name: str | None = None) -> dict:
    body = copy.deepcopy(body)
    body["metadata"].pop("uid", None)
    body["metadata"]["namespace"] = NS
    if name:
        body["metadata"]["name"] = name
    return body


def _dry_run(api: APIServer, body: dict) -> tuple[int, dict]:
    return api.request("POST", JOBS, body, dryRun="All", fieldValidation="Strict")


def test_the_crd_file_is_established(server):
    code, got = server.request("GET", f"{CRDS}/{crd.CRD_NAME}")
    assert code == 200 and established(got)
    assert got["spec"]["versions"][0]["schema"] == crd.crd()["spec"]["versions"][0]["schema"]


def test_the_helm_charts_crd_is_established(binary, etcd):
    helm = _helm_crd()
    assert helm["spec"] == crd.crd()["spec"]
    with APIServer(binary, etcd.client_url) as api:  # a fresh server: its own etcd prefix
        _establish(api, helm)


def test_a_crd_with_an_empty_default_that_a_rule_reads_is_refused(server):
    """Why every object's default is spelled out (test_crd checks them offline)."""
    bad = crd.crd()
    bad["metadata"]["name"] = f"{crd.PLURAL}.refused.{crd.GROUP}"
    bad["spec"]["group"] = f"refused.{crd.GROUP}"
    schema = bad["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema["properties"]["spec"]["properties"]["etcd"]["default"] = {}
    code, body = server.request("POST", CRDS, bad, dryRun="All")
    assert code == 422, body
    assert "no such key: managed" in body["message"], body["message"]


@pytest.mark.parametrize("stem", sorted(example_jobs()))
def test_examples_pass_a_strict_server_side_dry_run(server, stem):
    code, body = _dry_run(server, _job(example_jobs()[stem]))
    assert code == 201, body


@pytest.mark.parametrize("stem", sorted(example_jobs()))
def test_server_defaults_equal_the_offline_ones(server, stem):
    job = _job(example_jobs()[stem])
    code, body = _dry_run(server, job)
    assert code == 201, body
    assert body["spec"] == validation.apply_defaults(job)["spec"]


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_jobs_are_refused_by_the_server(server, case):
    code, body = _dry_run(server, _job(_changed(BAD[case][0])))
    assert code in (400, 422), (code, body)  # 400: strict decoding (unknown fields)
    assert server_message(case) in body["message"], body["message"]


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("spec.nprocPerNode", 2, "nprocPerNode is immutable"),
        ("spec.etcd", {"managed": True, "replicas": 3}, "etcd is immutable once the job exists"),
    ],
)
def test_transition_rules_refuse_updates_of_immutable_fields(server, path, value, message):
    name = f"immutable-{uuid.uuid4().hex[:8]}"
    code, created = server.request("POST", JOBS, _job(example_jobs()["minimal-cpu"], name))
    assert code == 201, created
    changed = copy.deepcopy(created)
    _set(path, value)(changed)
    code, body = server.request("PUT", f"{JOBS}/{name}", changed)
    assert code == 422, body
    assert f"{path}: Invalid value: " in body["message"], body["message"]
    assert message in body["message"], body["message"]
    # the same spec is fine as a new object
    fresh = {k: changed[k] for k in ("apiVersion", "kind", "spec")}
    fresh["metadata"] = {"name": f"{name}-new", "namespace": NS}
    assert _dry_run(server, fresh)[0] == 201


def test_mutable_fields_may_change(server):
    name = f"mutable-{uuid.uuid4().hex[:8]}"
    code, created = server.request("POST", JOBS, _job(example_jobs()["minimal-cpu"], name))
    assert code == 201, created
    changed = copy.deepcopy(created)
    changed["spec"]["replicaSpecs"]["Worker"]["replicas"] = 4
    changed["spec"]["runPolicy"]["suspend"] = True
    code, body = server.request("PUT", f"{JOBS}/{name}", changed)
    assert code == 200, body
    assert body["spec"]["runPolicy"]["suspend"] is True


def test_without_strict_field_validation_unknown_fields_are_dropped_not_refused(server):
    """Why the dry runs above ask for ``fieldValidation=Strict``: by default the server accepts
    an unknown field with a warning and prunes it (a client's plain create, lightkube's
    ``create(dry_run=True)`` among them, does not see the mistake)."""
    change, _ = BAD["unknown field in spec"]
    code, body = server.request("POST", JOBS, _job(_changed(change)), dryRun="All")
    assert code == 201, body
    assert "workers" not in body["spec"]


def test_deletion_waits_for_the_operators_finalizer_until_it_is_removed(server):
    """The finalizer policy (docs/operator.md, "Deleting a job"): kopf puts
    ``operator.megascale.io/finalizer`` on every job because of the sync timer, so a job deleted
    while the operator is down stays, marked for deletion, until the operator comes back or
    someone removes the finalizer."""
    name = f"finalized-{uuid.uuid4().hex[:8]}"
    job = _job(example_jobs()["minimal-cpu"], name)
    job["metadata"]["finalizers"] = [operator.FINALIZER]  # as kopf adds it on first sight
    code, created = server.request("POST", JOBS, job)
    assert code == 201, created
    code, deleting = server.request("DELETE", f"{JOBS}/{name}")
    assert code in (200, 202), deleting
    code, still = server.request("GET", f"{JOBS}/{name}")
    assert code == 200 and still["metadata"]["deletionTimestamp"], still
    # what the operator does on its next pass, or an admin by hand:
    #   kubectl patch msj <name> --type=merge -p '{"metadata":{"finalizers":null}}'
    code, body = server.request(
        "PATCH",
        f"{JOBS}/{name}",
        {"metadata": {"finalizers": None}},
        content_type="application/merge-patch+json",
    )
    assert code == 200, body
    code, gone = server.request("GET", f"{JOBS}/{name}")
    assert code == 404, gone


# -- the operator's handlers against the server (no core/v1 here: every child is refused) --------


@pytest.mark.parametrize(
    "stem, change, reason, message",
    [
        # the server's own words for the first child it refuses
        ("minimal-cpu", None, "ChildRefused", "no core/v1 in the apiextensions-apiserver"),
        ("gpu-volcano", None, "ConfigMapMissing", "ConfigMap 'gpt-7b-config'"),
        ("minimal-cpu", "\n[parallel]\ntp = 3\n", "InvalidConfig", "parallel.tp"),
    ],
)
def test_a_job_that_cannot_proceed_says_why_in_its_status(server, stem, change, reason, message):
    import kopf

    name = f"blocked-{uuid.uuid4().hex[:8]}"
    job = _job(example_jobs()[stem], name)
    if change:
        job["spec"]["config"]["inline"] += change
    code, created = server.request("POST", JOBS, job)
    assert code == 201, created
    kube = operator.LightkubeAPI(server.lightkube_client(builders.FIELD_MANAGER))
    reconciler = operator.Reconciler(kube, store_for=lambda job: None)
    handler = {h.id: h for h in operator.build_registry(reconciler)._changing.get_all_handlers()}
    patch = kopf.Patch()
    try:
        handler["reconcile"].fn(body=created, patch=patch)
    except kopf.TemporaryError:
        assert reason != "InvalidConfig"  # the others are retried
    # what kopf does with the patch: .status through the status subresource
    code, body = server.request(
        "PATCH",
        f"{JOBS}/{name}/status",
        {"status": dict(patch["status"])},
        content_type="application/merge-patch+json",
    )
    assert code == 200, body
    status = server.request("GET", f"{JOBS}/{name}")[1]["status"]
    assert status["reason"] == reason and message in status["message"], status
    (cond,) = [c for c in status["conditions"] if c["type"] == "Created"]
    assert (cond["status"], cond["reason"], cond["message"]) == ("False", reason, status["message"])
    # the main resource does not write .status
    code, _ = server.request(
        "PATCH",
        f"{JOBS}/{name}",
        {"status": {"reason": "Overwritten"}},
        content_type="application/merge-patch+json",
    )
    assert code == 200
    assert server.request("GET", f"{JOBS}/{name}")[1]["status"]["reason"] == reason


# -- the operator itself (kopf) against the server ---------------------------------------------


class _Operator:
    """The real operator (kopf, clusterwide, in a thread) on ``server``; ``stop()`` ends it."""

    def __init__(self, server: APIServer) -> None:
        import kopf

        kube = operator.LightkubeAPI(server.lightkube_client(builders.FIELD_MANAGER))
        registry = operator.build_registry(
            operator.Reconciler(kube, store_for=lambda job: None), interval=1.0
        )
        self.ready, self._stop = threading.Event(), threading.Event()
        coroutine = kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=True,
            ready_flag=self.ready,
            stop_flag=self._stop,
        )
        self._thread = threading.Thread(target=asyncio.run, args=(coroutine,), daemon=True)
        self._thread.start()
        assert self.ready.wait(30), "kopf did not start"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "kopf did not stop"


def test_the_operator_reports_refused_children_and_a_deletion_waits_while_it_is_down(
    server, tmp_path, monkeypatch
):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(server.kubeconfig()))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))  # what kopf's login handler reads
    name = f"operated-{uuid.uuid4().hex[:8]}"
    running = _Operator(server)
    try:
        code, created = server.request("POST", JOBS, _job(example_jobs()["minimal-cpu"], name))
        assert code == 201, created
        job = server.wait_for(
            f"{JOBS}/{name}", lambda j: (j.get("status") or {}).get("reason") == "ChildRefused"
        )
        assert "no core/v1 in the apiextensions-apiserver" in job["status"]["message"]
        assert operator.FINALIZER in job["metadata"]["finalizers"]
    finally:
        running.stop()
    # the operator is down: the deletion waits for it
    assert server.request("DELETE", f"{JOBS}/{name}")[0] in (200, 202)
    time.sleep(1.0)
    code, waiting = server.request("GET", f"{JOBS}/{name}")
    assert code == 200 and waiting["metadata"]["deletionTimestamp"], waiting
    # back up, it lets the job go
    running = _Operator(server)
    try:
        deadline = time.monotonic() + 30
        while server.request("GET", f"{JOBS}/{name}")[0] != 404:
            assert time.monotonic() < deadline, "the operator did not release the job"
            time.sleep(0.1)
    finally:
        running.stop()
