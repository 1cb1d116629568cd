"""Two-stage checkpoints: async save and exact resume, a crash mid-write, fsspec URLs, keep-K,
read-once-and-broadcast on restart, and bad checkpoint config refused."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import fsspec
import pytest
import torch
from harness import with_changes

from megascale.config import CheckpointConfig, ConfigError, load, validate
from megascale.launcher.local import RankFailed, run_local
from megascale.overlap.dp import sync_params
from megascale.parallel import cpu_backend
from megascale.parallel.groups import build_groups, destroy_groups, init_distributed
from megascale.train.checkpoint import load as checkpoint_load
from megascale.train.checkpoint import save as checkpoint
from megascale.train.checkpoint.shards import optimizer_step_count, training_entries
from megascale.train.checkpoint.storage import MANIFEST, Storage, check_config, step_name
from megascale.train.run import run_rank
from megascale.train.trainer import Trainer

pytestmark = pytest.mark.slow


def _job(world: int = 4, **ckpt):
    # PP2 x DP2 with the distributed optimizer (per-rank optimizer shards) and dropout (RNG state).
    job = with_changes(
        load("tiny"),
        parallel={"pp": 2 if world == 4 else 1, "distributed_optimizer": True},
        model={"hidden_dropout": 0.1, "attention_dropout": 0.1, "seq_length": 32},
        optim={"warmup_steps": 2},
        train={"steps": 6, "global_batch_size": 8, "micro_batch_size": 2},
        checkpoint={"interval": 2, "keep": 2, **ckpt},
    )
    return validate(job, world, "gloo")


def _losses(history):
    return [(m.step, m.loss, m.grad_norm) for m in history]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("whole")
    return _losses(run_local(run_rank, 4, (_job(), run_dir), timeout_s=300)[0])


def test_async_save_to_file_url_resumes_exactly_and_keeps_last_k(tmp_path, uninterrupted):
    remote = tmp_path / "remote"
    job = _job(url=remote.as_uri(), keep=2)
    first = run_local(run_rank, 4, (job, tmp_path / "run", 4), timeout_s=300)[0]
    second = run_local(run_rank, 4, (job, tmp_path / "run"), timeout_s=300)[0]

    assert [m.step for m in second] == [5, 6]
    assert _losses(first + second) == uninterrupted  # exact
    assert not (tmp_path / "run" / "checkpoints").exists()  # everything went to the URL
    assert Storage(remote.as_uri()).complete_steps() == [4, 6]  # keep = 2; step 2 pruned
    names = sorted(p.name for p in (remote / step_name(6)).iterdir())
    assert names == [
        ".metadata",  # every rank's pieces merged: a plain DCP checkpoint
        "common.pt",  # step, scheduler, data position, optimizer step count
        MANIFEST,
        "rank_00000",  # each rank's DCP files and RNG state
        "rank_00001",
        "rank_00002",
        "rank_00003",
    ]


def _die_at(point: str, rank: int, step: int):
    def hook(p: str, r: int, s: int) -> None:
        if (p, r, s) == (point, rank, step):
            os._exit(17)  # a crash: no cleanup, no flush, the write thread dies with the process

    return hook


@pytest.mark.parametrize(
    "point, rank",
    [("file_written", 1), ("before_manifest", 0)],
    ids=["rank1-after-its-shard", "rank0-after-all-markers"],
)
def test_crash_during_background_write_leaves_no_manifest(
    tmp_path, monkeypatch, uninterrupted, point, rank
):
    job = _job(keep=3)
    monkeypatch.setattr(checkpoint, "fault_hook", _die_at(point, rank, 4))  # forked ranks inherit
    with pytest.raises(RankFailed):
        run_local(run_rank, 4, (job, tmp_path), timeout_s=300)
    monkeypatch.setattr(checkpoint, "fault_hook", None)
    root = tmp_path / "checkpoints"
    assert (root / step_name(4)).is_dir()  # stage 2 had started writing step 4 ...
    assert not (root / step_name(4) / MANIFEST).exists()  # ... and left no manifest
    assert checkpoint_load.complete_checkpoints(root) == [root / step_name(2)]

    resumed = run_local(run_rank, 4, (job, tmp_path), timeout_s=300)[0]
    assert _losses(resumed) == uninterrupted[2:]  # from step 2, exactly
    assert Storage(root).complete_steps() == [2, 4, 6]


def _digest(trainer: Trainer) -> str:
    """Everything a checkpoint restores on this rank: tensors by value, plain data by repr."""
    digest = hashlib.sha256()

    def walk(node) -> None:
        if isinstance(node, torch.Tensor):
            digest.update(node.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        elif isinstance(node, dict):
            for key in sorted(node, key=repr):
                digest.update(repr(key).encode())
                walk(node[key])
        elif isinstance(node, list | tuple):
            for item in node:
                walk(item)
        else:
            digest.update(repr(node).encode())

    walk([(e.key, [t for _, t in e.pieces]) for e in training_entries(trainer)])
    walk([trainer.step_num, trainer.data.state_dict(), trainer.scheduler.state_dict()])
    walk(optimizer_step_count(trainer))
    return digest.hexdigest()


def _setup(job, data_dir) -> Trainer:
    torch.set_num_threads(1)
    init_distributed("cpu")
    cpu_backend.activate()
    groups = build_groups(job.parallel)
    cpu_backend.seed_rng_tracker(job.train.seed, groups.tp_rank)
    return Trainer(job, groups, "cpu", data_cache_dir=data_dir)


def _save_then_load(job, data_dir: Path, run_dir: Path) -> dict:
    saved = _setup(job, data_dir)
    for _ in range(2):
        saved.step()
    saver = checkpoint.Checkpointer(job.checkpoint, run_dir, saved)
    saver.save(saved)
    saver.finalize()
    sync_params(saved.model)  # the checkpoint holds the params the pending all-gather completes
    out = {"saved": _digest(saved), "stall_s": saver.last_stall_s}
    fresh = Trainer(job, saved.groups, "cpu", data_cache_dir=data_dir)
    storage = Storage(run_dir / "checkpoints")
    out["step"] = checkpoint_load.load_latest(fresh, storage)
    out["digest"] = _digest(fresh)
    out["reads"] = sorted({r.split("/")[1] for r in storage.reads if r.count("/") >= 1})
    destroy_groups()
    return out


def test_dp2_restart_restores_every_rank_state_exactly(tmp_path, data_dir):
    job = _job(world=2)  # DP2, distributed optimizer: optimizer shards differ per rank
    out = run_local(_save_then_load, 2, (job, data_dir, tmp_path), timeout_s=300)
    step_files = tmp_path / "checkpoints" / step_name(2)
    assert sorted(p.name for p in step_files.iterdir()) == [
        ".metadata",
        "common.pt",
        MANIFEST,
        "rank_00000",
        "rank_00001",
    ]
    for rank_out in out:
        assert rank_out["stall_s"] > 0
        assert rank_out["step"] == 2
        assert rank_out["digest"] == rank_out["saved"]  # params, optimizer moments, positions
    assert out[0]["saved"] != out[1]["saved"]  # the two ranks' optimizer shards differ


def _memory_round_trip(job, data_dir: Path) -> dict:
    first = _setup(job, data_dir)
    for _ in range(2):
        first.step()
    # Hold stage 2 back until training has moved on: the checkpoint must still hold step 2.
    release = threading.Event()
    checkpoint.fault_hook = lambda point, _r, _s: point == "stage2_start" and release.wait(60)
    saver = checkpoint.Checkpointer(job.checkpoint, Path("/nonexistent"), first)
    saver.save(first)
    in_flight = saver.in_flight
    expected = [first.step().loss for _ in range(2)]
    release.set()
    saver.finalize()
    checkpoint.fault_hook = None
    second = Trainer(job, first.groups, "cpu", data_cache_dir=data_dir)
    step = checkpoint_load.load_latest(second, job.checkpoint.url)
    got = [second.step().loss for _ in range(2)]
    listing = Storage(job.checkpoint.url).listdir(step_name(2))
    assert fsspec.filesystem("memory").exists("/ckpt/" + step_name(2))  # a real memory:// store
    destroy_groups()
    return {"in_flight": in_flight, "step": step, "expected": expected, "got": got, "ls": listing}


def test_memory_url_round_trip_while_training_continues(data_dir):
    job = _job(world=1, url="memory://ckpt")
    out = run_local(_memory_round_trip, 1, (job, data_dir), timeout_s=300)[0]
    assert out["in_flight"]  # save returned while its write was still held back
    assert out["step"] == 2
    assert out["got"] == out["expected"]
    assert out["ls"] == [".metadata", "common.pt", MANIFEST, "rank_00000"]


def _make(storage: Storage, step: int, complete: bool) -> None:
    storage.write_json(f"{step_name(step)}/rank_00000.pt", {}, "t")
    if complete:
        storage.write_json(f"{step_name(step)}/{MANIFEST}", {}, "t")


def test_prune_keeps_last_k_complete_and_never_the_newest_or_in_flight(tmp_path):
    storage = Storage(tmp_path)
    for step, complete in [(2, True), (3, False), (4, True), (6, True), (8, False)]:
        _make(storage, step, complete)
    checkpoint.prune(storage, keep=2)
    assert storage.steps() == [4, 6, 8]  # 3: a crashed save, 8: being written
    assert storage.complete_steps() == [4, 6]
    checkpoint.prune(storage, keep=1)
    assert storage.steps() == [6, 8]
    checkpoint.prune(storage, keep=0)  # never below one complete checkpoint
    assert storage.complete_steps() == [6]


@pytest.mark.parametrize(
    "changes, world, field",
    [
        ({"url": "nosuchproto://bucket/run"}, 1, "checkpoint.url"),
        ({"url": "memory://ckpt"}, 4, "checkpoint.url"),
        ({"url": "  "}, 1, "checkpoint.url"),
        ({"write_timeout_s": 0.0}, 1, "checkpoint.write_timeout_s"),
        ({"keep": 0}, 1, "checkpoint.keep"),
    ],
)
def test_bad_checkpoint_config_is_refused_naming_the_field(changes, world, field):
    with pytest.raises(ConfigError, match=field):
        check_config(CheckpointConfig(**changes), world)


def test_a_bad_checkpoint_url_is_refused_before_any_rank_starts():
    with pytest.raises(ConfigError, match="checkpoint.url = 'memory://ckpt'"):
        _job(world=2, url="memory://ckpt")
