"""The node-loss policy and job-fatal errors end to end: ``megascale launch`` with real etcd,
agents and workers (``test_cluster.Run``).

* shrink: 4 nodes x 1 rank, no spare, a node killed mid-run: the job goes on at once on the 3
  nodes left (dp 4 -> 3, 3 -> 4 micro-batches per rank: the same global batch) and finishes;
* job-fatal: checkpoints the job cannot load (another layout, ``checkpoint.reshard = false``) fail
  the job once, with the reason, restarting and evicting nothing, and are left as they were (a
  missing ``data.path``, the other job-fatal error, is refused by ``megascale launch`` before any
  node starts).

The ``wait`` policy (the default) is ``test_cluster.test_kill_agent_node_lost_and_node_reregisters``.
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_cluster import STEPS, Run

pytestmark = pytest.mark.slow

FOUR = [
    "--nodes", "4",
    "--set", "train.global_batch_size=12", "--set", "train.micro_batch_size=1",
]  # fmt: skip


def final_loss(run: Run) -> float:
    lines = (run.dir / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    assert last["step"] == STEPS
    return float(last["loss"])


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory) -> Run:
    run = Run(tmp_path_factory.mktemp("four"), *FOUR)
    assert run.rc == 0, run.output[-6000:]
    return run


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory) -> Run:
    return Run(
        tmp_path_factory.mktemp("shrunk"),
        *FOUR,
        "--fault-policy", "shrink",
        "--inject", "kill-agent:node=3,step=10",
    )  # fmt: skip


def test_shrink_goes_on_at_once_on_the_nodes_left_and_finishes(shrunk):
    assert shrunk.rc == 0, shrunk.output[-6000:]
    assert shrunk.final["finished"] and shrunk.final["final_step"] == STEPS
    [fault] = shrunk.faults()
    assert fault.detail["fault"] == "node_lost" and fault.node == "node-3"
    [elastic] = shrunk.of("elastic")
    assert elastic.detail["decision"] == "shrink" and elastic.detail["dp"] == [4, 3]
    assert elastic.detail["text"] == (
        "shrink: node-3 lost, no spare; nodes 4 -> 3, dp 4 -> 3, "
        "micro-batches 3 -> 4 per rank (global batch 12 kept)"
    )
    assert shrunk.of("generation_start")[-1].detail["nodes"] == ["node-0", "node-1", "node-2"]
    assert shrunk.final["generations"] == 2 and shrunk.final["evicted"] == []
    assert not shrunk.of("waiting_for_nodes")  # no waiting: the restart was immediate
    assert "shrink: node-3 lost" in shrunk.output  # the launcher shows the decision


def test_shrunk_run_resumes_from_its_checkpoint_and_matches_the_fault_free_loss(shrunk, fault_free):
    assert shrunk.rc == 0, shrunk.output[-6000:]
    resumed = [e for e in shrunk.events if e.kind == "resumed" and e.generation == 2]
    assert resumed, "generation 2 did not resume from a checkpoint saved at dp 4"
    assert abs(final_loss(shrunk) - final_loss(fault_free)) <= 1e-4


def test_checkpoints_the_job_cannot_load_fail_it_and_are_left_untouched(fault_free, tmp_path):
    # The 4-node run's checkpoints (dp 4), resumed by a 2-node job that may not reshard them.
    shutil.copytree(fault_free.dir / "checkpoints", tmp_path / "checkpoints")
    before = {
        p: p.read_bytes() for p in sorted((tmp_path / "checkpoints").rglob("*")) if p.is_file()
    }
    run = Run(tmp_path, "--set", "checkpoint.reshard=false")
    assert run.rc == 1 and run.final["state"] == "failed"
    reason = run.final["fatal"]["reason"]
    assert "TP1 x PP1 x DP4" in reason and "TP1 x PP1 x DP2" in reason, reason
    assert "checkpoint.reshard = false" in reason
    assert run.final["failure"].startswith("job-fatal error on rank ")
    [failed] = run.of("failed")
    assert failed.detail["reason"] == run.final["failure"]
    [fault] = run.faults()  # the other ranks' job-fatal exits are not more faults
    assert fault.detail["fault"] == "job_fatal"
    assert run.final["generations"] == 1 and run.final["recoveries"] == 0
    assert run.final["evicted"] == [] and not run.of("selfcheck") and not run.of("evict")
    after = {
        p: p.read_bytes() for p in sorted((tmp_path / "checkpoints").rglob("*")) if p.is_file()
    }
    assert after.keys() == before.keys() and after == before  # nothing removed or demoted
