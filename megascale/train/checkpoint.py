"""Checkpoints: a two-stage save written manifest-last, and a restart that reads once per DP group.

Layout, under ``checkpoint.url`` (default ``RUN_DIR/checkpoints``; a directory or an fsspec URL)::

    step_00000020/model_pp01_tp00.pt    what the DP ranks at (pp=1, tp=0) share: model chunks, and
                                        the optimizer state when the distributed optimizer does not
                                        shard it. Written once per DP group, by dp_rank 0.
    step_00000020/rank_00003.pt         rank 3's own state: its optimizer and fp32 main-param shard
                                        (distributed optimizer), scheduler, data loader, RNG.
    step_00000020/done/rank_00003.json  rank 3's "my files are written" marker: their sha256 and
                                        size, and this run's save token. Removed after the manifest.
    step_00000020/manifest.json         written LAST, by rank 0: step, layout, and every file's
                                        sha256 and size.

Save (``Checkpointer.save``, every rank at the same steps). Stage 1 is the training stall: wait for
this rank's previous save (one in flight per rank), ``sync_params``, copy the state into host
buffers (pinned on a GPU), return. Stage 2 runs in a background thread: write this rank's files
(temporary name, then rename; the sha256 is computed as the bytes stream out), then its done
marker. Rank 0's thread then waits until every rank's marker for this save is there, writes the
manifest (temporary name, then rename), removes the markers, and prunes to the last ``keep``.

Why a manifest is never left by a half-written checkpoint: the manifest is only ever written by
rank 0 after it has read a done marker from all ``world_size`` ranks, a marker is written only after
that rank's files were renamed into place, and every rename is atomic (a crash while the
manifest itself is written leaves ``manifest.json.<token>.tmp``). A crash anywhere earlier leaves a
directory without ``manifest.json``, which is never loaded and is removed by a later prune. Markers carry a token that the ranks agree on when the ``Checkpointer`` is built, so a marker
left at the same step by an earlier, crashed attempt never counts; and checkpoints newer than the
step a run starts from (a lost future, e.g. the corrupt one a restart skipped) lose their manifest
before this run writes anything.

Restart (``load_latest``, collective): rank 0 lists the complete checkpoints and broadcasts the
list. For the newest first, every rank reads and verifies (size, sha256) its ``rank_*.pt``, and
dp_rank 0 of each DP group reads and verifies the group's ``model_*.pt`` (every rank does with
``broadcast_on_load = false``); all ranks agree with one all-reduce, so one bad file makes every
rank fall back to the previous checkpoint together. Then each dp_rank 0 broadcasts the shared state
to its DP peers. Files are read once (verify and load from the same bytes) and loaded with
``torch.load(weights_only=True)``: tensors and plain data, never code; the loader opens only the
file names it computes itself, never names taken from a manifest. Resuming needs the same parallel
layout; the manifest records it and the loader checks. Format 1 checkpoints (everything in
``rank_*.pt``) still load: their manifest lists no ``model_*.pt``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megascale.config import CheckpointConfig
from megascale.overlap.dp import sync_params
from megascale.train.checkpoint_io import (
    DONE_DIR,
    MANIFEST,
    HostCopier,
    Storage,
    broadcast_tree,
    check_config,
    load_state_bytes,
    location,
    sha256_hex,
    step_name,
    tree_bytes,
)

if TYPE_CHECKING:
    from megascale.parallel.groups import Groups
    from megascale.train.trainer import Trainer

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2

fault_hook: Callable[[str, int, int], None] | None = None
"""Tests only: called as ``fault_hook(point, rank, step)`` at points of stage 2 ("stage2_start",
"file_written", "marker_written", "before_manifest"), so a test can kill the process there
(``os._exit``) or hold the write back."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (raised by the next ``save``/``wait`` on that rank)."""


def _fault(point: str, rank: int, step: int) -> None:
    if fault_hook is not None:
        fault_hook(point, rank, step)


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / step_name(step)


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def model_file(pp_rank: int, tp_rank: int) -> str:
    return f"model_pp{pp_rank:02d}_tp{tp_rank:02d}.pt"


