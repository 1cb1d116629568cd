"""The operator's handlers driven through their functions, with a recording fake Kubernetes API
and a real etcd: the status mirror reads, with the real ``Store``, keys that the real controller
state machine (``ControllerFSM``) and event log produced."""

from __future__ import annotations

import argparse
import copy
import json
import socket
import sys
import time

import kopf
import pytest
import yaml
from k8s_support import EXAMPLES, FakeKube, example_jobs, load_docs

from megascale.controller.effective import EffectiveTime
from megascale.controller.events import EventLog
from megascale.controller.fsm import (
    ControllerFSM,
    ControllerPolicy,
    Evict,
    RecordEvent,
    SendCommand,
    StartGeneration,
)
from megascale.controller.job_summary import JobSummary
from megascale.etcd.keys import JobKeys
from megascale.etcd.store import Store, StoreConfig
from megascale.k8s import builders, crd, validation
from megascale.k8s.builders import Job
from megascale.k8s.command import add_arguments
from megascale.k8s.command import main as k8s_main
from megascale.k8s.node_selfcheck import label_node_with_selfcheck, summarize_selfcheck
from megascale.k8s.operator import (
    ChildRefused,
    NotReady,
    Reconciler,
    build_registry,
    read_view,
)
from megascale.messages import (
    BlockedNode,
    ControllerState,
    GenerationRecord,
    Heartbeat,
    RankFigures,
)

T0 = 1_750_000_000.0


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class ControllerShell:
    """The controller's I/O, as small as the test needs: runs the real state machine and writes
    what it decides to etcd under the job's keys (blocklist, generation, events, state)."""

    def __init__(self, store: Store, job_id: str, policy: ControllerPolicy) -> None:
        self.store, self.keys = store, JobKeys(job_id)
        self.fsm = ControllerFSM(policy, now=0.0)
        self.events = EventLog(None, store, self.keys, clock=lambda: T0)
        self.commands: dict[str, SendCommand] = {}

    def run(self, actions) -> None:
        for action in actions:
            if isinstance(action, SendCommand):
                self.commands[action.node] = action
            elif isinstance(action, Evict):
                value = BlockedNode(action.reason, self.fsm.generation, T0)
                self.store.put(self.keys.blocked(action.node), value)
            elif isinstance(action, StartGeneration):
                assignment = {n: list(r) for n, r in action.assignment.items()}
                self.store.put(
                    self.keys.generation, GenerationRecord(action.generation, assignment)
                )
            elif isinstance(action, RecordEvent):
                self.events.record(action)
        self.store.put(self.keys.state, self.fsm.snapshot())

    def ack_all(self, ok=lambda node: True) -> None:
        """Every node acks the command it has (commands sent meanwhile wait for the next call)."""
        pending, self.commands = self.commands, {}
        for node, command in sorted(pending.items()):
            self.run(self.fsm.on_ack(node, command.id, ok=ok(node), detail="gpu: ecc errors"))


def body_of(stem: str) -> dict:
    return copy.deepcopy(example_jobs()[stem])


def reconciler(kube: FakeKube, store: Store | None, clock=None) -> Reconciler:
    return Reconciler(kube, store_for=lambda job: store, clock=clock or Clock())


def with_status(body: dict, status: dict) -> dict:
    return {**body, "status": status}


def add_configmap(kube: FakeKube) -> None:
    for doc in load_docs(EXAMPLES / "gpu-volcano.yaml"):
        if doc["kind"] == "ConfigMap":
            kube.apply(doc)
    kube.calls.clear()


# -- create / update / delete -----------------------------------------------------------------


def test_create_applies_every_object_then_creates_the_workers(kube):
    body = body_of("minimal-cpu")
    status = reconciler(kube, None).reconcile(body)
    job = Job.from_body(body)
    expected = [
        ("apply", o["kind"], o["metadata"]["name"]) for o in builders.managed_objects(job, "")
    ]
    creates = [("create", "Pod", f"tiny-worker-{i}") for i in range(2)]
    assert kube.mutations() == expected + creates
    assert status["phase"] == "Pending"
    cm = kube.objects[("v1", "ConfigMap", "default", "tiny-resolved-config")]
    assert "world" not in cm["data"]["config.toml"] and "dp = 2" in cm["data"]["config.toml"]


