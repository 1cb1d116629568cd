"""Checkpoints that any parallel layout can load: a two-stage save written manifest-last, and a
restart that reshards.

Layout, under ``checkpoint.url`` (default ``RUN_DIR/checkpoints``; a directory or an fsspec URL)::

    step_00000020/rank_00003/...       rank 3's pieces of every global tensor it holds (a DCP
                                       checkpoint of its own), and its RNG state
    step_00000020/common.pt            step, scheduler, data position, optimizer step count (rank 0)
    step_00000020/.metadata            every rank's pieces merged: the step directory reads as one
                                       torch.distributed.checkpoint (DCP) checkpoint
    step_00000020/done/rank_00003.json rank 3's "my files are written" marker: their sha256 and
                                       size, and this run's save token. Removed after the manifest.
    step_00000020/manifest.json        written LAST, by rank 0: step, layout, every file's sha256

What is saved (``checkpoint.shards``): every model parameter under its megatron-core checkpoint key
with its global shape, and the optimizer state (fp32 main params, Adam or LAMB moments) with the
same keys and shapes, each rank writing the boxes of them it holds (main replicas only). So a
checkpoint written at TP2 x PP2 x DP2 with the distributed optimizer loads at one rank, at DP4, at
PP2 x VPP2, without the distributed optimizer: ``load_latest`` asks DCP for the boxes the loading
rank holds and DCP reads the overlapping parts of the saved ones. The data position is a global
sample count, so the resumed run reads the samples the uninterrupted run would have read.

Save (``Checkpointer.save``, every rank at the same steps). Stage 1 is the training stall: wait for
this rank's previous save (one in flight per rank), copy the pieces it saves into host buffers
(reused from one save to the next; pinned on a GPU, where the copy runs on a stream of its own
beside the next step's forward and backward, and that step's update waits for it), return. Stage
2 runs in a background thread and needs no communication: write this rank's DCP files and RNG,
hash them, write the done marker. Rank 0's thread then waits until every rank's marker is there, merges the ranks' DCP
metadata into the step's ``.metadata``, writes the manifest (temporary name, then rename), removes
the markers, and prunes to the last ``keep``. A crash anywhere before the manifest leaves a
directory that is never loaded.

Restart (``checkpoint.load.load_latest``, collective): rank 0 lists the complete checkpoints and broadcasts the
list and the newest manifest. The ranks verify every file of it (size, sha256; each rank a share,
agreed with one all-reduce), so one bad file makes every rank fall back to the previous checkpoint
together. A checkpoint that verifies but cannot be loaded here (another layout with
``checkpoint.reshard = false``, or the layout-bound format of older versions at another layout) is
never skipped, retired or pruned: the run refuses to start (``CheckpointUnusable``), naming both
layouts and the way forward. Loading never executes code (see ``checkpoint.format``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import megascale.train.checkpoint.format as fmt
from megascale.config import CheckpointConfig
from megascale.train.checkpoint.shards import (
    Entry,
    optimizer_step_count,
    set_optimizer_step_count,
    to_dcp,
    training_entries,
)
from megascale.train.checkpoint.storage import (
    DONE_DIR,
    MANIFEST,
    HostCopier,
    Storage,
    check_config,
    location,
    os_cause,
    rng_state,
    sha256_hex,
    step_name,
)

if TYPE_CHECKING:
    from megascale.parallel.groups import Groups
    from megascale.train.trainer import Trainer

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3
COMMON = "common.pt"

fault_hook: Callable[[str, int, int], None] | None = None
"""Tests only: called as ``fault_hook(point, rank, step)`` at points of stage 2 ("stage2_start",
"file_written", "marker_written", "before_manifest"), so a test can kill the process there
(``os._exit``) or hold the write back."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (raised by the next ``save``/``wait`` on that rank)."""


class CheckpointUnusable(RuntimeError):
    """Complete checkpoints exist that this run cannot load; it must not start (nothing of them
    is changed). The message is one line for the user."""


def _fault(point: str, rank: int, step: int) -> None:
    if fault_hook is not None:
        fault_hook(point, rank, step)


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / step_name(step)


def rank_dir(rank: int) -> str:
    return f"rank_{rank:05d}"


def _layout(groups: Groups, trainer: Trainer | None = None) -> dict:
    layout = {"tp": groups.layout.tp, "pp": groups.layout.pp, "dp": groups.layout.dp}
    if trainer is not None:
        layout["vpp"] = len(trainer.model)
        layout["distributed_optimizer"] = trainer.job.parallel.distributed_optimizer
    return layout