def _layout(groups: Groups) -> dict:
    return {"tp": groups.layout.tp, "pp": groups.layout.pp, "dp": groups.layout.dp}


# --------------------------------------------------------------------------------------------------
# What a checkpoint holds
# --------------------------------------------------------------------------------------------------


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


def _optimizer_state(trainer: Trainer) -> dict:
    inner = _inner_optimizers(trainer.optimizer)
    return {
        "optimizer": [opt.optimizer.state_dict() for opt in inner],
        "main_params": [[p.detach() for p in _main_params(opt)] for opt in inner],
    }


def _optimizer_sharded(trainer: Trainer) -> bool:
    """The distributed optimizer gives each DP rank different optimizer state and main params."""
    return trainer.job.parallel.distributed_optimizer and trainer.groups.layout.dp > 1


def state_files(trainer: Trainer) -> dict[str, dict]:
    """This rank's files of a checkpoint -> what each holds. Live tensors (not copies). Collective.

    Every rank writes ``rank_*.pt``; dp_rank 0 also writes its DP group's ``model_*.pt``.
    """
    sync_params(trainer.model)
    groups = trainer.groups
    head = {"format_version": FORMAT_VERSION, "step": trainer.step_num}
    optimizer = _optimizer_state(trainer)
    sharded = _optimizer_sharded(trainer)
    own = {
        **head,
        "scheduler": trainer.scheduler.state_dict(),
        "data": trainer.data.state_dict(),
        "rng": _rng_state(),
        **(optimizer if sharded else {}),
    }
    files = {rank_file(groups.rank): own}
    if groups.dp_rank == 0:
        files[model_file(groups.pp_rank, groups.tp_rank)] = {
            **head,
            "model": [chunk.state_dict() for chunk in trainer.model],
            **({} if sharded else optimizer),
        }
    return files


