"""The per-machine data pipeline (``data.loader = "node"``) gives the per-rank path's batches bit for
bit: TP2 x PP2 x DP2 on two simulated machines of four ranks, across a restart of the loader
(a fresh segment resumed from the state), with the index cache built once per machine; a reader
whose leader has died gets an error instead of waiting forever."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
import torch.distributed as dist
from harness import with_changes

from megascale.config import load, validate
from megascale.data.corpus import default_token_file
from megascale.data.dataset import ShardedBatches, build_splits
from megascale.data.node_loader import SEGMENT_PREFIX, LoaderError, NodeBatches, shm_dir
from megascale.launcher.local import run_local
from megascale.parallel.groups import build_groups, destroy_groups, init_distributed

pytestmark = pytest.mark.slow

WORLD, MACHINES, BEFORE, AFTER = 8, 2, 3, 2


def _same(got: list[dict], want: list[dict], where: str) -> int:
    assert len(got) == len(want), where
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys(), where
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (where, i, key)
    return len(got)


def _rank(job, data_dir, cache_dir) -> dict:
    init_distributed("cpu")
    torch.set_num_threads(1)
    groups = build_groups(job.parallel)
    machine = f"machine-{dist.get_rank() * MACHINES // WORLD}"
    os.environ["MEGASCALE_NODE"] = machine
    train, _ = build_splits(job, default_token_file(data_dir), cache_dir)
    t = job.train
    args = (train, t.global_batch_size, t.micro_batch_size, groups.dp_rank, groups.layout.dp, 7)
    per_rank = ShardedBatches(*args)
    node = NodeBatches(*args, node=machine)
    named = list(shm_dir().glob(f"{SEGMENT_PREFIX}{node.member_pids[0]}-*"))
    compared = sum(
        _same(node.next_step(), per_rank.next_step(), f"step {s}") for s in range(BEFORE)
    )
    state = node.state_dict()
    node.close()
    restarted = NodeBatches(*args, node=machine)  # a new segment, as a restarted group maps
    restarted.load_state_dict(state)
    compared += sum(
        _same(restarted.next_step(), per_rank.next_step(), f"resumed step {s}")
        for s in range(AFTER)
    )
    dead = subprocess.Popen(["true"])
    dead.wait()
    stopped_leader = None
    if not restarted.leader:  # the leader reads no further: its death must not hang the reader
        restarted.member_pids[0] = dead.pid
        with pytest.raises(LoaderError, match="has exited"):
            restarted.next_step()
            restarted.next_step()  # the leader prepared at most the one step after the last
        stopped_leader = True
    dist.barrier()
    restarted.close()
    destroy_groups()
    return {
        "stopped_leader": stopped_leader,
        "compared": compared,
        "blocks": restarted.block_dp,
        "leader": restarted.leader,
        "named_after_start": named,
    }


def test_node_loader_equals_per_rank_batches_across_a_restart(data_dir, tmp_path):
    job = with_changes(
        load("tiny"),
        parallel={"tp": 2, "pp": 2},
        model={"seq_length": 32},
        train={"global_batch_size": 8, "micro_batch_size": 2, "steps": 10},
    )
    job = validate(job, WORLD, "gloo")
    before = set(shm_dir().glob(f"{SEGMENT_PREFIX}*"))
    results = run_local(_rank, WORLD, (job, data_dir, tmp_path / "cache"), timeout_s=300)
    # Every rank compared 2 micro-batches of 2 samples per step, five steps.
    assert [r["compared"] for r in results] == [2 * (BEFORE + AFTER)] * WORLD
    assert sum(r["leader"] for r in results) == MACHINES
    assert [r["stopped_leader"] for r in results].count(True) == WORLD - MACHINES
    assert all(r["blocks"] == [0, 1] for r in results)  # each machine holds both DP ranks' data
    # The segments had no name once every rank mapped them, and none is left behind.
    assert all(r["named_after_start"] == [] for r in results)
    assert set(shm_dir().glob(f"{SEGMENT_PREFIX}*")) <= before
    # The index cache was built by the machines' first ranks, one at a time under the lock.
    assert any((tmp_path / "cache").rglob("*.npy"))
    assert (tmp_path / "cache" / ".megascale-build.lock").exists()
