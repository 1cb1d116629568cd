"""In-memory snapshots of a rank's training state, with a copy in a peer node's host memory.

What in-process recovery (``megascale.train.resident``) rolls back to. Every
``fault_tolerance.snapshot_interval`` steps each rank copies what it alone holds of the training
state into a host buffer: the tensors of ``checkpoint.shards.training_entries(saving=True)`` (its
model parameters, or with the distributed optimizer its updated range of them, the fp32 main
parameters and the optimizer moments), and its small state (step, scheduler, data position,
optimizer step count, RNG), the same things a checkpoint holds. The two newest snapshots are kept
(a fault may strike between one rank's snapshot and another's, so the ranks agree on one both
hold). A background thread then sends the snapshot to the rank ``nproc_per_node`` ranks on (the
same local rank of the next node, so never a rank of the same node) and receives the previous
node's, over a process group of its own, with no collective on the training path: a lost node's
ranks come back from their peers' memory, without reading storage.

Restore (``SnapshotStore.restore``, collective, in a freshly built trainer of the same layout):
the ranks agree on the newest step every rank can reach (its own snapshot, or the copy a peer
holds), newer than the newest complete checkpoint; peers send their copies to the ranks that lost
theirs; each rank copies its buffer into the live tensors in the order it was taken, and with the
distributed optimizer the parameters are all-gathered. ``None`` when there is no such step:
the caller resumes from storage.

Why not a torch DCP checkpoint in memory: the state never changes layout here (a layout change
falls back to storage), so a flat byte buffer per rank in a fixed order is all a restore needs,
and it is one host copy and one send per snapshot.
"""

from __future__ import annotations

import io
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megascale.train.checkpoint.storage import HostCopier

if TYPE_CHECKING:
    from megascale.train.trainer import Trainer

logger = logging.getLogger("megascale.snapshot")

ALIGN = 16  # bytes: each tensor starts where any dtype's view of the buffer may start
KEEP = 2


@dataclass
class Snapshot:
    step: int
    payload: torch.Tensor  # uint8, host memory: every tensor of the state, in order, aligned
    small: dict  # the small state: {"common": ..., "rng": ...}
    ready: torch.cuda.Event | None = None
    """From a GPU: recorded after the copy into ``payload`` (on the copy stream); None: the
    payload is complete (a CPU copy, or a copy received from a peer)."""

    def landed(self) -> Snapshot:
        """This snapshot, once its payload is all in host memory (blocks on a copy in flight)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self


def _tensors(trainer: Trainer) -> list[torch.Tensor]:
    from megascale.train.checkpoint.shards import training_entries

    return [t for e in training_entries(trainer, saving=True) for _, t in e.pieces]


def _span(tensor: torch.Tensor) -> int:
    n = tensor.numel() * tensor.element_size()
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _views(payload: torch.Tensor, sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each source's place in ``payload``, as a view of its dtype."""
    views, offset = [], 0
    for t in sources:
        n = t.numel() * t.element_size()
        views.append(payload[offset : offset + n].view(t.dtype))
        offset += _span(t)
    return views


def _small_state(trainer: Trainer) -> dict:
    """The step, schedule, data position, optimizer step count and RNG: fresh objects, never
    the live ones (serialized only to travel, off the training path)."""
    from megascale.train.checkpoint.save import _common_state
    from megascale.train.checkpoint.storage import rng_state

    return {"common": _common_state(trainer), "rng": _cloned(rng_state())}


