"""MegaScale's per-machine data pipeline: one loader per machine, batches in shared memory.

``data.loader = "node"`` (``NodeBatches``): the lowest global rank of each machine (the *leader*)
reads the next step's samples of every data-parallel rank that has a rank on its machine into a
shared-memory segment, in a background thread, while the current step computes and synchronises
gradients; every rank of the machine copies its own micro-batches out of the segment. The TP and PP
peers of a data-parallel rank (same samples) therefore cost one dataset read per machine instead of
one each, and no rank but the leader shuffles or reads tokens on the training thread.
``data.loader = "rank"`` is ``dataset.ShardedBatches``: every rank reads its own samples.

Both give the same micro-batches, bit for bit: the leader fills a data-parallel rank's block with
``ShardedBatches.sample_indices`` of that rank, collated with ``dataset.collate``.

Segment. A file ``megascale-data-<pid>-<random>`` in ``/dev/shm`` (the temporary directory where
there is no ``/dev/shm``), sized for two steps (double buffering): a header (one "which step is in
this slot" tag per slot, one "finished reading step" tag per rank of the machine) then two slots of
one block per data-parallel rank on the machine, each block every micro-batch key's array.

Lifetime. The leader creates the file, every rank of the machine maps it, and once all have (a
barrier) the leader *unlinks* it: from then on the memory has no name and the kernel frees it when
the last process of the machine that maps it exits, killed or not. Nothing is left in /dev/shm by
a crash after start-up; a file left by a leader killed inside that start-up window is removed by
the next leader on the machine (``sweep_stale``: files whose creator pid no longer runs). A restarted
worker group maps a new segment, so it cannot read a step of the old one; every read also checks
the slot's tag against the step it expects.

Synchronisation is through the header, not collectives (the training thread's collective order is
untouched): a slot is written only once every rank of the machine has finished reading the step it
held, and read only once its tag names the expected step. A waiting rank polls with a short sleep
and raises ``LoaderError`` if the process it waits for has died.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megascale.data.dataset import ShardedBatches, collate

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "megascale-data-"
_SLOTS = 2
_ALIGN = 64


class LoaderError(RuntimeError):
    """The per-machine loader cannot go on (its leader or a reader of its segment died)."""


def shm_dir() -> Path:
    """Where segments are created: /dev/shm when present, else the temporary directory."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_segments(directory: Path | None = None) -> list[Path]:
    """Segment files whose creator process no longer runs on this machine (leaked)."""
    stale = []
    for path in (directory or shm_dir()).glob(f"{SEGMENT_PREFIX}*"):
        try:
            pid = int(path.name.removeprefix(SEGMENT_PREFIX).split("-")[0])
        except ValueError:
            continue
        if not _alive(pid):
            stale.append(path)
    return stale


def sweep_stale(directory: Path | None = None) -> list[Path]:
    """Remove ``stale_segments``; returns them."""
    stale = stale_segments(directory)
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def _no_segment(path: Path, size: int, error: OSError) -> LoaderError:
    """The one-line LoaderError when the segment cannot be created or reserved: the path, the
    bytes it needs, the bytes free there, and the cause with its errno."""
    try:
        st = os.statvfs(path.parent)
        free = f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    cause = f"{os.strerror(error.errno)} ({errno.errorcode.get(error.errno, error.errno)})"
    return LoaderError(
        f"data.loader = 'node': cannot reserve {path}: it needs {size / 2**20:.1f} MiB "
        f"({size} bytes), {path.parent} has {free}: {cause if error.errno else error}; give "
        f"{path.parent} more room (a memory-backed volume in a container) or set "
        'data.loader = "rank"'
    )


def _layout(sample: Mapping[str, torch.Tensor], per_rank: int) -> list[tuple[str, str, tuple]]:
    """(key, numpy dtype, shape of one data-parallel rank's block) per micro-batch key."""
    batch = collate([sample])
    return [(key, str(t.numpy().dtype), (per_rank, *t.shape[1:])) for key, t in batch.items()]