MODEL_SHAPE = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
    "swiglu",
    "parallel_block",
)
"""The ``model`` fields that decide the shapes of the saved tensors (recorded in the manifest:
a checkpoint loads only into a model with the same values)."""


def model_shape(trainer: Trainer) -> dict:
    """This run's values of ``MODEL_SHAPE``."""
    return {name: getattr(trainer.job.model, name) for name in MODEL_SHAPE}


def _describe(layout: dict | None) -> str:
    if not isinstance(layout, dict):
        return repr(layout)
    return " x ".join(f"{k.upper()}{layout[k]}" for k in ("tp", "pp", "dp") if k in layout)


# --------------------------------------------------------------------------------------------------
# What a checkpoint holds, besides the tensors
# --------------------------------------------------------------------------------------------------


def _common_state(trainer: Trainer) -> dict:
    """The job's scalars; equal on every rank, saved by rank 0."""
    return {
        "format_version": FORMAT_VERSION,
        "step": trainer.step_num,
        "scheduler": trainer.scheduler.state_dict(),
        "data": trainer.data.state_dict(),
        "optimizer_step": optimizer_step_count(trainer),
    }


def _apply_common(trainer: Trainer, common: dict) -> None:
    # The schedule is the config's (a resumed run may train for more steps than the saved one
    # planned); only the position comes from the checkpoint. megatron-core's scheduler adds the
    # increment to its count and sets the learning rate for the new position.
    trainer.scheduler.num_steps = 0
    trainer.scheduler.step(increment=int(common["scheduler"]["num_steps"]))
    trainer.data.load_state_dict(common["data"])
    set_optimizer_step_count(trainer, float(common["optimizer_step"]))
    trainer.step_num = int(common["step"])


def snapshot(trainer: Trainer, entries: list[Entry] | None = None) -> tuple[list[Entry], dict]:
    """This rank's part of a checkpoint, live (not copies): the entries it saves (main replicas;
    ``entries``: found earlier for this trainer) and its small state (RNG; rank 0 also the common
    state). No communication: a parameter the distributed optimizer shards is taken from each DP
    rank's own updated range, so the parameter all-gather still in flight (overlapped with the
    next forward) is not waited for."""
    if entries is None:
        entries = saved_entries(trainer)
    small = {"rng": rng_state()}
    if trainer.groups.rank == 0:
        small["common"] = _common_state(trainer)
    return entries, small


def saved_entries(trainer: Trainer) -> list[Entry]:
    """The entries of ``trainer``'s state this rank saves (main replicas): views that stay valid
    while the trainer lives, since the optimizer updates its tensors in place."""
    return [e for e in training_entries(trainer, saving=True) if e.main]


# --------------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------------


