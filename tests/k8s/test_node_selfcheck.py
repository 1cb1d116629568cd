"""The self-check DaemonSet never competes with training: the full check (GPUs, NCCL) only on a
node without megascale worker pods, the host checks otherwise (``megascale.k8s.node_selfcheck``),
and a host-only self-check creates no CUDA context."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from k8s_support import FakeKube

from megascale.agent.selfcheck import suite as selfcheck
from megascale.k8s import node_selfcheck
from megascale.k8s.node_selfcheck import (
    WORKER_LABELS,
    selfcheck_command,
    selfcheck_daemon,
    workers_on_node,
)

FULL = ["megascale", "selfcheck", "--json", "--quick"]


def test_idle_node_gets_the_full_check():
    assert selfcheck_command(FULL, 0) == (FULL, "")


@pytest.mark.parametrize("workers", [1, 8, None])
def test_busy_or_unknown_node_gets_host_checks_only(workers):
    command, note = selfcheck_command([*FULL, "--only", "gpu.*", "--only=net.*"], workers)
    assert command == [*FULL, "--only", "host.*"]  # the user's GPU/network selection dropped
    assert note.startswith("host checks only")
    if workers:
        assert f"{workers} megascale worker pod(s)" in note


def test_worker_pods_carry_the_labels_the_daemonset_looks_for():
    from k8s_support import example_jobs

    from megascale.k8s.builders import Job, worker_pod

    job = Job.from_body(next(iter(example_jobs().values())))
    labels = worker_pod(job, 0)["metadata"]["labels"]
    assert WORKER_LABELS.items() <= labels.items()


class _Pods:
    """A lightkube client's ``list`` over made-up pods; records the selection."""

    def __init__(self, phases):
        self.phases, self.calls = phases, []

    def list(self, res, **kwargs):
        self.calls.append((res.__name__, kwargs))
        return [SimpleNamespace(status=SimpleNamespace(phase=p)) for p in self.phases]


def test_workers_on_node_counts_unfinished_worker_pods_in_every_namespace():
    from lightkube import ALL_NS

    client = _Pods(["Running", "Pending", "Succeeded", "Failed"])
    assert workers_on_node(client, "gpu-17") == 2
    assert client.calls == [
        (
            "Pod",
            {"namespace": ALL_NS, "labels": WORKER_LABELS, "fields": {"spec.nodeName": "gpu-17"}},
        )
    ]


# The self-check stand-in: passes only when asked for exactly what the test expects.
_EXPECT = (
    "import json, sys; wanted = sys.argv[1:]; "
    "print(json.dumps({'checks': [{'name': 'host.disk_write', 'status': 'pass'}]})); "
    "sys.exit(0 if ('--only' in wanted) == BUSY else 3)"
)


@pytest.mark.parametrize("busy", [False, True])
def test_daemon_runs_the_check_the_node_allows_and_says_so(busy):
    kube = FakeKube()
    command = [sys.executable, "-c", _EXPECT.replace("BUSY", str(busy))]
    workers = lambda: 3 if busy else 0  # noqa: E731
    assert selfcheck_daemon(kube, "n1", command, 3600, 30, once=True, workers=workers) == 0
    node = kube.objects[("v1", "Node", None, "n1")]["metadata"]
    assert node["labels"] == {"megascale.io/selfcheck": "passed"}
    summary = node["annotations"]["megascale.io/selfcheck-summary"]
    assert summary.startswith("host checks only: 3 megascale") == busy, summary


def test_daemon_assumes_busy_when_pods_cannot_be_listed():
    def broken():
        raise ConnectionError("API server unreachable")

    kube = FakeKube()
    command = [sys.executable, "-c", _EXPECT.replace("BUSY", "True")]
    assert selfcheck_daemon(kube, "n2", command, 3600, 30, once=True, workers=broken) == 0
    summary = kube.objects[("v1", "Node", None, "n2")]["metadata"]["annotations"]
    assert "could not be listed" in summary["megascale.io/selfcheck-summary"]


def test_host_only_selfcheck_creates_no_cuda_context(monkeypatch, tmp_path):
    def cuda_detection():
        raise AssertionError("host-only self-check initialised CUDA")

    monkeypatch.setattr(selfcheck, "_detect_gpu", cuda_detection)
    monkeypatch.setattr(selfcheck, "_nvml_gpu", lambda: ("NVIDIA H100 80GB HBM3", 8))
    options = selfcheck.SelfCheckOptions(quick=True, only=["host.*"], directory=str(tmp_path))
    report = selfcheck.run_selfcheck(options)
    assert report.profile == "H100 SXM"  # from NVML: the node's host thresholds
    assert {c.name for c in report.checks} == {
        "host.memory_bandwidth",
        "host.disk_write",
        "host.disk_free",
    }
    assert node_selfcheck.LIGHT_CHECKS == ("host.*",)