def _nbytes(dtype: str, shape: tuple) -> int:
    n = int(np.dtype(dtype).itemsize * np.prod(shape))
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Segment:
    """Typed views of a mapped segment: ``tags`` (int64 [slots]), ``done`` (int64 [readers]) and
    ``block(slot, i)`` -> {key: array} for the i-th data-parallel rank on the machine."""

    def __init__(self, buf: mmap.mmap, layout: list, readers: int, blocks: int) -> None:
        self.buf = buf
        self.tags = np.frombuffer(buf, np.int64, _SLOTS, 0)
        self.done = np.frombuffer(buf, np.int64, readers, _SLOTS * 8)
        self.layout = layout
        self.header = _nbytes("int64", (_SLOTS + readers,))
        self.block_bytes = sum(_nbytes(d, s) for _, d, s in layout)
        self.slot_bytes = self.block_bytes * blocks

    @staticmethod
    def size(layout: list, readers: int, blocks: int) -> int:
        """Bytes of a segment: the header, then two slots of ``blocks`` blocks."""
        header = _nbytes("int64", (_SLOTS + readers,))
        return header + _SLOTS * blocks * sum(_nbytes(d, s) for _, d, s in layout)

    def block(self, slot: int, index: int) -> dict[str, np.ndarray]:
        offset = self.header + slot * self.slot_bytes + index * self.block_bytes
        out = {}
        for key, dtype, shape in self.layout:
            out[key] = np.ndarray(shape, dtype, self.buf, offset)
            offset += _nbytes(dtype, shape)
        return out


def train_batches(
    job, dataset, dp_rank: int, dp_size: int, needs_tokens: bool = True
) -> ShardedBatches:
    """The train split's batches as ``data.loader`` asks: ``NodeBatches`` ("node", collective
    when torch.distributed is initialised) or ``ShardedBatches`` ("rank"). ``needs_tokens``:
    False for a middle pipeline stage (see ``NodeBatches``)."""
    from megascale.probes.timers import node_name

    t = job.train
    args = (dataset, t.global_batch_size, t.micro_batch_size, dp_rank, dp_size, t.seed)
    if job.data.loader == "node" and dist.is_initialized():
        return NodeBatches(*args, node=node_name(), needs_tokens=needs_tokens)
    return ShardedBatches(*args)


