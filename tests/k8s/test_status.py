"""The operator's pure decisions (megascale/k8s/status.py): status mirrored from the controller's
etcd keys, evictions, replacements, scaling, suspend, deadline, backoff, TTL. Every status it
writes is valid against the CRD's status schema."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import jsonschema
import pytest
from k8s_support import example_jobs

from megascale.controller.job_summary import JobSummary
from megascale.k8s import crd, validation
from megascale.k8s.builders import Job
from megascale.k8s.status import (
    CordonNode,
    CreatePod,
    DeleteJob,
    DeletePod,
    EtcdView,
    WorkerPod,
    decide,
    fault_message,
    phase_of,
    plan_workers,
    rfc3339,
    set_condition,
)
from megascale.messages import (
    BlockedNode,
    ControllerState,
    DurableCheckpoint,
    Heartbeat,
    JobSummaryRecord,
    RankFigures,
)

T0 = 1_750_000_000.0
STATUS_SCHEMA = validation.json_schema(crd.status_schema())


def job_of(stem="gpu-volcano", change=None) -> Job:
    body = copy.deepcopy(example_jobs()[stem])
    if change is not None:
        change(body["spec"])
    return Job.from_body(body)


def pods_on(job: Job, nodes: dict[int, str | None], phase="Running") -> list[WorkerPod]:
    return [
        WorkerPod(f"{job.name}-worker-{i}", i, node, phase if node else "Pending")
        for i, node in nodes.items()
    ]


def snapshot(state="running", generation=1, order=("n0", "n1", "n2", "n3"), spares=("n4",), **kw):
    """The controller's ``state`` value, decoded as the operator reads it."""
    return ControllerState.decode(
        {
            "schema": "1.0",
            "state": state,
            "generation": generation,
            "restarts": max(generation - 1, 0),
            "order": list(order),
            "spares": list(spares),
            "step": 120,
            "fault": None,
            **kw,
        }
    )


def blocked(reason, time=T0):
    """A ``blocklist/<node>`` value."""
    return BlockedNode(reason=reason, generation=1, time=time)


def check(decision):
    jsonschema.validate(decision.status, STATUS_SCHEMA)
    return decision


ALL = {i: f"n{i}" for i in range(5)}


def test_phase_of_every_controller_state():
    assert phase_of(None) == "Pending"
    assert [phase_of(s) for s in ("init", "waiting_for_nodes", "starting")] == ["Starting"] * 3
    assert phase_of("running") == "Running"
    assert [phase_of(s) for s in ("stopping", "diagnosing", "restarting")] == ["Recovering"] * 3
    assert (phase_of("finished"), phase_of("failed")) == ("Succeeded", "Failed")
    with pytest.raises(ValueError, match="not a known state"):
        phase_of("dancing")


def test_new_job_creates_every_worker_and_is_pending():
    job = job_of()
    d = check(decide(job, {}, [], None, T0))
    assert d.effects == [CreatePod(i, ()) for i in range(5)]
    assert d.status["phase"] == "Pending"
    assert d.status["startTime"] == rfc3339(T0)
    assert d.status["observedGeneration"] == 1
    conditions = {c["type"]: c["status"] for c in d.status["conditions"]}
    assert conditions == {
        "Created": "True",
        "Running": "False",
        "Recovering": "False",
        "Succeeded": "False",
        "Failed": "False",
        "Suspended": "False",
    }


def summary(step=130, t=T0):
    """The controller's ``summary`` value, made by the controller's own ``JobSummary``."""
    figures = JobSummary()
    figures.observe(
        Heartbeat(
            node="node-0",
            tokens_per_s=1000.0,
            mfu=0.5,
            mfu_peak="989 TFLOP/s gpu:H100",
            durable=DurableCheckpoint(100, t, "s3://c/100"),
            ranks={"0": RankFigures(step=step)},
        )
    )
    fsm = SimpleNamespace(
        state=SimpleNamespace(value="running"), generation=2, step=step, faults=[1], restarts=1
    )
    effective = SimpleNamespace(start=0.0, productive_s=30.0)
    return JobSummaryRecord.decode(figures.to_json(fsm, effective, 40.0))