def trainer_state(trainer: Trainer) -> dict:
    """This rank's complete training state, as tensors and plain data (live, not copies).
    Collective."""
    sync_params(trainer.model)
    return {
        "format_version": FORMAT_VERSION,
        "step": trainer.step_num,
        "model": [chunk.state_dict() for chunk in trainer.model],
        **_optimizer_state(trainer),
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


# --------------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------------


class Checkpointer:
    """Saves this rank's checkpoints in two stages; see the module docstring for the protocol.

    Build one per rank after resuming (collective: the ranks agree on a save token, and rank 0
    retires checkpoints newer than the trainer's step). Call ``save`` on every rank at the same
    steps and ``finalize`` on every rank at the end of training. A failed background write is raised
    as CheckpointError by the next ``save``/``wait``/``finalize`` on that rank.

    ``last_stall_s`` is the training time the last ``save`` took (stage 1, including the wait for
    the previous save, reported separately as ``last_wait_s``); ``total_stall_s`` sums them.
    ``last_write_s`` is how long the last finished stage 2 took (rank 0: until its manifest).
    """

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, trainer: Trainer) -> None:
        self.groups, self.device = trainer.groups, trainer.device
        check_config(cfg, self.groups.layout.world_size)
        self.cfg = cfg
        self.storage = Storage(location(cfg, run_dir))
        token = [uuid.uuid4().hex if self.groups.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        self.token: str = token[0]
        self._copier = HostCopier()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_stall_s = self.last_wait_s = self.total_stall_s = self.last_write_s = 0.0
        self.saves = 0
        if cfg.async_save and cfg.interval > 0:
            self._copier.reserve(state_files(trainer))  # the first save then stalls no longer
        if self.groups.rank == 0:
            _retire_newer_than(self.storage, trainer.step_num)
        dist.barrier()  # no rank writes before the retired manifests are gone

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, trainer: Trainer) -> float:
        """Checkpoint the trainer's current step; return the training stall in seconds.

        Collective only through ``sync_params`` (the DP param all-gather, when overlapped); there is
        no barrier: ranks coordinate the manifest through storage, in the background.
        """
        start = time.perf_counter()
        self.wait()  # one save in flight per rank; its host buffers are about to be reused
        self.last_wait_s = time.perf_counter() - start
        step, files = trainer.step_num, state_files(trainer)
        if self.cfg.async_save:
            host = self._copier.copy(files)  # stage 1: training may change the live tensors now
            self._thread = threading.Thread(
                target=self._stage2,
                args=(step, host),
                name=f"megascale::checkpoint::write::{step}",
                daemon=True,  # a crashing rank must not wait for its write: no manifest then
            )
            self._thread.start()
        else:
            self._stage2(step, files)
            self.wait()
        self.last_stall_s = time.perf_counter() - start
        self.total_stall_s += self.last_stall_s
        self.saves += 1
        logger.info(
            "checkpoint step %d: training stalled %.3f s (%.3f s waiting for the previous save)",
            step,
            self.last_stall_s,
            self.last_wait_s,
        )
        return self.last_stall_s

    def wait(self) -> None:
        """Block until this rank's in-flight save finished (rank 0: its manifest is written)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"checkpoint write failed: {error}") from error

    def finalize(self) -> None:
        """End of training: wait for the last save. Idempotent."""
        self.wait()
        if self.saves:
            logger.info(
                "checkpoints: %d saves, training stalled %.3f s in all",
                self.saves,
                self.total_stall_s,
            )

    def _stage2(self, step: int, files: dict[str, dict]) -> None:
        start = time.perf_counter()
        if threading.current_thread() is not threading.main_thread():
            _lower_thread_priority()  # training first when they compete for a core
        try:
            self._write(step, files)
            self.last_write_s = time.perf_counter() - start
        except BaseException as e:  # reported by the next save/wait on the training thread
            logger.error("checkpoint step %d: write failed: %s", step, e)
            self._error = e

    def _write(self, step: int, files: dict[str, dict]) -> None:
        rank, sdir = self.groups.rank, step_name(step)
        _fault("stage2_start", rank, step)
        written = {}
        for name, state in files.items():
            sha, size = self.storage.write_state(f"{sdir}/{name}", state, self.token)
            written[name] = {"sha256": sha, "bytes": size}
            _fault("file_written", rank, step)
        marker = {"token": self.token, "rank": rank, "step": step, "files": written}
        self.storage.write_json(f"{sdir}/{DONE_DIR}/rank_{rank:05d}.json", marker, self.token)
        _fault("marker_written", rank, step)
        if rank != 0:
            return
        entries = self._await_markers(step)
        _fault("before_manifest", rank, step)
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "layout": _layout(self.groups),
            "files": entries,
            "token": self.token,
            "time": time.time(),
        }
        self.storage.write_json(f"{sdir}/{MANIFEST}", manifest, self.token)
        total = sum(e["bytes"] for e in entries.values())
        logger.info(
            "checkpoint step %d complete: %d files, %.1f MB", step, len(entries), total / 1e6
        )
        self._tidy(sdir)
        prune(self.storage, self.cfg.keep)

    def _await_markers(self, step: int) -> dict[str, dict]:
        """Every rank's files for this save (this token), from their done markers; polls storage."""
        world, done = self.groups.layout.world_size, f"{step_name(step)}/{DONE_DIR}"
        files: dict[str, dict] = {}
        seen: set[int] = set()
        deadline = time.monotonic() + self.cfg.write_timeout_s
        delay = 0.005
        while True:
            for name in self.storage.listdir(done):
                if not name.endswith(".json") or name in {f"rank_{r:05d}.json" for r in seen}:
                    continue
                marker = self.storage.read_json(f"{done}/{name}")
                if marker and marker.get("token") == self.token and marker.get("step") == step:
                    seen.add(int(marker["rank"]))
                    files.update(marker["files"])
            if len(seen) == world:
                return files
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - seen)
                raise TimeoutError(
                    f"step {step}: after checkpoint.write_timeout_s = {self.cfg.write_timeout_s} "
                    f"s, ranks {missing[:16]} have not finished writing; no manifest written"
                )
            time.sleep(delay)
            delay = min(2 * delay, 0.25)

    def _tidy(self, sdir: str) -> None:
        """After the manifest: drop the markers and any temporary file a crashed attempt left."""
        self.storage.remove(f"{sdir}/{DONE_DIR}", recursive=True)
        for name in self.storage.listdir(sdir):
            if name.endswith(".tmp"):
                self.storage.remove(f"{sdir}/{name}")