class NodeBatches(ShardedBatches):
    """``ShardedBatches`` served from one loader per machine (module docstring). Same contract:
    ``next_step()`` once per optimizer step, ``state_dict``/``load_state_dict`` (call
    ``load_state_dict`` before the first ``next_step``). Collective construction: every rank of
    the job constructs one at the same point (two ``all_gather_object``, two barriers); when a
    machine's leader cannot create its segment, every rank raises its ``LoaderError``.

    ``dataset`` is read only on the leader (it may be None elsewhere). ``node`` names this
    rank's machine (ranks with equal names share a segment). ``needs_tokens=False`` (a pipeline
    stage that is neither first nor last: megatron-core feeds it the previous stage's
    activations, and only the last stage computes a loss) gets empty micro-batch dicts, and its
    data-parallel rank's samples are read only if another rank of the machine needs them.
    """

    def __init__(self, dataset, global_batch_size, micro_batch_size, dp_rank, dp_size, seed, *,
                 node: str, needs_tokens: bool = True, group=None) -> None:  # fmt: skip
        super().__init__(dataset, global_batch_size, micro_batch_size, dp_rank, dp_size, seed)
        per_rank = global_batch_size // dp_size
        peers: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(peers, (node, dp_rank, os.getpid(), needs_tokens), group=group)
        me = dist.get_rank(group)
        members = [r for r, p in enumerate(peers) if p[0] == node]
        readers = [r for r in members if peers[r][3]]
        self.leader = me == members[0]
        self.needs_tokens = needs_tokens
        self.reader_index = readers.index(me) if needs_tokens else -1
        self.member_pids = [peers[r][2] for r in members]
        self.reader_pids = [peers[r][2] for r in readers]
        self.block_dp = sorted({peers[r][1] for r in readers})
        """Data-parallel ranks whose samples this machine's segment holds, in block order."""
        offer = None
        if self.leader:
            try:
                offer = self._create(_layout(dataset[0], per_rank), len(readers))
            except LoaderError as e:  # offered as its line: no rank waits on a leader gone
                offer = str(e)
        offers: list = [None] * len(peers)
        dist.all_gather_object(offers, offer, group=group)
        for failed in (o for o in offers if isinstance(o, str)):
            raise LoaderError(failed)  # every rank of the job, with the same line
        path, layout = offers[members[0]]
        if not self.leader:
            self._map(path, layout, len(readers))
        dist.barrier(group=group)
        if self.leader:
            os.unlink(path)  # every rank of the machine maps it: the kernel frees it with the last
        dist.barrier(group=group)  # on return the segment has no name on any machine
        self.segment_bytes = _Segment.size(layout, len(readers), len(self.block_dp))
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None

    def _create(self, layout: list, readers: int) -> tuple[str, list]:
        directory = shm_dir()
        for stale in sweep_stale(directory):
            logger.warning("removed %s, left by a data loader that no longer runs", stale)
        path = directory / f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        size = _Segment.size(layout, readers, len(self.block_dp))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise _no_segment(path, size, e) from e
        try:
            os.posix_fallocate(fd, 0, size)  # no space: an error now, not SIGBUS on a write
            buf = mmap.mmap(fd, size)
        except OSError as e:
            path.unlink(missing_ok=True)
            raise _no_segment(path, size, e) from e
        finally:
            os.close(fd)
        self.segment = _Segment(buf, layout, readers, len(self.block_dp))
        return os.fspath(path), layout

    def _map(self, path: str, layout: list, readers: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            buf = mmap.mmap(fd, _Segment.size(layout, readers, len(self.block_dp)))
        finally:
            os.close(fd)
        self.segment = _Segment(buf, layout, readers, len(self.block_dp))

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches for the next step, copied out of the segment; advances the
        state. On the leader, starts preparing the step after it."""
        start = self.consumed_samples
        serving = self.leader and bool(self.block_dp)  # some rank of the machine needs tokens
        if serving:
            self._join()
            if self.segment.tags[self._slot(start)] != start + 1:
                self._fill(start)  # nothing prefetched (first step, or after load_state_dict)
        if self.needs_tokens:
            batches = self._read(start)
        else:
            batches = [{} for _ in range(self.num_micro_batches)]
        self.step += 1
        self.consumed_samples += self.global_batch_size
        if serving:
            self._thread = threading.Thread(
                target=self._prefetch, args=(self.consumed_samples,), daemon=True,
                name="megascale-node-loader",
            )  # fmt: skip
            self._thread.start()
        return batches

    def _read(self, start: int) -> list[dict[str, torch.Tensor]]:
        """Copies of this rank's micro-batches of the step at ``start``, once the slot has it."""
        tag, slot = start + 1, self._slot(start)
        self._wait(lambda: self.segment.tags[slot] == tag, self.member_pids[0], "the leader")
        block = self.segment.block(slot, self.block_dp.index(self.dp_rank))
        mbs = self.micro_batch_size
        batches = [
            {key: torch.from_numpy(a[j : j + mbs].copy()) for key, a in block.items()}
            for j in range(0, len(next(iter(block.values()))), mbs)
        ]
        if self.segment.tags[slot] != tag:
            raise LoaderError(f"step at sample {start}: slot {slot} was rewritten while read")
        self.segment.done[self.reader_index] = tag
        return batches

    def _slot(self, start: int) -> int:
        return (start // self.global_batch_size) % _SLOTS

    def _prefetch(self, start: int) -> None:
        try:
            self._fill(start)
        except BaseException as e:  # raised on the training thread by the next next_step
            self._error = e

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise LoaderError(f"the per-machine data loader failed: {error}") from error

    def _fill(self, start: int) -> None:
        """Write the step starting at global sample ``start`` into its slot, once every rank of
        the machine has finished reading the step the slot held."""
        slot = self._slot(start)
        held = int(self.segment.tags[slot])
        for i, pid in enumerate(self.reader_pids):
            self._wait(lambda i=i: self.segment.done[i] >= held, pid, f"rank pid {pid}")
        self.segment.tags[slot] = 0  # invalid while written
        for index, dp_rank in enumerate(self.block_dp):
            batch = collate([self.dataset[i] for i in self.sample_indices(start, dp_rank)])
            for key, array in self.segment.block(slot, index).items():
                array[...] = batch[key].numpy()
        self.segment.tags[slot] = start + 1  # written after the data: readers may take it

    def _wait(self, ready, pid: int, who: str) -> None:
        """Poll ``ready`` (sleeps 10 us doubling to 2 ms, 50 ms after a second of waiting)."""
        delay, since = 1e-5, time.monotonic()
        while not ready():
            if not _alive(pid):
                raise LoaderError(f"per-machine data loader: {who} (pid {pid}) has exited")
            if self._stop.is_set():
                raise LoaderError("per-machine data loader closed")
            time.sleep(delay)
            delay = min(delay * 2, 2e-3 if time.monotonic() - since < 1.0 else 0.05)

    def close(self) -> None:
        """Stop the prefetch thread (a step it was preparing is dropped). The segment's memory
        is released when the last process of the machine that maps it exits."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._error = None
