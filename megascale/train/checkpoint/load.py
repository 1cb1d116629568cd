"""Restart from a checkpoint: find the newest complete one every rank can verify, check that
this run can load it (its layout, ``checkpoint.reshard``), verify every file it names (each rank a
share, agreed with one all-reduce), and load it into the trainer, resharded by DCP to this run's
layout; fall back to the previous one together when any file is bad. ``model_digest`` compares
the weights of two checkpoints whatever layout saved them. The save side, the layout on disk and
the protocol are in ``checkpoint``.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import megascale.train.checkpoint.format as fmt
import megascale.train.checkpoint.legacy as legacy
from megascale.config import CheckpointConfig
from megascale.train.checkpoint.paths import CheckpointPathError, resolve_file
from megascale.train.checkpoint.save import (
    COMMON,
    FORMAT_VERSION,
    CheckpointUnusable,
    _apply_common,
    _describe,
    _layout,
    model_shape,
    rank_dir,
    step_dir,
)
from megascale.train.checkpoint.shards import (
    ensure_optimizer_state,
    fit_vocabulary_rows,
    to_dcp,
    training_entries,
)
from megascale.train.checkpoint.storage import (
    MANIFEST,
    Storage,
    check_config,
    load_state_bytes,
    location,
    set_rng_state,
    sha256_hex,
    step_name,
)

if TYPE_CHECKING:
    from megascale.train.trainer import Trainer

logger = logging.getLogger("megascale.train.checkpoint")


def complete_checkpoints(root: Path) -> list[Path]:
    """Local checkpoint directories that have a manifest, oldest first."""
    return [step_dir(root, s) for s in Storage(root).complete_steps()]


# --------------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------------


def resume(trainer: Trainer, cfg: CheckpointConfig, run_dir: Path) -> int | None:
    """Load the latest complete checkpoint at this job's checkpoint location. Collective."""
    check_config(cfg, trainer.groups.layout.world_size)
    return load_latest(
        trainer, location(cfg, run_dir), broadcast=cfg.broadcast_on_load, reshard=cfg.reshard
    )


def load_latest(
    trainer: Trainer,
    where: str | Path | Storage,
    *,
    broadcast: bool = True,
    step: int | None = None,
    reshard: bool = True,
) -> int | None:
    """Load the newest checkpoint that every rank can verify; return its step (None: none exist).

    Collective: the ranks agree on the choice, so one bad file makes all ranks fall back together.
    ``step`` loads that checkpoint only. Raises CheckpointUnusable, on every rank, when complete
    checkpoints exist and none can be loaded here (a layout change with ``reshard`` off, an older
    layout-bound format at another layout, or none verifies). ``broadcast`` applies to the older
    format (one read per DP group).
    """
    storage = where if isinstance(where, Storage) else Storage(where)
    groups = trainer.groups
    listed = [storage.complete_steps() if groups.rank == 0 else None]
    dist.broadcast_object_list(listed, src=0)  # one listing, so every rank walks the same steps
    candidates = [s for s in listed[0] if step is None or s == step]
    if step is not None and not candidates:
        raise CheckpointUnusable(
            f"no complete checkpoint at step {step} in {storage.path('')}; complete: "
            f"{listed[0] or 'none'}"
        )
    skipped = []
    for candidate in reversed(candidates):
        manifest = [
            storage.read_json(f"{step_name(candidate)}/{MANIFEST}") if groups.rank == 0 else None
        ]
        dist.broadcast_object_list(manifest, src=0)
        _check_loadable(manifest[0], candidate, trainer, storage, reshard)
        if int(manifest[0].get("format_version", 1)) < FORMAT_VERSION:
            loaded = legacy.load_step(trainer, storage, candidate, broadcast=broadcast)
            why = "a file does not verify"
        else:
            loaded, why = _load_step(trainer, storage, candidate, manifest[0])
        if loaded:
            logger.info("resumed from %s", storage.path(step_name(candidate)))
            return candidate
        logger.warning("skipping checkpoint %s: %s", step_name(candidate), why)
        skipped.append(f"{step_name(candidate)} ({why})")
    if skipped:
        raise CheckpointUnusable(
            f"no checkpoint in {storage.path('')} can be loaded: {'; '.join(skipped)}; they are "
            "left as they are: repair or move them, or use another run directory"
        )
    return None