def test_running_job_mirrors_the_controller_state_and_its_figures():
    job = job_of()
    view = EtcdView(state=snapshot(generation=2), summary=summary())
    d = check(decide(job, {}, pods_on(job, ALL), view, T0))
    s = d.status
    assert d.effects == []
    assert (s["phase"], s["controllerState"], s["reason"]) == (
        "Running",
        "running",
        "ControllerRunning",
    )
    assert (s["currentGeneration"], s["restarts"], s["faults"]) == (2, 1, 1)
    assert s["step"] == 130  # the summary's (refreshed as it trains), not the snapshot's 120
    assert s["activeNodes"] == ["n0", "n1", "n2", "n3"] and s["spareNodes"] == ["n4"]
    assert (s["mfu"], s["mfuPeak"]) == (0.5, "989 TFLOP/s gpu:H100")
    assert s["tokensPerSecond"] == 1000.0  # a job-wide figure, once
    assert s["lastCheckpoint"] == {"step": 100, "url": "s3://c/100", "time": rfc3339(T0)}
    assert s["effectiveTrainingTime"] == {
        "productiveSeconds": 30.0,
        "wallSeconds": 40.0,
        "ratio": 0.75,
    }
    assert s["evictedNodes"] == []
    running = [c for c in s["conditions"] if c["status"] == "True" and c["type"] != "Created"]
    assert [(c["type"], c["reason"], c["message"]) for c in running] == [
        ("Running", "ControllerRunning", "step 130")
    ]


def test_figures_keep_their_last_value_without_a_summary():
    job = job_of()
    state, pods = snapshot(generation=2), pods_on(job, ALL)
    first = decide(job, {}, pods, EtcdView(state, summary=summary()), T0)
    again = check(decide(job, first.status, pods, EtcdView(state), T0 + 1))
    lost = check(decide(job, first.status, pods, None, T0 + 2))
    for key in ("mfu", "tokensPerSecond", "lastCheckpoint", "faults", "effectiveTrainingTime"):
        assert again.status[key] == lost.status[key] == first.status[key], key
    # a summary the controller wrote before its latest decision (generation 3) is not mixed in
    newer = snapshot(generation=3, step=None)
    later = check(decide(job, first.status, pods, EtcdView(newer, summary=summary(150)), T0 + 3))
    assert later.status["step"] == first.status["step"] == 130


def test_eviction_deletes_the_pod_cordons_the_node_once_and_replaces_it_elsewhere():
    job = job_of()  # cordonEvictedNodes: true
    evicted = {"n2": blocked("selfcheck failed: gpu")}
    view = EtcdView(
        snapshot(
            "diagnosing", fault={"kind": "worker_exit", "node": "n2", "rank": 17, "suspects": []}
        ),
        blocklist=evicted,
    )
    pods = pods_on(job, ALL)
    d = check(decide(job, {}, pods, view, T0))
    assert d.effects == [
        CordonNode("n2", "selfcheck failed: gpu"),
        DeletePod("gpt-7b-worker-2", "node n2 evicted: selfcheck failed: gpu", replace=True),
    ]
    assert d.status["phase"] == "Recovering"
    assert d.status["message"] == "worker_exit on node n2, rank 17"
    assert d.status["evictedNodes"] == [
        {
            "node": "n2",
            "reason": "selfcheck failed: gpu",
            "generation": 1,
            "time": rfc3339(T0),
            "pod": "gpt-7b-worker-2",
        }
    ]
    assert d.status["replacements"] == 1

    # the pod is terminating: nothing more to do, no second cordon
    terminating = [
        p if p.index != 2 else WorkerPod(p.name, 2, "n2", "Running", deleting=True) for p in pods
    ]
    d2 = check(decide(job, d.status, terminating, view, T0 + 10))
    assert d2.effects == []
    assert d2.status["replacements"] == 1

    # it is gone: the replacement is created with the evicted node excluded
    gone = [p for p in pods if p.index != 2]
    d3 = check(decide(job, d2.status, gone, view, T0 + 20))
    assert d3.effects == [CreatePod(2, ("n2",))]

    # the replacement exists, not yet scheduled, and excludes n2: steady
    replaced = [*gone, WorkerPod("gpt-7b-worker-2", 2, None, "Pending", excluded=frozenset({"n2"}))]
    d4 = check(decide(job, d3.status, replaced, view, T0 + 30))
    assert d4.effects == []
    assert d4.status["evictedNodes"][0]["pod"] == "gpt-7b-worker-2"  # the pod that ran there


def test_no_cordon_unless_asked():
    job = job_of("minimal-cpu")
    view = EtcdView(snapshot(order=("n0", "n1"), spares=()), blocklist={"n1": blocked("x")})
    d = check(decide(job, {}, pods_on(job, {0: "n0", 1: "n1"}), view, T0))
    assert d.effects == [DeletePod("tiny-worker-1", "node n1 evicted: x", replace=True)]