def test_reconcile_is_idempotent(kube):
    body = body_of("gpu-volcano")
    add_configmap(kube)
    r = reconciler(kube, None)
    status = r.reconcile(body)
    objects = copy.deepcopy(kube.objects)
    kube.calls.clear()
    again = r.reconcile(with_status(body, status))
    assert kube.objects == objects  # nothing changed
    assert [c[0] for c in kube.mutations()] == ["apply"] * 11  # server-side apply: no-ops
    assert again["phase"] == status["phase"] and again["startTime"] == status["startTime"]


def test_update_scales_and_suspends_through_the_same_handler(kube):
    body = body_of("minimal-cpu")
    r = reconciler(kube, None)
    status = r.reconcile(body)
    body["metadata"]["generation"] = 2
    body["spec"]["replicaSpecs"]["Worker"]["replicas"] = 4  # the config must fit 4 ranks
    status = r.reconcile(with_status(body, status))
    assert set(kube.pods("default")) == {f"tiny-worker-{i}" for i in range(4)}
    assert status["observedGeneration"] == 2
    body["metadata"]["generation"] = 3
    body["spec"]["runPolicy"] = {"suspend": True}
    kube.calls.clear()
    status = r.reconcile(with_status(body, status))
    assert status["phase"] == "Suspended"
    assert kube.pods("default") == {}
    dep = kube.objects[("apps/v1", "Deployment", "default", "tiny-controller")]
    assert dep["spec"]["replicas"] == 0
    assert ("v1", "ConfigMap", "default", "tiny-resolved-config") in kube.objects  # kept
    body["metadata"]["generation"] = 4
    body["spec"]["runPolicy"] = {"suspend": False}
    status = r.reconcile(with_status(body, status))
    assert status["phase"] == "Pending" and len(kube.pods("default")) == 4


def test_delete_leaves_cleanup_to_owner_references(kube, store):
    body = body_of("gpu-volcano")
    add_configmap(kube)
    r = reconciler(kube, store)
    r.reconcile(body)
    r.sync(body)
    kube.calls.clear()
    r.forget(body)
    assert kube.mutations() == []  # no deletes by hand
    # what the garbage collector does when the job is deleted: everything it made goes
    uid = body["metadata"]["uid"]
    owned = [k for k, o in kube.objects.items() if _owned_by(o, uid)]
    assert len(owned) == 11 + 5  # managed objects + worker pods
    for key in owned:
        del kube.objects[key]
    left = [k for k in kube.objects if k[2] == "training"]
    assert left == [("v1", "ConfigMap", "training", "gpt-7b-config")]  # the user's own


def _owned_by(obj: dict, uid: str) -> bool:
    return any(ref["uid"] == uid for ref in obj["metadata"].get("ownerReferences", []))


def test_invalid_config_fails_the_job_until_the_spec_is_fixed(kube):
    body = body_of("minimal-cpu")
    body["spec"]["config"]["inline"] += "\n[parallel]\ntp = 3\n"
    events = []
    r = Reconciler(
        kube, store_for=lambda job: None, clock=Clock(), post_event=lambda *a: events.append(a[1:3])
    )
    status = r.reconcile(body)
    assert (status["phase"], status["reason"]) == ("Failed", "InvalidConfig")
    assert created_condition(status) == ("False", "InvalidConfig", status["message"])
    assert "parallel.tp" in status["message"]
    assert kube.mutations() == [] and events == [("Warning", "InvalidConfig")]
    assert r.sync(with_status(body, status)) == {}  # nothing to mirror
    fixed = body_of("minimal-cpu")
    status = r.reconcile(with_status(fixed, status))
    assert status["phase"] == "Pending" and "reason" in status
    assert len(kube.pods("default")) == 2