def _check_loadable(
    manifest: dict | None, step: int, trainer: Trainer, storage: Storage, reshard: bool
) -> None:
    """Raise CheckpointUnusable when this complete checkpoint cannot be loaded at this layout."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return  # unreadable: it fails verification and the previous one is tried
    saved, here = manifest.get("layout"), _layout(trainer.groups, trainer)
    if not isinstance(saved, dict):
        saved = {}
    same = all(saved.get(k) == here[k] for k in ("tp", "pp", "dp"))
    where = storage.path(step_name(step))
    _check_model_shape(manifest.get("model"), model_shape(trainer), where)
    if int(manifest.get("format_version", 1)) < FORMAT_VERSION and not same:
        raise CheckpointUnusable(
            f"{where} was saved by an older megascale in a format bound to its layout "
            f"({_describe(saved)}); this run is {_describe(here)}: resume it at "
            f"{_describe(saved)} once (its next checkpoint is layout-independent), or use "
            "another run directory"
        )
    if saved != here and not reshard:
        raise CheckpointUnusable(
            f"{where} was saved with layout {_describe(saved)}, this run is {_describe(here)}, "
            "and checkpoint.reshard = false: set checkpoint.reshard = true to load it at this "
            f"layout, run at {_describe(saved)}, or use another run directory"
        )


def _check_model_shape(saved: object, here: dict, where: str) -> None:
    """Raise CheckpointUnusable when the checkpoint was written by a model of another shape (its
    manifest's ``model``; manifests written before it was recorded are checked tensor by tensor
    in ``_tensor_shape_problem``)."""
    if not isinstance(saved, dict):
        return
    differ = [k for k in here if k in saved and saved[k] != here[k]]
    if differ:
        then = ", ".join(f"model.{k} = {saved[k]!r}" for k in differ)
        now = ", ".join(f"model.{k} = {here[k]!r}" for k in differ)
        raise CheckpointUnusable(
            f"{where} was saved by a model with {then}; this run has {now}: a checkpoint loads "
            f"only into a model of its shape: set {then}, or use another run directory"
        )


def _tensor_shape_problem(metadata, entries, where: str) -> str:
    """Why this rank's model tensors cannot be loaded from the checkpoint: one has another shape
    there, or is not in it ('' when all match). Ranks hold different tensors (pipeline stages):
    the caller gathers every rank's answer."""
    saved = metadata.state_dict_metadata
    for entry in entries:
        if entry.key.startswith("optimizer."):
            continue  # follows its parameter's shape
        shape = getattr(saved.get(entry.key), "size", None)
        if shape is None:
            return (
                f"{where} has no tensor {entry.key} (saved by another model shape); resume with "
                "the model config that wrote it, or use another run directory"
            )
        if tuple(shape) != tuple(entry.global_shape):
            return (
                f"{where} holds {entry.key} of shape {tuple(shape)}, this run's is "
                f"{tuple(entry.global_shape)} (another model shape): resume with the model config "
                "that wrote it, or use another run directory"
            )
    return ""


def _read_file(storage: Storage, sdir: str, name: str) -> bytes | None:
    """A file a manifest names, only if it is a regular file inside the step directory
    (``checkpoint.paths.resolve_file``); None when it is missing or refused."""
    try:
        path = resolve_file(storage.path(sdir), name, local=storage.local)
        return storage.fs.cat_file(path)
    except (CheckpointPathError, OSError, ValueError) as e:
        logger.warning("checkpoint %s: %s", sdir, e)
        return None


def _inside(storage: Storage, sdir: str, name: str) -> bool:
    """Whether ``name`` is a regular file inside the step directory (checked, not read)."""
    try:
        resolve_file(storage.path(sdir), name, local=storage.local)
        return True
    except CheckpointPathError as e:
        logger.warning("checkpoint %s: %s", sdir, e)
        return False


def _data_files_listed(metadata, files: dict) -> str:
    """'' when every data file the DCP metadata names is one the manifest lists (so verified)."""
    named = {info.relative_path for info in (metadata.storage_data or {}).values()}
    unlisted = sorted(named - set(files))
    return f"data files not in the manifest: {unlisted[:4]}" if unlisted else ""


def _verify_share(storage: Storage, sdir: str, files: dict, rank: int, world: int) -> str:
    """Verify this rank's share of a checkpoint's files; return why not ('' when all verify)."""
    for i, name in enumerate(sorted(files)):
        if i % world != rank:
            continue
        entry, data = files[name], _read_file(storage, sdir, name)
        if data is None:
            return f"{name} missing or not a file of the checkpoint"
        if len(data) != entry.get("bytes") or sha256_hex(data) != entry.get("sha256"):
            return f"{name} does not match its checksum"
    return ""


def _read_small_state(storage: Storage, sdir: str, rng: str | None) -> tuple[dict, str]:
    """``common.pt`` and this rank's ``rng`` file (None: not restored), unpickled before any
    tensor is loaded, so that one that cannot be read (a hostile pickle that ``weights_only``
    refuses, though its checksum matches) means falling back, not a crash. ({name: state}, why
    not: '' when both were read)."""
    small = {}
    for name in (COMMON, rng):
        if name is None:
            continue
        try:
            small[name] = load_state_bytes(_read_file(storage, sdir, name) or b"")
        except pickle.UnpicklingError:  # torch's text advises weights_only=False: not repeated
            return small, (
                f"{name} is refused: it holds objects other than tensors and plain data "
                "(not loaded, no code from it ran)"
            )
        except Exception as e:  # not a torch file
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return small, f"{name} cannot be read: {type(e).__name__}: {first[:200]}"
    return small, ""


