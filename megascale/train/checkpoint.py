"""Checkpoints: every rank writes its own shard; rank 0 writes the manifest last.

Layout::

    checkpoints/step_00000020/rank_00003.pt   model chunks, optimizer, scheduler, data, RNG
    checkpoints/step_00000020/manifest.json   written after all shards, with their sha256

A directory without ``manifest.json`` is incomplete and never loaded; a shard whose checksum does not
match its manifest entry makes ``load_latest`` fall back to the previous complete checkpoint.
Loading uses ``torch.load(weights_only=True)``: tensors and plain data only, never code.
Resuming needs the same parallel layout (the manifest records it and the loader checks).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megascale.overlap.dp import sync_params

if TYPE_CHECKING:
    from megascale.train.trainer import Trainer

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main_params(optimizer) -> list[torch.Tensor]:
    """fp32 main copies that are not views of model params (bf16 training)."""
    groups = getattr(optimizer, "shard_fp32_from_float16_groups", None)
    if groups is None:
        groups = getattr(optimizer, "fp32_from_float16_groups", [])
    return [p for group in groups for p in group]


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def trainer_state(trainer: Trainer) -> dict:
    """This rank's complete training state, as tensors and plain data. Collective."""
    sync_params(trainer.model)
    return {
        "format_version": FORMAT_VERSION,
        "step": trainer.step_num,
        "model": [chunk.state_dict() for chunk in trainer.model],
        "optimizer": [opt.optimizer.state_dict() for opt in _inner_optimizers(trainer.optimizer)],
        "main_params": [
            [p.detach().cpu().clone() for p in _main_params(opt)]
            for opt in _inner_optimizers(trainer.optimizer)
        ],
        "scheduler": trainer.scheduler.state_dict(),
        "data": trainer.data.state_dict(),
        "rng": _rng_state(),
    }


@torch.no_grad()
def load_trainer_state(trainer: Trainer, state: dict) -> None:
    for chunk, chunk_state in zip(trainer.model, state["model"], strict=True):
        chunk.load_state_dict(chunk_state)
    inner = _inner_optimizers(trainer.optimizer)
    for opt, opt_state, mains in zip(inner, state["optimizer"], state["main_params"], strict=True):
        opt.optimizer.load_state_dict(opt_state)
        for param, saved in zip(_main_params(opt), mains, strict=True):
            param.copy_(saved)
    # megatron-core's scheduler adds the saved step count to its current one: start from zero.
    trainer.scheduler.num_steps = 0
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.data.load_state_dict(state["data"])
    _set_rng_state(state["rng"])
    trainer.step_num = state["step"]


def save(trainer: Trainer, root: Path, keep: int) -> Path:
    """Write this rank's shard; rank 0 writes the manifest once every shard is on disk. Collective."""
    groups = trainer.groups
    target = step_dir(root, trainer.step_num)
    target.mkdir(parents=True, exist_ok=True)
    shard = target / _shard_name(groups.rank)
    tmp = shard.with_suffix(".tmp")
    torch.save(trainer_state(trainer), tmp)
    os.replace(tmp, shard)
    entries: list = [None] * groups.layout.world_size
    dist.all_gather_object(entries, (shard.name, _sha256(shard), shard.stat().st_size))
    if groups.rank == 0:
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": trainer.step_num,
            "layout": {"tp": groups.layout.tp, "pp": groups.layout.pp, "dp": groups.layout.dp},
            "files": {name: {"sha256": sha, "bytes": size} for name, sha, size in entries},
        }
        tmp_manifest = target / (MANIFEST + ".tmp")
        tmp_manifest.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp_manifest, target / MANIFEST)
        _prune(root, keep)
    dist.barrier()
    return target


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories that have a manifest, oldest first."""
    if not root.is_dir():
        return []
    found = [d for d in root.iterdir() if d.name.startswith("step_") and (d / MANIFEST).is_file()]
    return sorted(found, key=lambda d: d.name)


def _prune(root: Path, keep: int) -> None:
    for old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def _verify(directory: Path, rank: int, layout: dict) -> tuple[bool, str]:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        return False, f"unreadable manifest: {e}"
    if manifest.get("layout") != layout:
        return False, f"saved with layout {manifest.get('layout')}, this run is {layout}"
    entry = manifest["files"].get(_shard_name(rank))
    shard = directory / _shard_name(rank)
    if entry is None or not shard.is_file():
        return False, f"{shard.name} missing"
    if shard.stat().st_size != entry["bytes"] or _sha256(shard) != entry["sha256"]:
        return False, f"{shard.name} does not match its checksum"
    return True, ""


def load_latest(trainer: Trainer, root: Path) -> int | None:
    """Load the newest checkpoint that every rank can verify; return its step (None: none). Collective:
    ranks agree on the choice, so one corrupt shard makes all ranks fall back together."""
    groups = trainer.groups
    layout = {"tp": groups.layout.tp, "pp": groups.layout.pp, "dp": groups.layout.dp}
    candidates = complete_checkpoints(root)
    for directory in reversed(candidates):
        ok, why = _verify(directory, groups.rank, layout)
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=trainer.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag) == 1:
            state = torch.load(directory / _shard_name(groups.rank), weights_only=True)
            load_trainer_state(trainer, state)
            logger.info("resumed from %s", directory)
            return trainer.step_num
        if not ok:
            logger.warning("skipping checkpoint %s: %s", directory, why)
    return None