def test_config_map_ref_is_read_and_waited_for(kube):
    body = body_of("gpu-volcano")
    r = reconciler(kube, None)
    with pytest.raises(NotReady, match="ConfigMap 'gpt-7b-config' with key 'config.toml'"):
        r.reconcile(body)
    add_configmap(kube)
    user = copy.deepcopy(kube.objects[("v1", "ConfigMap", "training", "gpt-7b-config")])
    r.reconcile(body)
    assert kube.objects[("v1", "ConfigMap", "training", "gpt-7b-config")] == user  # untouched
    cm = kube.objects[("v1", "ConfigMap", "training", "gpt-7b-resolved-config")]
    assert cm["metadata"]["ownerReferences"][0]["kind"] == "MegaScaleJob"
    assert "lr = 0.0002" in cm["data"]["config.toml"]


def test_config_map_ref_may_not_use_the_operators_name(kube):
    body = body_of("gpu-volcano")
    body["spec"]["config"]["configMapRef"]["name"] = "gpt-7b-resolved-config"
    status = reconciler(kube, None).reconcile(body)
    assert status["reason"] == "InvalidConfig"
    assert "give your ConfigMap another name" in status["message"]


# -- the status mirror and evictions, against a real etcd ---------------------------------------


def test_sync_mirrors_the_controller_and_replaces_an_evicted_node(kube, store):
    body = body_of("gpu-volcano")  # 4 workers + 1 spare, cordonEvictedNodes
    job = Job.from_body(body)
    add_configmap(kube)
    clock = Clock()
    r = reconciler(kube, store, clock)
    status = r.reconcile(body)
    for i in range(5):
        kube.schedule("training", f"gpt-7b-worker-{i}", f"node-{i}")

    # the controller: 5 agents register (one spare), generation 1 starts and runs
    shell = ControllerShell(store, job.id, ControllerPolicy(nodes=4, nproc_per_node=8, tp=8, pp=2))
    shell.run(shell.fsm.on_start(now=0.0))
    for i in range(5):
        shell.run(shell.fsm.on_node_registered(f"node-{i}", now=1.0))
    shell.ack_all()
    for i in range(4):
        beat = {
            "node": f"node-{i}",
            "step": 50,
            "section": "step",
            "tokens_per_s": 1000.0,
            "mfu": 0.4,
        }
        store.put(shell.keys.heartbeat(f"node-{i}"), beat)
    figures = JobSummary()  # what the controller publishes from the heartbeats' ranks
    figures.observe(
        Heartbeat(
            node="node-0",
            tokens_per_s=1000.0,
            mfu=0.4,
            mfu_peak="989",
            ranks={"0": RankFigures(step=50)},
        )
    )
    store.put(shell.keys.summary, figures.to_json(shell.fsm, EffectiveTime(0.0), 10.0))
    clock.t += 10
    status = r.sync(with_status(body, status))
    assert (status["phase"], status["controllerState"], status["currentGeneration"]) == (
        "Running",
        "running",
        1,
    )
    assert status["activeNodes"] == [f"node-{i}" for i in range(4)]
    assert status["spareNodes"] == ["node-4"]
    assert status["tokensPerSecond"] == 1000.0 and status["mfu"] == pytest.approx(0.4)
    assert kube.mutations()[-1][0] == "create"  # only the reconcile's creates so far
    kube.calls.clear()

    # a worker on node-2 crashes; its self-check fails; the controller evicts node-2 and starts
    # generation 2 with the spare in its slot
    shell.run(shell.fsm.on_worker_exit("node-2", 17, 1, now=20.0))
    shell.ack_all()  # stop acks
    shell.ack_all(ok=lambda node: node != "node-2")  # self-check results
    assert shell.fsm.state.value == "starting" and shell.fsm.order[2] == "node-4"
    clock.t += 10
    status = r.sync(with_status(body, status))
    assert kube.mutations() == [
        (
            "patch",
            "Node",
            "node-2",
            builders.evicted_node_patch(job, "self-check failed: gpu: ecc errors"),
        ),
        ("delete", "Pod", "gpt-7b-worker-2"),
    ]
    node = kube.objects[("v1", "Node", None, "node-2")]
    assert node["spec"]["unschedulable"] is True
    assert node["metadata"]["labels"]["megascale.io/evicted"] == "gpt-7b"
    assert status["phase"] == "Starting" and status["currentGeneration"] == 2
    assert status["restarts"] == 1
    assert status["activeNodes"] == ["node-0", "node-1", "node-4", "node-3"]
    assert status["message"] == "worker_exit on node node-2, rank 17"
    (evicted,) = status["evictedNodes"]
    assert evicted == {
        "node": "node-2",
        "reason": "self-check failed: gpu: ecc errors",
        "generation": 1,
        "time": "2025-06-15T15:06:40Z",
        "pod": "gpt-7b-worker-2",
    }
    assert status["replacements"] == 1

    # next tick: the old pod is gone, its replacement is created away from node-2
    kube.calls.clear()
    clock.t += 10
    status = r.sync(with_status(body, status))
    assert kube.mutations() == [("create", "Pod", "gpt-7b-worker-2")]
    pod = kube.objects[("v1", "Pod", "training", "gpt-7b-worker-2")]
    (term,) = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert term["matchFields"] == [
        {"key": "metadata.name", "operator": "NotIn", "values": ["node-2"]}
    ]
    assert pod["spec"]["hostname"] == "gpt-7b-worker-2"  # same stable identity

    # it is scheduled on a new node and registers as the new spare; generation 2 runs
    kube.schedule("training", "gpt-7b-worker-2", "node-5")
    shell.run(shell.fsm.on_node_registered("node-5", now=40.0))
    shell.ack_all()
    kube.calls.clear()
    clock.t += 10
    status = r.sync(with_status(body, status))
    assert kube.mutations() == []  # steady: nothing more to do, no second cordon
    assert status["phase"] == "Running" and status["spareNodes"] == ["node-5"]
    assert len(status["evictedNodes"]) == 1
    running = {c["type"]: c["status"] for c in status["conditions"]}
    assert running["Running"] == "True" and running["Recovering"] == "False"
    crd_status = validation.json_schema(crd.status_schema())
    import jsonschema

    jsonschema.validate(status, crd_status)