@torch.no_grad()
def _load_step(trainer: Trainer, storage: Storage, step: int, manifest: dict) -> tuple[bool, str]:
    """Verify, then load one layout-independent checkpoint into the trainer. Collective."""
    groups, sdir, files = trainer.groups, step_name(step), manifest["files"]
    why = _verify_share(storage, sdir, files, groups.rank, groups.layout.world_size)
    same_layout = manifest.get("layout") == _layout(groups, trainer)
    rng = f"{rank_dir(groups.rank)}/rng.pt" if same_layout else None
    small, unreadable = _read_small_state(storage, sdir, rng)
    why = why or unreadable
    whys: list[str] = [""] * groups.layout.world_size
    dist.all_gather_object(whys, why)  # every rank falls back together, naming the bad file
    why = next((w for w in whys if w), "")
    if why:
        return False, why
    try:
        metadata = fmt.load_metadata(_read_file(storage, sdir, fmt.METADATA) or b"")
    except Exception as e:  # refused by the allow-list, or not a metadata file (every rank alike)
        return False, f"{fmt.METADATA} cannot be read: {e}"
    unlisted = _data_files_listed(metadata, files)
    if unlisted:
        return False, unlisted
    ensure_optimizer_state(trainer)
    saved_shapes = {
        key: tuple(item.size)
        for key, item in metadata.state_dict_metadata.items()
        if hasattr(item, "size")
    }
    entries, padding = fit_vocabulary_rows(
        training_entries(trainer),
        saved_shapes,
        trainer.job.model.vocab_size,
        alone=groups.layout.world_size == 1,
    )
    if padding and groups.rank == 0:
        logger.info("checkpoint %s: %s", sdir, padding)
    problems: list[str] = [""] * groups.layout.world_size
    dist.all_gather_object(problems, _tensor_shape_problem(metadata, entries, storage.path(sdir)))
    problem = next((p for p in problems if p), "")
    if problem:  # on every rank alike
        raise CheckpointUnusable(problem)
    fmt.read_pieces(
        to_dcp(entries, groups.rank, groups.layout.world_size), storage.url_of(sdir), metadata
    )
    for inner in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        if hasattr(inner, "_copy_main_params_to_model_params"):
            inner._copy_main_params_to_model_params()  # bf16 model params from the fp32 ones
    _apply_common(trainer, small[COMMON])
    if rng is not None:
        set_rng_state(small[rng])
    else:
        logger.info(
            "checkpoint %s resharded from %s to %s",
            sdir,
            _describe(manifest.get("layout")),
            _describe(_layout(groups, trainer)),
        )
    return True, ""


def model_digest(where: str | Path | Storage) -> tuple[str | None, int | None]:
    """sha256 over the model weights of the newest complete checkpoint (each global tensor by key,
    dtype, shape and bytes, keys sorted), and its step. Independent of the layout that saved it.
    Read in this process, every file verified against the manifest; (None, step) when one does not
    verify or cannot be read."""
    storage = where if isinstance(where, Storage) else Storage(where)
    steps = storage.complete_steps()
    if not steps:
        return None, None
    sdir = step_name(steps[-1])
    manifest = storage.read_json(f"{sdir}/{MANIFEST}") or {}
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    entry, data = files.get(fmt.METADATA), _read_file(storage, sdir, fmt.METADATA)
    if not isinstance(entry, dict) or data is None or sha256_hex(data) != entry.get("sha256"):
        return None, steps[-1]
    try:
        metadata = fmt.load_metadata(data)
    except Exception as e:
        logger.warning("no parameter digest of %s: %s", sdir, e)
        return None, steps[-1]
    named = {info.relative_path for info in (metadata.storage_data or {}).values()}
    if _data_files_listed(metadata, files) or not all(
        _inside(storage, sdir, name) for name in named
    ):
        return None, steps[-1]
    for name in sorted(named):  # a digest is of verified bytes only: a corrupt file gives None
        data, entry = _read_file(storage, sdir, name), files[name]
        if data is None or not isinstance(entry, dict) or sha256_hex(data) != entry.get("sha256"):
            logger.warning("no parameter digest of %s: %s does not match its manifest", sdir, name)
            return None, steps[-1]
    keys = sorted(k for k in metadata.state_dict_metadata if not k.startswith("optimizer."))
    digest = hashlib.sha256()
    for key, tensor in fmt.read_whole(storage.url_of(sdir), metadata, keys).items():
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest(), steps[-1]
