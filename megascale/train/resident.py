"""In-process recovery, the worker's side: a rank that outlives the faults of its peers.

Under a node agent with ``fault_tolerance.recovery = "in-process"`` (the agent sets
``MEGASCALE_REJOIN_DIR``), a worker runs ``run_rank`` in a loop. When a generation ends in a
fault -- a collective fails because a peer died, or the agent asks it to pause (``SIGUSR1``)
because the controller stopped the job -- the worker does not exit: it drops the generation's
trainer and process groups, keeps its in-memory snapshots (``train.memory_snapshot``), writes
``paused_rank_NNNNN.json`` in the rejoin directory and waits. When the controller starts the next
generation, the agent writes ``generation_G.json`` there with the generation's rendezvous (the
master's address and port, the world size); the worker takes it into its environment and runs
``run_rank`` again, which re-forms the process groups with the replaced ranks and restores the
newest snapshot every rank can reach. Its process, its imports, and on a GPU its CUDA context,
are kept; only the failed ranks are new processes.

An error that is not a communication failure (a bug, a bad checkpoint, a full disk) ends the
worker as before: the controller decides what follows. A worker that does not pause in time (a
wedged rank) is killed by its agent and comes back as a new process.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from megascale import runfiles

if TYPE_CHECKING:
    from megascale.config import JobConfig

logger = logging.getLogger("megascale.resident")

REJOIN_DIR_ENV = "MEGASCALE_REJOIN_DIR"
PAUSE_SIGNAL = signal.SIGUSR1
WAIT_LIMIT_S = 3600.0
"""A paused rank that hears nothing for this long exits (its agent is gone or has moved on)."""
COMMUNICATION_ERRORS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "socket",
    "gloo",
    "nccl",
    "process group",
)


class Paused(Exception):
    """The node agent paused this rank (the controller stopped the generation)."""


def paused_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"paused_rank_{rank:05d}.json"


def rejoin_path(directory: Path, generation: int) -> Path:
    return Path(directory) / f"generation_{generation}.json"


def recoverable(error: BaseException) -> bool:
    """Whether ``error`` ends a generation, not this rank: a pause, or a failed collective."""
    if isinstance(error, Paused):
        return True
    import torch.distributed

    dist_error = getattr(torch.distributed, "DistError", ())
    if dist_error and isinstance(error, dist_error):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(word in text for word in COMMUNICATION_ERRORS)


class Resident:
    """The pause handler and rejoin wait of one worker process (see the module)."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.directory, self.rank = Path(directory), rank
        runfiles.make_dir(self.directory)
        self.training = False
        signal.signal(PAUSE_SIGNAL, self._on_pause)

    def _on_pause(self, _signum, _frame) -> None:
        if self.training:
            self.training = False
            raise Paused("the node agent paused this rank")

    def wait_for_rejoin(
        self,
        generation: int,
        reason: str,
        limit_s: float = WAIT_LIMIT_S,
        before_waiting: Callable[[], object] = lambda: None,
    ) -> int:
        """Say this rank is paused after ``generation``, run ``before_waiting`` (the full
        collection that frees the model's cycles: its groups' connections close, and the peers
        still blocked in a collective with this rank fail and pause in turn; it overlaps with
        the controller's decision), wait for a later generation's rejoin file and take its
        environment; returns the new generation."""
        record = {
            "rank": self.rank,
            "generation": generation,
            "pid": os.getpid(),
            "world": int(os.environ.get("WORLD_SIZE", "0")),
        }
        runfiles.write_text(
            paused_path(self.directory, self.rank),
            json.dumps({**record, "reason": reason[:500], "time": time.time()}),
        )
        logger.warning("paused after generation %d: %s", generation, reason)
        before_waiting()
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            newest = _newest_rejoin(self.directory, generation)
            if newest is not None:
                later, env = newest
                os.environ.update(env)
                paused_path(self.directory, self.rank).unlink(missing_ok=True)
                logger.warning("rejoining in generation %d", later)
                return later
            time.sleep(0.005)
        raise TimeoutError(f"paused for {limit_s:.0f} s and no generation came to rejoin")


def _newest_rejoin(directory: Path, after: int) -> tuple[int, dict[str, str]] | None:
    best = None
    for path in directory.glob("generation_*.json"):
        try:
            generation = int(path.stem.split("_", 1)[1])
            if generation > after and (best is None or generation > best[0]):
                best = (generation, path)
        except ValueError:
            continue
    if best is None:
        return None
    try:
        env = json.loads(best[1].read_text())["env"]
    except (OSError, ValueError, KeyError):
        return None  # being written
    return best[0], {str(k): str(v) for k, v in env.items()}


def in_process_applies(job: JobConfig) -> bool:
    """Whether this job's ranks pause and rejoin on a fault on this machine: ``recovery =
    "in-process"``, blocking gloo collectives (an NCCL-like thread of
    ``parallel.async_collectives`` cannot be aborted) and a CPU job: a rank blocked in an NCCL
    collective with a dead peer does not return to Python until the communicator is aborted,
    which is not done yet, so CUDA jobs restart."""
    from megascale.machine_check import resolve_device

    if job.fault_tolerance.recovery != "in-process" or job.parallel.async_collectives:
        return False
    try:
        return resolve_device(job.train.device) == "cpu"
    except ValueError:  # cuda asked where none is: the workers say so
        return False


def snapshot_interval(job: JobConfig) -> int:
    """``fault_tolerance.snapshot_interval``, or when left out: every step on CPU, every
    ``checkpoint.interval`` steps on a GPU."""
    from megascale.machine_check import resolve_device

    interval = job.fault_tolerance.snapshot_interval
    if interval is not None:
        return interval
    return 1 if resolve_device(job.train.device) == "cpu" else max(1, job.checkpoint.interval)


def run_resident(job: JobConfig, run_dir: Path) -> None:
    """``run_rank`` until training ends, pausing and rejoining across faults (see the module)."""
    from megascale.model.gpt import release_model_caches
    from megascale.parallel.groups import destroy_groups
    from megascale.probes.progress import progress_path
    from megascale.train.memory_snapshot import SnapshotStore
    from megascale.train.run import run_rank

    rank = int(os.environ["RANK"])
    resident = Resident(Path(os.environ[REJOIN_DIR_ENV]), rank)
    memory = SnapshotStore(snapshot_interval(job), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    while True:
        generation = int(os.environ.get("MEGASCALE_GENERATION", "0"))
        resident.training = True
        try:
            run_rank(job, run_dir, memory=memory)
            resident.training = False
            return
        except BaseException as e:
            resident.training = False
            if not recoverable(e):
                raise
            if not isinstance(e, Paused):  # as an exit would show it: the agent reads the
                traceback.print_exception(e)  # peer's failure in it and reports it at once
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
            traceback.clear_frames(e.__traceback__)  # the dead generation's trainer goes now
            del e
        memory.detach()
        release_model_caches()  # the last reference to the model, its groups with it
        try:
            destroy_groups()
        except Exception as e:  # a broken group may refuse an orderly end; it is dropped anyway
            logger.info("tearing down the process groups: %s", e)
        # The last generation's progress (same pid) must not be read as the next one's: its step
        # would be followed by the step 0 of the rejoined rank's start, a step backwards.
        progress_path(run_dir, rank).unlink(missing_ok=True)
        resident.wait_for_rejoin(generation, reason, before_waiting=gc.collect)