def test_read_view_returns_what_the_controller_wrote(store):
    keys = JobKeys("ns.read-view")
    store.put(keys.state, ControllerState("running", 3))
    store.put(keys.blocked("n1"), BlockedNode("lost", 2, T0))
    store.put(keys.blocked("n2"), {"reason": "lost", "schema": "2.0"})  # another major: skipped
    store.put(keys.heartbeat("n0"), Heartbeat(node="n0", tokens_per_s=5.0))
    store.put(keys.heartbeat("n9"), b"not json")  # skipped, logged
    log = EventLog(None, store, keys, clock=lambda: T0)
    for step in (100, 200):
        log.append("checkpoint", generation=3, detail={"step": step, "url": f"s3://c/{step}"})
    view = read_view(store, keys)
    assert view.state == ControllerState("running", 3)
    assert view.blocklist == {"n1": BlockedNode("lost", 2, T0)}
    assert view.heartbeats == {"n0": Heartbeat(node="n0", tokens_per_s=5.0)}
    assert [e.detail["step"] for e in view.events] == [200, 100]  # newest first


def test_unreachable_etcd_keeps_the_status_and_the_pods(kube):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    store = Store(StoreConfig.parse(f"127.0.0.1:{dead}", retry_s=0.3, request_timeout_s=0.2))
    body = body_of("minimal-cpu")
    r = reconciler(kube, store)
    status = r.reconcile(body)
    status["phase"], status["controllerState"] = "Running", "running"
    kube.calls.clear()
    started = time.monotonic()
    new = r.sync(with_status(body, status))
    assert time.monotonic() - started < 5
    assert new["phase"] == "Running" and new["controllerState"] == "running"
    assert kube.mutations() == []
    store.close()


