"""End to end against a real cluster: runs when ``KUBECONFIG`` points at one (kind, k3d, a dev
cluster), skipped otherwise. Needs permission to create CRDs and namespaces.

* The CRD is applied; every example is accepted by the real API server (strict server-side dry
  run) and every bad resource of test_crd is refused with the rule's (or the schema's) message,
  as in test_apiserver.
* Every generated manifest passes the server's own validation (dry run), custom kinds whose CRD is
  not installed (PodGroup) skipped.
* The real operator (kopf, in a thread) reconciles a job: children are created with owner
  references, the status is written; deleting the job garbage-collects them.

Images: ``MEGASCALE_E2E_IMAGE`` (default ``python:3.11-slim``) stands in for the megascale image:
the test checks objects, not training.
"""

from __future__ import annotations

import asyncio
import copy
import os
import threading
import time
import uuid

import pytest

pytestmark = pytest.mark.k8s

if not os.environ.get("KUBECONFIG"):
    pytest.skip(
        "KUBECONFIG is not set: no cluster to run end-to-end tests on", allow_module_level=True
    )

lightkube = pytest.importorskip("lightkube")
from lightkube import ApiError, Client, codecs  # noqa: E402
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition  # noqa: E402
from lightkube.resources.core_v1 import Namespace, Pod, Service  # noqa: E402

from megascale.k8s import builders, crd  # noqa: E402
from megascale.k8s.builders import Job  # noqa: E402
from megascale.k8s.operator import LightkubeAPI, Reconciler, build_registry  # noqa: E402

IMAGE = os.environ.get("MEGASCALE_E2E_IMAGE", "python:3.11-slim")


def _client() -> Client:
    try:
        client = Client(field_manager="megascale-e2e")
        next(iter(client.list(Namespace, chunk_size=1)), None)  # lists lazily
    except Exception as e:  # no reachable cluster behind KUBECONFIG
        pytest.skip(f"KUBECONFIG is set but no cluster answers: {e}")
    return client


@pytest.fixture(scope="module")
def client():
    return _client()


@pytest.fixture(scope="module")
def kube(client):
    api = LightkubeAPI(client)
    api.apply(crd.crd())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = client.get(CustomResourceDefinition, crd.CRD_NAME)
        conditions = {c.type: c.status for c in (got.status.conditions or [])}
        if conditions.get("Established") == "True":
            break
        time.sleep(1)
    else:
        pytest.fail("the MegaScaleJob CRD did not become Established in 60 s")
    return api


@pytest.fixture
def namespace(client):
    name = f"megascale-e2e-{uuid.uuid4().hex[:8]}"
    client.create(Namespace(metadata={"name": name}))
    yield name
    client.delete(Namespace, name)


def _job(stem: str, namespace: str) -> dict:
    from k8s_support import example_jobs

    body = copy.deepcopy(example_jobs()[stem])
    body["metadata"]["namespace"] = namespace
    body["metadata"].pop("uid", None)
    for c in body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"]:
        c["image"] = IMAGE
        c.pop("resources", None)  # no GPUs needed to schedule
    return body


def _dry_run(client: Client, obj: dict) -> None:
    """A strict server-side dry run: ``fieldValidation=Strict`` refuses unknown fields, which the
    server's default only warns about and drops. lightkube's ``create`` has no parameter for it,
    so this goes one level down (its generic client's ``request``)."""
    res = codecs.from_dict(obj)
    params = {"dryRun": "All", "fieldValidation": "Strict"}
    client._client.request(
        "post", type(res), res, namespace=obj["metadata"]["namespace"], params=params
    )


def test_examples_accepted_and_bad_resources_refused_by_the_api_server(client, kube, namespace):
    from k8s_support import example_jobs
    from real_apiserver import server_message
    from test_crd import BAD, _changed

    for stem in sorted(example_jobs()):
        _dry_run(client, _job(stem, namespace))
    for case, (change, _) in sorted(BAD.items()):
        body = _changed(change)
        body["metadata"]["namespace"] = namespace
        body["metadata"].pop("uid", None)
        with pytest.raises(ApiError) as error:
            _dry_run(client, body)
        assert server_message(case) in error.value.status.message, case


def test_generated_manifests_pass_server_side_validation(client, kube, namespace):
    from k8s_support import example_config, example_jobs

    for stem in sorted(example_jobs()):
        body = _job(stem, namespace)
        body["metadata"]["uid"] = str(uuid.uuid4())
        job = Job.from_body(body)
        toml = builders.resolve_training_config(
            example_config(stem), builders.training_overrides(job), job.replicas * job.nproc
        )
        for obj in builders.managed_objects(job, toml) + builders.worker_pods(job, ["n1"]):
            if obj["kind"] == "PodGroup":
                continue  # Volcano / scheduler-plugins CRDs are not assumed installed
            obj = copy.deepcopy(obj)
            obj["metadata"].pop("ownerReferences")  # the owner does not exist in a dry run
            _dry_run(client, obj)


def test_operator_reconciles_and_deletion_garbage_collects(client, kube, namespace):
    import kopf

    registry = build_registry(Reconciler(LightkubeAPI(client)), interval=2.0)
    ready, stop = threading.Event(), threading.Event()

    def run() -> None:
        asyncio.run(
            kopf.operator(
                registry=registry,
                standalone=True,
                namespaces=[namespace],
                ready_flag=ready,
                stop_flag=stop,
            )
        )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert ready.wait(60), "kopf did not start"
        body = _job("minimal-cpu", namespace)
        kube.create(body)
        job = Job.from_body({**body, "metadata": {**body["metadata"], "uid": "x"}})
        pods = _wait(lambda: _names(client.list(Pod, namespace=namespace)), 2)
        assert pods == {builders.worker_name(job, 0), builders.worker_name(job, 1)}
        services = _names(client.list(Service, namespace=namespace))
        assert {builders.etcd_name(job), builders.workers_service_name(job)} <= services
        got = kube.get(crd.API_VERSION, crd.KIND, job.name, namespace)
        assert got["status"]["phase"] in ("Pending", "Starting", "Running")
        uid = got["metadata"]["uid"]
        pod = client.get(Pod, builders.worker_name(job, 0), namespace=namespace)
        assert pod.metadata.ownerReferences[0].uid == uid
        kube.delete(crd.API_VERSION, crd.KIND, job.name, namespace)
        _wait(lambda: _names(client.list(Service, namespace=namespace)), 0, timeout=120)
    finally:
        stop.set()
        thread.join(30)


def _names(objects) -> set[str]:
    return {o.metadata.name for o in objects if o.metadata.deletionTimestamp is None}


def _wait(read, count: int, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = read()
        if len(found) == count:
            return found
        time.sleep(1)
    pytest.fail(f"waited {timeout} s for {count} objects, have {read()}")