class Checkpointer:
    """Saves this rank's checkpoints in two stages; see the module docstring for the protocol.

    Build one per rank after resuming (collective: the ranks agree on a save token; when a
    checkpoint was loaded, rank 0 retires the checkpoints newer than it). Call ``save`` on every
    rank at the same steps and ``finalize`` on every rank at the end of training. A failed
    background write is raised as CheckpointError by the next ``save``/``wait``/``finalize``.

    ``last_stall_s`` is the training time the last ``save`` took (stage 1, including the wait for
    the previous save, reported separately as ``last_wait_s``); ``total_stall_s`` sums them.
    ``last_write_s`` is how long the last finished stage 2 took (rank 0: until its manifest).
    ``durable`` (rank 0; None on the others and before the first complete save) is the newest
    checkpoint whose manifest this process wrote: ``{"step", "time", "url"}``.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: Path,
        trainer: Trainer,
        resumed: int | None = None,
        copier: HostCopier | None = None,
    ) -> None:
        # the rank and world size, never the groups: a write left in flight by a fault must not
        # keep the process groups (and their connections to the peers) alive
        self.rank, self.world, self.device = (
            trainer.groups.rank,
            trainer.groups.layout.world_size,
            trainer.device,
        )
        check_config(cfg, self.world)
        self.cfg = cfg
        self.storage = Storage(location(cfg, run_dir))
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        self.token: str = token[0]
        self.layout = _layout(trainer.groups, trainer)
        self.model_shape = model_shape(trainer)
        # stage 1's host buffers: a rank that rejoined after a fault keeps its earlier ones
        self._copier = copier if copier is not None and copier.free else HostCopier()
        if self._copier.nbytes:
            logger.info("checkpoint host buffers kept: %.1f MB", self._copier.nbytes / 1e6)
        self._thread: threading.Thread | None = None
        # the entries each trainer saves, found once; dropped with the trainer (never kept alive
        # by a write the trainer's generation left in flight)
        self._entries: weakref.WeakKeyDictionary[Trainer, list[Entry]] = weakref.WeakKeyDictionary()
        self._error: BaseException | None = None
        self.last_stall_s = self.last_wait_s = self.total_stall_s = self.last_write_s = 0.0
        self.saves = 0
        self.last_save: tuple[int, float, float | None] | None = None
        """(step, stall_s, durable_s) of the latest save: durable_s (from the save's start until
        its files were written) is None while the write is in flight; set by the writer."""
        self.durable: dict[str, Any] | None = None
        if cfg.interval > 0:
            try:
                self.storage.check_writable()  # now, not at the first save hours from now
            except OSError as e:
                raise CheckpointError(
                    f"checkpoint location {self.storage.url} is not writable: {os_cause(e) or e}"
                ) from e
        if cfg.async_save and cfg.interval > 0 and not self._copier.nbytes:
            self._copier.reserve(_tree(*self._snapshot(trainer)))  # the first save stalls no longer
        if self.rank == 0:
            if resumed is not None:
                _retire_newer_than(self.storage, resumed)
            elif cfg.interval > 0:
                _refuse_to_overwrite(self.storage)
        dist.barrier()  # no rank writes before the retired manifests are gone

    def _snapshot(self, trainer: Trainer) -> tuple[list[Entry], dict]:
        """``snapshot``, with the entries found once per trainer (not at every save)."""
        entries = self._entries.get(trainer)
        if entries is None:
            entries = self._entries[trainer] = saved_entries(trainer)
        return snapshot(trainer, entries)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, trainer: Trainer) -> float:
        """Checkpoint the trainer's current step; return the training stall in seconds.

        No communication: ranks coordinate the manifest through storage, in the background.
        """
        start = time.perf_counter()
        self.wait()  # one save in flight per rank; its host buffers are about to be reused
        self.last_wait_s = time.perf_counter() - start
        step, tree = trainer.step_num, _tree(*self._snapshot(trainer))
        if self.cfg.async_save:
            # stage 1; from a GPU the copy is in flight beside the next step's forward and
            # backward, which only read the state, and its update waits for it on the device
            host, copied = self._copier.copy(tree)
            if copied is not None:
                trainer.reading_state(copied)
            # the stall is over once the thread starts: set before the writer may replace it
            self.last_save = (step, time.perf_counter() - start, None)
            self._thread = threading.Thread(
                target=self._stage2,
                args=(step, host, start, copied),
                name=f"megascale::checkpoint::write::{step}",
                daemon=True,  # a crashing rank must not wait for its write: no manifest then
            )
            self._thread.start()
            self._copier.writer = self._thread
        else:
            self._stage2(step, tree, start)
            self.wait()
        self.last_stall_s = time.perf_counter() - start
        if not self.cfg.async_save:  # written and durable before training goes on
            self.last_save = (step, self.last_stall_s, self.last_stall_s)
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
            raise CheckpointError(f"checkpoint write failed: {os_cause(error) or error}") from error

    def finalize(self) -> None:
        """End of training: wait for the last save. Idempotent."""
        self.wait()
        if self.saves:
            logger.info(
                "checkpoints: %d saves, training stalled %.3f s in all",
                self.saves,
                self.total_stall_s,
            )

    def _stage2(
        self, step: int, tree: dict, save_started: float, copied: torch.cuda.Event | None = None
    ) -> None:
        start = time.perf_counter()
        if threading.current_thread() is not threading.main_thread():
            _lower_thread_priority()  # training first when they compete for a core
        try:
            if copied is not None:
                copied.synchronize()  # stage 1's copy out of GPU memory has landed
            self._write(step, tree)
            done = time.perf_counter()
            self.last_write_s = done - start
            stall = self.last_save[1] if self.last_save and self.last_save[0] == step else 0.0
            self.last_save = (step, stall, done - save_started)  # one assignment: never torn
        except BaseException as e:  # reported by the next save/wait on the training thread
            mine = f"{step_name(step)}/{rank_dir(self.rank)}"
            self.storage.remove(mine, recursive=True)  # no partial files left (a full disk)
            logger.error("checkpoint step %d: write failed: %s", step, os_cause(e) or e)
            self._error = e

    def _write(self, step: int, tree: dict) -> None:
        rank, sdir = self.rank, step_name(step)
        mine = f"{sdir}/{rank_dir(rank)}"
        _fault("stage2_start", rank, step)
        state = to_dcp(_entries(tree), rank, self.world)
        fmt.write_pieces(state, self.storage.url_of(mine))
        written = {}
        for name in self.storage.listdir(mine):
            data = self.storage.read_bytes(f"{mine}/{name}") or b""
            written[f"{rank_dir(rank)}/{name}"] = {"sha256": sha256_hex(data), "bytes": len(data)}
        sha, size = self.storage.write_state(f"{mine}/rng.pt", tree["small"]["rng"], self.token)
        written[f"{rank_dir(rank)}/rng.pt"] = {"sha256": sha, "bytes": size}
        if "common" in tree["small"]:
            sha, size = self.storage.write_state(
                f"{sdir}/{COMMON}", tree["small"]["common"], self.token
            )
            written[COMMON] = {"sha256": sha, "bytes": size}
        _fault("file_written", rank, step)
        marker = {"token": self.token, "rank": rank, "step": step, "files": written}
        self.storage.write_json(f"{sdir}/{DONE_DIR}/rank_{rank:05d}.json", marker, self.token)
        _fault("marker_written", rank, step)
        if rank != 0:
            return
        entries = self._await_markers(step)
        _fault("before_manifest", rank, step)
        entries[fmt.METADATA] = self._write_merged_metadata(sdir, entries)
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "layout": self.layout,
            "model": self.model_shape,
            "files": entries,
            "token": self.token,
            "time": time.time(),
        }
        self.storage.write_json(f"{sdir}/{MANIFEST}", manifest, self.token)
        # one assignment: the training thread reads it whole (``WorkerSignals.checkpoint_durable``)
        self.durable = {"step": step, "time": manifest["time"], "url": self.storage.url_of(sdir)}
        total = sum(e["bytes"] for e in entries.values())
        logger.info(
            "checkpoint step %d complete: %d files, %.1f MB", step, len(entries), total / 1e6
        )
        self._tidy(sdir)
        prune(self.storage, self.cfg.keep)

    def _write_merged_metadata(self, sdir: str, files: dict[str, dict]) -> dict:
        """The ranks' DCP metadata (checked against their markers) merged into ``.metadata``."""
        parts = {}
        for name, entry in files.items():
            if not name.endswith(f"/{fmt.METADATA}"):
                continue
            data = self.storage.read_bytes(f"{sdir}/{name}")
            if data is None or sha256_hex(data) != entry["sha256"]:
                raise CheckpointError(f"{sdir}/{name} changed after its rank wrote it")
            parts[name.split("/")[0]] = fmt.load_metadata(data)
        data = fmt.metadata_bytes(fmt.merge_metadata(parts))
        sha, size = self.storage.write_bytes(f"{sdir}/{fmt.METADATA}", data, self.token)
        return {"sha256": sha, "bytes": size}

    def _await_markers(self, step: int) -> dict[str, dict]:
        """Every rank's files for this save (this token), from their done markers; polls storage."""
        world, done = self.world, f"{step_name(step)}/{DONE_DIR}"
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