def _lower_thread_priority() -> None:
    """Nice the calling thread (Linux schedules threads as tasks; raising a nice value needs no
    privilege). Best effort."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def prune(storage: Storage, keep: int) -> None:
    """Keep the newest ``keep`` (>= 1) complete checkpoints; drop older ones and incomplete
    directories older than the newest complete one (left by crashed saves; no rank is writing
    them: every rank's writes up to the newest complete checkpoint are finished)."""
    complete = storage.complete_steps()
    if not complete:
        return
    kept = set(complete[-max(1, keep) :])
    for step in storage.steps():
        if step in kept or step > complete[-1]:
            continue
        storage.remove(f"{step_name(step)}/{MANIFEST}")  # first: a half-removed one is incomplete
        storage.remove(step_name(step), recursive=True)


def _retire_newer_than(storage: Storage, step: int) -> None:
    """Drop the manifest of checkpoints after ``step``: this run rewrites those steps."""
    for newer in storage.complete_steps():
        if newer > step:
            logger.warning(
                "checkpoint %s is newer than the starting step %d: this run rewrites it, so it is "
                "marked incomplete",
                step_name(newer),
                step,
            )
            storage.remove(f"{step_name(newer)}/{MANIFEST}")


def complete_checkpoints(root: Path) -> list[Path]:
    """Local checkpoint directories that have a manifest, oldest first."""
    return [step_dir(root, s) for s in Storage(root).complete_steps()]


# --------------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------------


def resume(trainer: Trainer, cfg: CheckpointConfig, run_dir: Path) -> int | None:
    """Load the latest complete checkpoint at this job's checkpoint location. Collective."""
    check_config(cfg, trainer.groups.layout.world_size)
    return load_latest(trainer, location(cfg, run_dir), broadcast=cfg.broadcast_on_load)


def load_latest(
    trainer: Trainer,
    where: str | Path | Storage,
    *,
    broadcast: bool = True,
    step: int | None = None,
) -> int | None:
    """Load the newest checkpoint that every rank can verify; return its step (None: none).

    ``step`` loads that checkpoint only (None when it is not complete or does not verify).

    Collective: the ranks agree on the choice, so one bad file makes all ranks fall back together.
    With ``broadcast``, dp_rank 0 reads its DP group's shared file and broadcasts it.
    """
    storage = where if isinstance(where, Storage) else Storage(where)
    groups = trainer.groups
    listed = [storage.complete_steps() if groups.rank == 0 else None]
    dist.broadcast_object_list(listed, src=0)  # one listing, so every rank walks the same steps
    candidates = [s for s in listed[0] if step is None or s == step]
    for step in reversed(candidates):  # noqa: B020 - the requested step is one of them
        loaded, has_shared, why = _read_verified(storage, step, groups, broadcast)
        flag = torch.tensor([0 if loaded is None else 1], dtype=torch.int32, device=trainer.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag) == 1:
            state = _assemble(loaded, has_shared and broadcast, groups, trainer.device)
            load_trainer_state(trainer, state)
            logger.info("resumed from %s", storage.path(step_name(step)))
            return step
        logger.warning(
            "skipping checkpoint %s: %s",
            step_name(step),
            why or "a file another rank reads does not verify",
        )
    return None


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
    if manifest.get("layout") != _layout(groups):
        layout = manifest.get("layout")
        return None, False, f"saved with layout {layout}, this run is {_layout(groups)}"
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