def test_ttl_after_finishing_deletes_the_job(kube, store):
    body = body_of("external-etcd")  # ttlSecondsAfterFinished 3600
    body["metadata"]["namespace"] = "research"
    job = Job.from_body(body)
    clock = Clock()
    r = reconciler(kube, store, clock)
    status = r.reconcile(body)
    store.put(JobKeys(job.id).state, ControllerState("finished", 1))
    status = r.sync(with_status(body, status))
    assert status["phase"] == "Succeeded"
    kube.calls.clear()
    clock.t += 3600
    r.sync(with_status(body, status))
    assert ("delete", "MegaScaleJob", "ablation-swiglu") in kube.mutations()


# -- kopf handlers ----------------------------------------------------------------------------


def handlers(registry) -> dict[str, object]:
    found = {h.id: h for h in registry._changing.get_all_handlers()}
    found.update({h.id: h for h in registry._spawning.get_all_handlers()})
    return found


def test_kopf_registry_handlers_write_the_status_through_the_patch(kube, store):
    r = reconciler(kube, store)
    registry = build_registry(r, interval=5.0)
    found = handlers(registry)
    assert {"reconcile", "reconcile/spec", "sync", "forget"} <= set(found)
    # Only the sync timer holds a deletion up (kopf's finalizer on every timed job), not ours.
    assert found["forget"].requires_finalizer is False
    assert {i for i, h in found.items() if h.requires_finalizer} == {"sync"}
    assert found["sync"].interval == 5.0
    body = body_of("minimal-cpu")
    patch = kopf.Patch()
    found["reconcile"].fn(body=body, patch=patch)
    assert patch["status"]["phase"] == "Pending"
    assert len(kube.pods("default")) == 2
    patch = kopf.Patch()
    found["sync"].fn(body=with_status(body, dict(patch) or {}), patch=patch)
    assert patch["status"]["observedGeneration"] == 1
    found["forget"].fn(body=body)


def created_condition(status: dict) -> tuple[str, str, str]:
    (cond,) = [c for c in status["conditions"] if c["type"] == "Created"]
    return cond["status"], cond["reason"], cond["message"]


class RefusingKube(FakeKube):
    """A fake whose API server refuses every StatefulSet, as a real one refuses what its
    admission or quota forbids."""

    def apply(self, obj):
        if obj["kind"] == "StatefulSet":
            raise ChildRefused(f"StatefulSet {obj['metadata']['name']!r} refused (403): quota")
        super().apply(obj)


@pytest.mark.parametrize(
    "stem, kube_type, reason, message",
    [
        ("gpu-volcano", FakeKube, "ConfigMapMissing", "ConfigMap 'gpt-7b-config'"),
        ("minimal-cpu", RefusingKube, "ChildRefused", "StatefulSet 'tiny-etcd' refused (403)"),
    ],
)
def test_kopf_handler_turns_a_job_that_cannot_proceed_into_a_retry_with_a_condition(
    stem, kube_type, reason, message
):
    events = []
    r = Reconciler(
        kube_type(),
        store_for=lambda job: None,
        clock=Clock(),
        post_event=lambda *a: events.append(a[1:]),
    )
    found = handlers(build_registry(r, interval=7.0))
    patch = kopf.Patch()
    with pytest.raises(kopf.TemporaryError) as error:
        found["reconcile"].fn(body=body_of(stem), patch=patch)
    assert error.value.delay == 7.0
    status = patch["status"]
    assert (status["phase"], status["reason"]) == ("Pending", reason)
    assert message in status["message"]
    assert created_condition(status) == ("False", reason, status["message"])
    assert events == [("Warning", reason, status["message"])]
    # the timer leaves the status to the retrying reconcile
    patch = kopf.Patch()
    found["sync"].fn(body=with_status(body_of(stem), status), patch=patch)
    assert "status" not in patch or not patch["status"]
    # and the status is valid for the CRD's status schema
    assert validation.validate(with_status(body_of(stem), status)) == []