def _tree(entries: list[Entry], small: dict) -> dict:
    """A snapshot as one tree of tensors (what the host copier copies)."""
    return {
        "entries": [(e.key, e.global_shape, [(off, t) for off, t in e.pieces]) for e in entries],
        "small": small,
    }


def _entries(tree: dict) -> list[Entry]:
    return [
        Entry(key, tuple(shape), pieces[0][1].dtype, [(tuple(o), t) for o, t in pieces])
        for key, shape, pieces in tree["entries"]
        if pieces
    ]


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
    """Drop the manifest of checkpoints after ``step``, the checkpoint this run loaded: they did
    not verify when it started (it loads the newest that does), and this run rewrites those steps."""
    for newer in storage.complete_steps():
        if newer > step:
            logger.warning(
                "checkpoint %s is newer than the loaded step %d and did not verify: this run "
                "rewrites it, so it is marked incomplete",
                step_name(newer),
                step,
            )
            storage.remove(f"{step_name(newer)}/{MANIFEST}")


def _refuse_to_overwrite(storage: Storage) -> None:
    """A run that loaded no checkpoint must not write over complete ones (checkpoint.resume off)."""
    complete = storage.complete_steps()
    if complete:
        raise CheckpointUnusable(
            f"{storage.path(step_name(complete[-1]))} is a complete checkpoint and this run did "
            "not load it (checkpoint.resume = false): it would be overwritten; use another run "
            "directory or checkpoint.url, or resume"
        )