def _cloned(state):
    """``state`` with every tensor copied (an RNG tracker hands out its live state tensors)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _cloned(v) for k, v in state.items()}
    return state


def _small_bytes(small: dict) -> torch.Tensor:
    out = io.BytesIO()
    torch.save(small, out)
    return torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)


def _small_from(data: torch.Tensor) -> dict:
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


def _apply_small(trainer: Trainer, state: dict) -> None:
    from megascale.train.checkpoint.save import _apply_common
    from megascale.train.checkpoint.storage import set_rng_state

    _apply_common(trainer, state["common"])
    set_rng_state(state["rng"])


class SnapshotStore:
    """This process's snapshots, and the copies it holds for its peer (see the module).

    Outlives the trainers of one process: ``attach`` binds it to a generation's trainer (and
    starts the exchange with the peer), ``detach`` stops the exchange before the process groups
    are torn down; ``take`` snapshots after a step, ``restore`` loads into a new trainer."""

    def __init__(self, interval: int, local_world: int) -> None:
        self.interval, self.local_world = max(1, interval), max(1, local_world)
        self.own: list[Snapshot] = []  # newest last
        self.held: dict[int, list[Snapshot]] = {}  # rank -> the copies of its snapshots
        self.take_s = 0.0  # the training stall of the latest snapshot
        self._group: dist.ProcessGroup | None = None
        self._peers: tuple[int, int] | None = None  # (to, from)
        self._pending: Snapshot | None = None
        self._busy = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._epoch = 0  # one per attach: an exchange of a dead generation stores nothing
        self._plan: tuple[weakref.ref, list[torch.Tensor], int] | None = None
        self._targets: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._stream: torch.cuda.Stream | None = None  # a GPU's copies to host memory
        self.checkpoint_copier = HostCopier()
        """The checkpoint's stage-1 host buffers, kept across generations like the snapshots: a
        rejoining rank's checkpointer allocates none (``checkpoint.Checkpointer``)."""

    # -- binding to a generation ------------------------------------------------------------

    def attach(self, rank: int, world: int) -> None:
        """Collective: the group the copies travel over (gloo, host memory), and this rank's
        peers: it sends to ``rank + nproc_per_node`` and receives from ``rank - nproc_per_node``
        (none on a single node)."""
        group = dist.new_group(backend="gloo")
        with self._busy:
            self._epoch += 1
            self._group, self._closed, self._pending = group, False, None
            if world > self.local_world:
                self._peers = ((rank + self.local_world) % world, (rank - self.local_world) % world)
                self._thread = threading.Thread(
                    target=self._exchange_loop,
                    args=(self._epoch,),
                    name="megascale::snapshot::peer",
                    daemon=True,
                )
                self._thread.start()

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait for the copy in flight (the end of training: every rank's peer is sending too)."""
        with self._busy:
            self._busy.wait_for(lambda: self._pending is None or self._closed, timeout_s)

    def detach(self, timeout_s: float = 0.05) -> None:
        """Stop the exchange. A copy cut short by a fault is dropped; its thread, waiting on a
        peer that is gone, ends when that peer's connection closes, and stores nothing."""
        if self._stream is not None:  # a GPU copy still reading the trainer's tensors lands
            self._stream.synchronize()  # before they are freed (and reused by the next trainer)
        with self._busy:
            self._closed, self._pending = True, None
            self._epoch += 1
            self._busy.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._thread, self._group, self._peers = None, None, None
        self._plan, self._targets = None, {}  # nothing of the dead generation's trainer is kept

    # -- taking --------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    @torch.no_grad()
    def take(self, trainer: Trainer) -> float:
        """Snapshot the trainer's current step into host memory; returns the stall (s).

        From a GPU the copy runs on a stream of its own, beside the next step's forward and
        backward, which only read the state: the step's update waits for it
        (``Trainer.reading_state``), and whoever reads the payload waits for ``Snapshot.ready``.
        The stall is then the time to issue the copies."""
        start = time.perf_counter()
        with self._busy:  # the oldest buffer may still be on its way to the peer
            while self._pending is not None and not self._closed:
                self._busy.wait(0.05)
        sources, total = self._sources(trainer)
        reuse = self.own.pop(0) if len(self.own) >= KEEP else None
        if reuse is not None and reuse.payload.numel() == total:
            payload = reuse.payload
        else:
            pin = any(t.is_cuda for t in sources)
            payload = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        targets = self._targets.pop(id(reuse.payload), None) if reuse is not None else None
        if targets is None or targets[0] is not payload:
            targets = (payload, _views(payload, sources))
        self._targets[id(payload)] = targets
        ready = None
        if payload.is_pinned():  # from a GPU
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())  # after the step's update
            with torch.cuda.stream(self._stream):
                torch._foreach_copy_(targets[1], sources, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
            trainer.reading_state(ready)
        else:
            torch._foreach_copy_(targets[1], sources)
        snapshot = Snapshot(trainer.step_num, payload, _small_state(trainer), ready)
        self.own.append(snapshot)
        with self._busy:
            if self._peers is not None and not self._closed:
                self._pending = snapshot
                self._busy.notify_all()
        self.take_s = time.perf_counter() - start
        return self.take_s

    def _sources(self, trainer: Trainer) -> tuple[list[torch.Tensor], int]:
        """The flat views of what ``take`` copies, and their bytes with alignment; found once per
        trainer (the views stay valid: the optimizer updates its tensors in place)."""
        cached = self._plan
        if cached is None or cached[0]() is not trainer:
            sources = [t.reshape(-1) for t in _tensors(trainer)]
            self._plan = cached = (weakref.ref(trainer), sources, sum(_span(t) for t in sources))
            self._targets = {}
        return cached[1], cached[2]

    def _exchange_loop(self, epoch: int) -> None:
        """Send each new snapshot to the next node's peer, receive the previous node's."""
        while True:
            with self._busy:
                self._busy.wait_for(lambda: self._pending is not None or self._epoch != epoch)
                if self._epoch != epoch:
                    return
                snapshot, group, peers = self._pending, self._group, self._peers
            try:
                held = _swap(snapshot.landed(), group, *peers)
            except Exception as e:  # a peer died: the fault is the training path's to report
                logger.info("snapshot copy to rank %d stopped: %s", peers[0], e)
                held = None
            with self._busy:
                if self._epoch != epoch:
                    return
                if held is not None:
                    copies = self.held.setdefault(peers[1], [])
                    copies[:] = [c for c in copies if c.step != held.step][-(KEEP - 1) :] + [held]
                self._pending = None
                self._busy.notify_all()
                if held is None:
                    return

    # -- restoring -----------------------------------------------------------------------------

    @torch.no_grad()
    def restore(self, trainer: Trainer, newest_checkpoint: int | None) -> tuple[int, str] | None:
        """Load the newest snapshot every rank can reach into ``trainer`` (built fresh, same
        layout as when taken). Collective. Returns (step, where this rank's came from), or None
        (every rank alike) when no step newer than ``newest_checkpoint`` is held for every
        rank: resume from storage then."""
        world, rank = dist.get_world_size(), dist.get_rank()
        mine = {
            "own": [s.step for s in self.own],
            "held": {r: [s.step for s in c] for r, c in self.held.items()},
        }
        everyone: list[dict] = [{}] * world
        dist.all_gather_object(everyone, mine)
        plan = restore_plan(everyone, newest_checkpoint)
        if plan is None:
            return None
        step, reach = plan
        snapshot = self._gather(step, reach, rank, world)
        tensors = _tensors(trainer)
        total = sum(_span(t) for t in tensors)
        if snapshot.payload.numel() != total:
            raise RuntimeError(
                f"snapshot of step {step} holds {snapshot.payload.numel()} bytes; this rank's "
                f"state takes {total}: not the layout it was taken at"
            )
        targets = [t.view(-1) for t in tensors]  # the live tensors, in the order taken
        torch._foreach_copy_(targets, _views(snapshot.payload, targets))
        _sync_parameters(trainer)
        _apply_small(trainer, snapshot.small)
        where = "own memory" if reach[rank][step] == rank else f"rank {reach[rank][step]}'s memory"
        return step, where

    def _gather(self, step: int, reach: list[dict[int, int]], rank: int, world: int) -> Snapshot:
        """This rank's snapshot of ``step``: its own, or sent by the peer holding a copy."""
        sends = [(of, holder) for of in range(world) if (holder := reach[of][step]) != of]
        mine = None
        for of, holder in sends:  # the same order on every rank: no send waits on another
            if holder == rank:  # over the snapshots' own gloo group: host memory, on NCCL too
                copy = next(c for c in self.held[of] if c.step == step)
                _send(copy, of, self._group)
            elif of == rank:
                mine = _recv(holder, self._group)
        if mine is None:
            mine = next(s for s in self.own if s.step == step).landed()
        self.own = [mine]  # what is newer is abandoned; what is older is not needed
        self.held = {}
        return mine


def restore_plan(
    everyone: list[dict], newest_checkpoint: int | None
) -> tuple[int, list[dict[int, int]]] | None:
    """The step to restore and, per rank, step -> the rank holding its snapshot of it (itself,
    or the peer holding its copy), from every rank's ``{"own": [steps], "held": {rank: [steps]}}``;
    None when no step at least as new as ``newest_checkpoint`` is within every rank's reach."""
    reach: list[dict[int, int]] = [{s: r for s in e["own"]} for r, e in enumerate(everyone)]
    for holder, e in enumerate(everyone):
        for of, steps in e["held"].items():
            for s in steps:
                reach[int(of)].setdefault(s, holder)  # its own copy first, else the holder's
    common = set.intersection(*(set(r) for r in reach))
    floor = -1 if newest_checkpoint is None else newest_checkpoint
    step = max((s for s in common if s >= floor), default=None)
    return None if step is None else (step, reach)


def _sync_parameters(trainer: Trainer) -> None:
    """The model parameters from the restored state: the fp32 main parameters copied down, and
    with the distributed optimizer each rank's updated range all-gathered. Collective."""
    for inner in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        if hasattr(inner, "_copy_main_params_to_model_params"):
            inner._copy_main_params_to_model_params()
    for chunk in trainer.model:
        config = getattr(chunk, "ddp_config", None)
        if config is not None and config.use_distributed_optimizer:
            chunk.start_param_sync(force_sync=True)


def _header(snapshot: Snapshot, small: torch.Tensor) -> torch.Tensor:
    return torch.tensor([snapshot.step, snapshot.payload.numel(), small.numel()])


RESTORE_TAG = 8
"""The tag of a restore's sends (the exchange thread's copies use tags 0-2 on the same group)."""


def _send(snapshot: Snapshot, to: int, group: dist.ProcessGroup | None) -> None:
    """Send ``snapshot`` to global rank ``to`` over ``group`` (host tensors: a gloo group)."""
    small = _small_bytes(snapshot.small)
    for tensor in (_header(snapshot, small), snapshot.payload, small):
        dist.send(tensor, to, group=group, tag=RESTORE_TAG)


def _recv(source: int, group: dist.ProcessGroup | None) -> Snapshot:
    header = torch.zeros(3, dtype=torch.int64)
    dist.recv(header, source, group=group, tag=RESTORE_TAG)
    step, size, small_size = (int(x) for x in header)
    payload = torch.empty(size, dtype=torch.uint8)
    small = torch.empty(small_size, dtype=torch.uint8)
    dist.recv(payload, source, group=group, tag=RESTORE_TAG)
    dist.recv(small, source, group=group, tag=RESTORE_TAG)
    return Snapshot(step, payload, _small_from(small))


def _swap(snapshot: Snapshot, group: dist.ProcessGroup, to: int, source: int) -> Snapshot:
    """Send ``snapshot`` to rank ``to`` and receive rank ``source``'s, over ``group`` (the
    ranks' process group of their own: this runs beside the training path's collectives)."""
    small = _small_bytes(snapshot.small)
    header = torch.zeros(3, dtype=torch.int64)
    works = [group.send([_header(snapshot, small)], _group_rank(group, to), 0)]
    group.recv([header], _group_rank(group, source), 0).wait()
    step, size, small_size = (int(x) for x in header)
    payload = torch.empty(size, dtype=torch.uint8)
    small_in = torch.empty(small_size, dtype=torch.uint8)
    works += [
        group.send([snapshot.payload], _group_rank(group, to), 1),
        group.send([small], _group_rank(group, to), 2),
    ]
    group.recv([payload], _group_rank(group, source), 1).wait()
    group.recv([small_in], _group_rank(group, source), 2).wait()
    for work in works:
        work.wait()
    return Snapshot(step, payload, _small_from(small_in))


def _group_rank(group: dist.ProcessGroup, rank: int) -> int:
    return dist.get_group_rank(group, rank)