def test_evictions_survive_in_the_status_when_etcd_is_lost():
    job = job_of()
    prior = {"phase": "Running", "evictedNodes": [{"node": "n2", "reason": "x"}], "replacements": 1}
    pods = [p for p in pods_on(job, ALL) if p.index != 2]
    d = check(decide(job, prior, pods, None, T0))
    assert d.effects == [CreatePod(2, ("n2",))]
    assert d.status["phase"] == "Running"  # kept: nothing new is known
    assert d.status["evictedNodes"] == [{"node": "n2", "reason": "x"}]


def test_unscheduled_pod_made_before_an_eviction_is_recreated():
    job = job_of()
    pods = pods_on(job, {0: "n0", 1: "n1", 2: None, 3: "n3", 4: "n4"})
    view = EtcdView(snapshot(), blocklist={"n9": blocked("lost")})
    d = check(decide(job, {}, pods, view, T0))
    assert DeletePod("gpt-7b-worker-2", "reschedule away from evicted nodes") in d.effects
    assert d.status["replacements"] == 0


def test_failed_pod_is_replaced_and_counts_against_backoff():
    job = job_of()  # backoffLimit 8
    pods = pods_on(job, ALL)
    pods[1] = WorkerPod(pods[1].name, 1, "n1", "Failed")
    d = check(decide(job, {"replacements": 3}, pods, EtcdView(snapshot()), T0))
    assert d.effects == [DeletePod("gpt-7b-worker-1", "pod failed", replace=True)]
    assert d.status["replacements"] == 4


def test_backoff_limit_exceeded_fails_the_job_and_frees_the_nodes():
    job = job_of()
    pods = pods_on(job, ALL)
    pods[1] = WorkerPod(pods[1].name, 1, "n1", "Failed")
    d = check(decide(job, {"replacements": 8}, pods, EtcdView(snapshot()), T0))
    assert d.status["phase"] == "Failed"
    assert d.status["reason"] == "BackoffLimitExceeded"
    assert d.status["replacements"] == 8
    assert d.status["completionTime"] == rfc3339(T0)
    # running pods are deleted (GPUs freed), the failed one kept for its logs
    assert d.effects == [DeletePod(f"gpt-7b-worker-{i}", "job failed") for i in (0, 2, 3, 4)]


def test_active_deadline_fails_the_job():
    job = job_of("external-etcd")  # activeDeadlineSeconds 172800
    prior = {"phase": "Running", "startTime": rfc3339(T0)}
    pods = pods_on(job, {0: "a", 1: "b"})
    assert (
        check(decide(job, prior, pods, EtcdView(snapshot()), T0 + 172800)).status["phase"]
        == "Running"
    )
    d = check(decide(job, prior, pods, EtcdView(snapshot()), T0 + 172801))
    assert (d.status["phase"], d.status["reason"]) == ("Failed", "DeadlineExceeded")
    failed = {c["type"]: c for c in d.status["conditions"]}["Failed"]
    assert failed["status"] == "True" and "activeDeadlineSeconds" in failed["message"]


def test_succeeded_is_final_and_ttl_deletes_the_job():
    job = job_of("external-etcd")  # ttlSecondsAfterFinished 3600
    pods = pods_on(job, {0: "a", 1: "b"}, phase="Succeeded")
    d = check(decide(job, {}, pods, EtcdView(snapshot("finished")), T0))
    assert d.status["phase"] == "Succeeded" and d.effects == []  # finished pods are kept
    # etcd gone (deleted, restarted empty...): still Succeeded
    d2 = check(decide(job, d.status, pods, EtcdView(None), T0 + 3599))
    assert d2.status["phase"] == "Succeeded" and d2.effects == []
    d3 = check(decide(job, d2.status, pods, None, T0 + 3600))
    assert d3.effects == [DeleteJob("ttlSecondsAfterFinished = 3600 passed")]


def test_controller_failed_means_job_failed():
    job = job_of()
    fault = {"kind": "stall", "node": None, "rank": None, "suspects": [3, 7]}
    d = check(decide(job, {}, pods_on(job, ALL), EtcdView(snapshot("failed", fault=fault)), T0))
    assert d.status["phase"] == "Failed"
    assert d.status["message"] == "stall (suspect ranks [3, 7])"
    assert all(isinstance(e, DeletePod) for e in d.effects) and len(d.effects) == 5


def test_a_job_fatal_error_fails_the_job_with_the_ranks_reason():
    job = job_of()
    reason = "job-fatal error on rank 3: data.path = '/data/x': /data/x.bin not found"
    fault = {"kind": "job_fatal", "node": "n0", "rank": 3, "suspects": [], "detail": {}}
    view = EtcdView(snapshot("failed", fault=fault, failure=reason))
    d = check(decide(job, {}, pods_on(job, ALL), view, T0))
    assert (d.status["phase"], d.status["reason"], d.status["message"]) == (
        "Failed",
        "JobFatal",
        reason,
    )
    assert d.status["evictedNodes"] == []


