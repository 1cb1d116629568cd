"""Loading the checkpoints of the older, layout-bound format (format versions 1 and 2).

They hold per-(pp, tp) model files and per-rank files (optimizer shard, scheduler, data, RNG) and
load only at the layout that wrote them (``checkpoint.load.load_latest`` refuses another layout before
calling here). Reading is as it was: every rank verifies and loads its files, dp_rank 0 of each DP
group reads its group's shared file and broadcasts it (``broadcast``), and all ranks agree with one
all-reduce. New checkpoints are written in the layout-independent format of ``checkpoint``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megascale.train.checkpoint.storage import (
    MANIFEST,
    Storage,
    broadcast_tree,
    load_state_bytes,
    set_rng_state,
    sha256_hex,
    step_name,
    tree_bytes,
)

if TYPE_CHECKING:
    from megascale.parallel.groups import Groups
    from megascale.train.trainer import Trainer

logger = logging.getLogger(__name__)


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def model_file(pp_rank: int, tp_rank: int) -> str:
    return f"model_pp{pp_rank:02d}_tp{tp_rank:02d}.pt"


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main_params(optimizer) -> list[torch.Tensor]:
    """fp32 main copies that are not views of model params (bf16 training)."""
    groups = getattr(optimizer, "shard_fp32_from_float16_groups", None)
    if groups is None:
        groups = getattr(optimizer, "fp32_from_float16_groups", [])
    return [p for group in groups for p in group]


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
    set_rng_state(state["rng"])
    trainer.step_num = state["step"]


def load_step(trainer: Trainer, storage: Storage, step: int, *, broadcast: bool) -> bool:
    """Verify and load one old-format checkpoint at the layout that saved it; True when loaded.
    Collective: every rank returns the same answer."""
    groups = trainer.groups
    loaded, has_shared, why = _read_verified(storage, step, groups, broadcast)
    if why:
        logger.warning("checkpoint %s: %s", step_name(step), why)
    flag = torch.tensor([0 if loaded is None else 1], dtype=torch.int32, device=trainer.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if int(flag) == 0:
        return False
    load_trainer_state(trainer, _assemble(loaded, has_shared and broadcast, groups, trainer.device))
    return True


def _read_verified(
    storage: Storage, step: int, groups: Groups, broadcast: bool
) -> tuple[dict | None, bool, str]:
    """Read, verify and load the files this rank reads at ``step``.

    Returns ({name: state} or None, whether the checkpoint has a shared per-DP-group file (format
    1 had none), why not when None).
    """
    sdir = step_name(step)
    manifest = storage.read_json(f"{sdir}/{MANIFEST}")
    if manifest is None or not isinstance(manifest.get("files"), dict):
        return None, False, "unreadable manifest"
    shared = model_file(groups.pp_rank, groups.tp_rank)
    has_shared = shared in manifest["files"]
    names = [rank_file(groups.rank)]
    if has_shared and (not broadcast or groups.dp_rank == 0):
        names.append(shared)
    loaded = {}
    for name in names:
        entry = manifest["files"].get(name)
        data = storage.read_bytes(f"{sdir}/{name}") if entry else None
        if entry is None or data is None:
            return None, has_shared, f"{name} missing"
        if len(data) != entry.get("bytes") or sha256_hex(data) != entry.get("sha256"):
            return None, has_shared, f"{name} does not match its checksum"
        try:
            loaded[name] = load_state_bytes(data)
        except Exception as e:  # weights_only refuses anything but tensors and plain data
            return None, has_shared, f"{name} cannot be loaded: {e}"
    return loaded, has_shared, ""


def _assemble(loaded: dict, broadcast_shared: bool, groups: Groups, device: str) -> dict:
    """This rank's full state: its own file plus its DP group's shared file (read here, or
    broadcast from the group's dp_rank 0)."""
    shared_name = model_file(groups.pp_rank, groups.tp_rank)
    shared = loaded.get(shared_name, {})
    if broadcast_shared and groups.layout.dp > 1:
        src = dist.get_global_rank(groups.dp, 0)
        shared = broadcast_tree(shared if groups.dp_rank == 0 else None, src, groups.dp, device)
        logger.debug("%s: %.1f MB via DP broadcast", shared_name, tree_bytes(shared) / 1e6)
    return {**shared, **loaded[rank_file(groups.rank)]}