# -- self-check DaemonSet, CLI ----------------------------------------------------------------


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_selfcheck_labels_the_node_passed_or_failed(kube):
    report = {"checks": [{"name": "gpu", "status": "skipped"}, {"name": "host", "status": "pass"}]}
    ok = _python(f"import json; print(json.dumps({report!r}))")
    assert label_node_with_selfcheck(kube, "n1", ok, timeout_s=30, clock=lambda: T0)
    node = kube.objects[("v1", "Node", None, "n1")]["metadata"]
    assert node["labels"] == {"megascale.io/selfcheck": "passed"}
    assert node["annotations"]["megascale.io/selfcheck-summary"] == (
        "1 passed, 1 skipped, 0 failed"
    )
    assert node["annotations"]["megascale.io/selfcheck-time"] == "2025-06-15T15:06:40Z"

    failing = {
        "checks": [{"name": "network", "status": "fail"}, {"name": "host", "status": "pass"}]
    }
    bad = _python(f"import json, sys; print(json.dumps({failing!r})); sys.exit(1)")
    assert not label_node_with_selfcheck(kube, "n1", bad, timeout_s=30)
    node = kube.objects[("v1", "Node", None, "n1")]["metadata"]
    assert node["labels"] == {"megascale.io/selfcheck": "failed"}
    assert node["annotations"]["megascale.io/selfcheck-summary"] == (
        "1 passed, 0 skipped, 1 failed: network"
    )

    assert not label_node_with_selfcheck(kube, "n2", _python("import time; time.sleep(10)"), 0.5)
    assert (
        "timed out"
        in kube.objects[("v1", "Node", None, "n2")]["metadata"]["annotations"][
            "megascale.io/selfcheck-summary"
        ]
    )
    assert not label_node_with_selfcheck(kube, "n3", ["/nonexistent/selfcheck"], 5)


def test_summarize_selfcheck_output():
    assert summarize_selfcheck("not json\nlast line\n") == "last line"
    assert summarize_selfcheck("") == ""
    assert summarize_selfcheck('{"fit": true}') == '{"fit": true}'


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_operator_command_line(capsys):
    args = _parse(["run", "--namespace", "a", "--namespace", "b", "--interval", "3"])
    assert (args.operator_command, args.namespace, args.interval) == ("run", ["a", "b"], 3.0)
    args = _parse(
        ["selfcheck-label", "--node", "n1", "--once", "--", "megascale", "selfcheck", "--json"]
    )
    assert args.node == "n1" and args.once
    assert k8s_main(_parse(["crd"])) == 0
    assert yaml.safe_load(capsys.readouterr().out) == crd.crd()


def test_selfcheck_label_once_exit_code(monkeypatch):
    recorded = FakeKube()
    recorded.client = "the lightkube client"
    monkeypatch.setattr("megascale.k8s.operator.LightkubeAPI", lambda: recorded)
    asked = []
    monkeypatch.setattr(
        "megascale.k8s.node_selfcheck.workers_on_node",
        lambda client, node: asked.append((client, node)) or 0,  # an idle node
    )
    argv = ["selfcheck-label", "--node", "n7", "--once", "--", *_python("raise SystemExit(3)")]
    assert k8s_main(_parse(argv)) == 1
    argv = ["selfcheck-label", "--node", "n7", "--once", "--", *_python("print('{}')")]
    assert k8s_main(_parse(argv)) == 0
    assert recorded.objects[("v1", "Node", None, "n7")]["metadata"]["labels"] == {
        "megascale.io/selfcheck": "passed"
    }
    assert asked == [("the lightkube client", "n7")] * 2
    json.dumps(recorded.calls)  # the calls are plain data


def test_megascale_operator_crd_through_the_main_cli(capsys):
    from megascale.cli import main

    assert main(["operator", "crd"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["metadata"]["name"] == crd.CRD_NAME