def test_suspend_deletes_workers_and_resume_recreates_them():
    suspended = job_of(change=lambda s: s["runPolicy"].update(suspend=True))
    pods = pods_on(suspended, ALL)
    d = check(decide(suspended, {"phase": "Running"}, pods, EtcdView(snapshot()), T0))
    assert d.status["phase"] == "Suspended"
    assert d.effects == [DeletePod(f"gpt-7b-worker-{i}", "job suspended") for i in range(5)]
    d2 = check(decide(suspended, d.status, [], EtcdView(snapshot()), T0 + 5))
    assert d2.effects == [] and d2.status["phase"] == "Suspended"
    resumed = job_of()
    d3 = check(decide(resumed, d2.status, [], None, T0 + 10))
    assert d3.status["phase"] == "Pending"
    assert d3.effects == [CreatePod(i, ()) for i in range(5)]
    suspended_condition = {c["type"]: c for c in d3.status["conditions"]}["Suspended"]
    assert suspended_condition["status"] == "False"
    assert suspended_condition["lastTransitionTime"] == rfc3339(T0 + 10)


def test_scale_up_and_down():
    job = job_of()
    more = job_of(change=lambda s: s["faultTolerance"].update(spareNodes=3))
    pods = pods_on(job, ALL)
    assert decide(more, {}, pods, None, T0).effects == [CreatePod(5, ()), CreatePod(6, ())]
    fewer = job_of(
        change=lambda s: (
            s["replicaSpecs"]["Worker"].update(replicas=2),
            s["faultTolerance"].update(spareNodes=0),
        )
    )
    assert decide(fewer, {}, pods, None, T0).effects == [
        DeletePod(f"gpt-7b-worker-{i}", "scaled down") for i in (2, 3, 4)
    ]


def test_decide_is_idempotent_once_its_effects_are_visible():
    job = job_of()
    view = EtcdView(snapshot(), blocklist={"n3": blocked("lost")})
    pods = pods_on(job, ALL)
    first = decide(job, {}, pods, view, T0)
    again = decide(job, {}, pods, view, T0)
    assert first == again  # same inputs, same answer
    after = [p for p in pods if p.index != 3] + [
        WorkerPod("gpt-7b-worker-3", 3, None, "Pending", excluded=frozenset({"n3"}))
    ]
    settled = decide(job, first.status, after, view, T0 + 1)
    assert settled.effects == []
    assert (
        decide(job, settled.status, after, view, T0 + 2).status["conditions"]
        == settled.status["conditions"]
    )


def test_condition_transition_time_moves_only_on_a_flip():
    c = set_condition([], "Running", True, "R", "", T0, 1)
    c = set_condition(c, "Running", True, "R", "again", T0 + 5, 2)
    assert c == [
        {
            "type": "Running",
            "status": "True",
            "reason": "R",
            "message": "again",
            "lastTransitionTime": rfc3339(T0),
            "observedGeneration": 2,
        }
    ]
    c = set_condition(c, "Running", False, "NotRunning", "", T0 + 9, 2)
    assert c[0]["lastTransitionTime"] == rfc3339(T0 + 9)


def test_worker_pod_from_manifest():
    pod = {
        "metadata": {
            "name": "j-worker-1",
            "labels": {"megascale.io/replica-index": "1"},
            "annotations": {"megascale.io/excluded-nodes": "a,b"},
            "deletionTimestamp": "2025-01-01T00:00:00Z",
        },
        "spec": {"nodeName": "n1"},
        "status": {"phase": "Running"},
    }
    assert WorkerPod.from_manifest(pod) == WorkerPod(
        "j-worker-1", 1, "n1", "Running", True, frozenset({"a", "b"})
    )
    bare = WorkerPod.from_manifest({"metadata": {"name": "x"}, "spec": {}})
    assert (bare.index, bare.node, bare.phase, bare.excluded) == (
        None,
        None,
        "Pending",
        frozenset(),
    )


def test_plan_workers_leaves_pods_being_deleted_alone():
    job = job_of("minimal-cpu")
    pods = [WorkerPod("tiny-worker-0", 0, "a", "Running", deleting=True)]
    assert plan_workers(job, pods, {"a": "evicted"}, "Running") == [CreatePod(1, ("a",))]


def test_fault_message():
    assert fault_message(None) is None
    assert fault_message(snapshot()) is None
    lost = snapshot(fault={"kind": "node_lost", "node": "n1"})
    assert fault_message(lost) == "node_lost on node n1"
