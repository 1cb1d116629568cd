"""Flight recorder, the worker's side: every collective and p2p op this rank issues, written to a
ring in a memory-mapped file that the node agent reads without the worker's cooperation.

The file's byte layout, the reader (``last_state``, ``read_records``) and the stall analysis
(``stall_suspects``) are in ``megascale.probes.flight.format`` and ``flight.culprits``, which do
not import torch.

``FlightRecorder(path, rank, world).install()`` wraps torch.distributed's collective and p2p
functions (under both ``torch.distributed`` and ``distributed_c10d`` names, so that object
collectives and calls between c10d functions are seen too), ``batch_isend_irecv`` and
megatron-core's import-time aliases (``megascale.parallel.comm_hooks``). Per op it writes one
record when the op is entered, and updates its state in place when the op returns (synchronous
ops) or when its handle's ``wait()`` is called and returns (asynchronous ones): a few
``struct.pack_into`` calls into the mmap, no syscall, no fsync. The wrappers themselves are in
``megascale.probes.flight.hooks``. An op re-entered through ``handle_torch_function`` (the CPU
backend's TorchFunctionMode) or called by another c10d function is counted once, by the outermost
call. Ops issued inside megatron-core's ``_coalescing_manager``
(a DP bucket group) are one record of ``count`` ops; each op of a ``batch_isend_irecv`` is its own
record. Sequence numbers count calls per process group (p2p: per pair of ranks on a group), so
every member numbers the same call alike.

On CUDA, "left" means the host returned from the call or from ``wait()``; with
``TORCH_NCCL_BLOCKING_WAIT=1`` that is when the collective completed, otherwise the GPU may still be
running it and a hang shows up at the next host synchronisation. The device's view comes from
timing events taken from a pool (``start_event``): one recorded on the current stream before the
op and one after a synchronous op (an asynchronous op's NCCL ``Work`` stands for the one after);
the watcher polls them, so the record gets the op's device start and completion, with the duration
the events measured (``flight.watcher.DeviceSpan``). Ops inside a coalescing block and the ops of a
``batch_isend_irecv`` get no start event (their completion only, as before).

The timeline (``megascale.probes.timers``) reads its communication segments from these
records when a recorder is installed (``installed_recorder``, ``FlightRecorder.copy``), so each
call is wrapped once: the recorder also keeps, in memory only, when each asynchronous op's
``wait()`` was called (the start of the interval its caller was blocked).
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import struct
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megascale import runfiles
from megascale.parallel.comm_hooks import CommWrapper, Patches
from megascale.probes.flight.format import (
    GROUP_HEAD,
    HEADER,
    MAGIC,
    NO_PEER,
    OFF_DEVICE,
    OFF_DONE,
    OFF_GROUPS_USED,
    OFF_LEAVE,
    OFF_SECTION,
    OFF_START,
    OFF_STATE,
    OFF_STEP,
    OFF_WRITE_INDEX,
    RECORD,
    RUN,
    VERSION,
    DeviceState,
    OpState,
    flight_path,
    proc_stat,
    runs_of,
)
from megascale.probes.flight.hooks import (
    CallState,
    _OpWrapper,
    batch_wrapper,
    coalescing_wrapper,
    op_wrappers,
)
from megascale.probes.flight.watcher import CompletionWatcher, DeviceSpan, EventPool

logger = logging.getLogger(__name__)

__all__ = [
    "FlightRecorder",
    "NullFlightRecorder",
    "RingCopy",
    "flight_path",
    "installed_recorder",
    "open_recorder",
]

DEFAULT_CAPACITY = 4096
DEFAULT_GROUP_TABLE_BYTES = 64 * 1024
# Hot-path constants bound once (an enum member or module attribute read costs as much as the
# struct call it feeds).
_ENTERED, _WAITING, _LEFT = int(OpState.ENTERED), int(OpState.WAITING), int(OpState.LEFT)
_COMPLETED = int(DeviceState.COMPLETED)  # and FAILED above it: the device's final states
_U64, _F64, _U32, _STEP = struct.Struct("<Q"), struct.Struct("<d"), struct.Struct("<I"), "<qdd"
_pack_record, _pack_u64, _pack_f64 = RECORD.pack_into, _U64.pack_into, _F64.pack_into
_RECORD_SIZE = RECORD.size
_monotonic = time.monotonic


# -- writer ----------------------------------------------------------------------------------------


@dataclass
class Channel:
    """A process group (or p2p pair) as the recorder numbers its ops."""

    gid: int
    offset: int  # of its group-table entry in the file; -1 when the table was full
    seq: int = 0
    kind: str = "other"  # dp, pp, tp or other (``group_kind``)
    blocked_s: float = 0.0  # time callers were blocked in its ops


def group_kind(label: str) -> str:
    """``dp``, ``pp``, ``tp`` or ``other`` for a group's description (megatron-core's
    ``group_desc``, e.g. ``TENSOR_MODEL_PARALLEL_GROUP``; ``p2p `` + it for a p2p channel)."""
    label = label.upper()
    if "TENSOR" in label and "PIPELINE" not in label and "DATA" not in label:
        return "tp"
    if "PIPELINE" in label and "TENSOR" not in label:
        return "pp"
    if "DATA_PARALLEL" in label and "TENSOR" not in label and "PIPELINE" not in label:
        return "dp"
    return "other"


@dataclass(frozen=True)
class RingCopy:
    """Records ``first`` .. ``first + n - 1`` of a recorder's ring as they were when copied
    (``FlightRecorder.copy``): their bytes in the file's layout and, per record, when its
    ``wait()`` was called (monotonic seconds; stale, i.e. before the record's ``enter_mono``, when
    it was never called)."""

    first: int
    data: bytes
    wait_mono: array

    def __len__(self) -> int:
        return len(self.wait_mono)

    def records(self) -> Iterator[tuple[tuple, float]]:
        """(the record's fields as ``RECORD`` unpacks them, its wait time), oldest first."""
        return zip(RECORD.iter_unpack(self.data), self.wait_mono, strict=True)


class FlightRecorder:
    """This rank's flight recorder: ``install()`` once per process (it imports megatron-core's
    modules to re-point their aliases), ``set_step`` at each step, ``close()`` at the end (the file
    stays, for the agent and for post-mortems). A new recorder on the same path replaces the file.
    With ``path=None`` the ring lives in anonymous memory: same records, same watcher, no file
    (the timeline's own recorder in a process without a run directory's recorder).

    Thread-safe. Cost per op: a handful of ``struct.pack_into`` calls and two clock reads. Records
    of ops still in flight when the recorder is closed stay in their last state.
    """

    def __init__(
        self,
        path: Path | str | None,
        rank: int,
        world_size: int,
        *,
        capacity: int = DEFAULT_CAPACITY,
        group_table_bytes: int = DEFAULT_GROUP_TABLE_BYTES,
        follow_device: bool = True,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: the ring needs at least 1 slot")
        if group_table_bytes < GROUP_HEAD.size or group_table_bytes % 8:
            raise ValueError(
                f"group_table_bytes={group_table_bytes}: want a multiple of 8, >= {GROUP_HEAD.size}"
            )
        self.path = None if path is None else Path(path)
        self.rank, self.capacity = rank, capacity
        self._table_bytes = group_table_bytes
        self._ring = HEADER.size + group_table_bytes
        size = self._ring + capacity * RECORD.size
        self._mm = _map(self.path, size)
        pid = os.getpid()
        HEADER.pack_into(
            self._mm, 0, MAGIC, VERSION, HEADER.size, RECORD.size, capacity, group_table_bytes,
            rank, world_size, pid, _proc_start(pid), time.time(), 0, 0, 0, 0.0, 0.0, b"init",
        )  # fmt: skip
        if self.path is not None:
            os.replace(_tmp_path(self.path), self.path)  # readers see a complete header or no file
        self.step = 0
        self._wall_offset = time.time() - time.monotonic()
        self._next = 0
        self._groups_used = 0
        self._groups: dict[object, Channel | None] = {}
        self._lock = threading.Lock()
        self.local = CallState()
        self.active = False
        self._patches = Patches()
        self._table_full_warned = False
        self._wait_mono = array("d", bytes(8 * capacity))  # per slot; see RingCopy
        self._watcher = CompletionWatcher(self.device)
        self.follow_device = follow_device
        """False: the host's view only (``track`` follows nothing, no watcher thread polls): for a
        reader that needs no device state, such as the comm trace's own recorder."""
        self._cuda = False
        self._events = EventPool(lambda: torch.cuda.Event(enable_timing=True))
        self.blocked_s = 0.0
        """Seconds spent blocked in synchronous ops and ``wait()`` (on CPU the trainer's
        ``ComputeMeter`` subtracts what falls inside a compute span)."""
        self._channels: list[Channel] = []

    def blocked_by_group(self) -> dict[str, float]:
        """``blocked_s`` split by group kind (``group_kind``): totals since install; kinds with
        no op yet are absent. Cheap: one pass over this rank's channels (a few dozen)."""
        out: dict[str, float] = {}
        for channel in list(self._channels):
            out[channel.kind] = out.get(channel.kind, 0.0) + channel.blocked_s
        return out

    @property
    def written(self) -> int:
        """Records written so far (the ring keeps the last ``capacity``)."""
        return self._next

    # -- what the trainer calls ----------------------------------------------------------------

    def install(self) -> FlightRecorder:
        """Start recording this process's communication (patches torch.distributed); once."""
        wrappers = op_wrappers(self)
        self.active = True
        from megascale.parallel import cpu_backend

        self._cuda = torch.cuda.is_available() and not cpu_backend.is_active()
        if self._cuda:  # nothing is followed yet: the wrappers are installed below
            # Not notified: a NCCL Work's future completes before the kernel. Polled on this rank's
            # GPU, the one init_distributed makes current (LOCAL_RANK), which may not be yet.
            device = int(os.environ.get("LOCAL_RANK", "0"))
            self._watcher = CompletionWatcher(self.device, notify=False, device=device)
        self._patches.install(
            wrappers,
            in_c10d=[n for n in wrappers if getattr(distributed_c10d, n, None) is dist.__dict__[n]],
            batch=self._batch,
            coalescing=self._coalescing,
        )
        return self

    def set_step(self, step: int) -> None:
        """The training step now running (records carry it); also the agent's "step started"."""
        self.step = step
        mono, wall = time.monotonic(), time.time()
        self._wall_offset = wall - mono  # follows clock adjustments, once a step
        struct.pack_into(_STEP, self._mm, OFF_STEP, step, mono, wall)

    def set_section(self, name: str) -> None:
        """The phase the worker is in: "init", "step", "checkpoint", "done" (at most 16 bytes)."""
        self._mm[OFF_SECTION : OFF_SECTION + 16] = name.encode()[:16].ljust(16, b"\0")

    def uninstall(self) -> None:
        self.active = False
        self._patches.restore()

    def close(self) -> None:
        """Stop recording and unmap; the file keeps the last state. Idempotent."""
        if self._mm.closed:
            return
        self.uninstall()
        self._watcher.stop()
        self.set_section("done")
        with self._lock:  # not under a completion write of another thread
            self._mm.close()

    # -- records ---------------------------------------------------------------------------------

    def enter(
        self,
        kind: int,
        group: Channel,
        nbytes: int,
        flags: int,
        peer: int = NO_PEER,
        count: int = 1,
        now: float | None = None,
    ) -> int:
        """Write the record of an op being entered (at ``now``, monotonic seconds, default the
        current time); returns its index for ``mark``."""
        if now is None:
            now = _monotonic()
        mm, lock = self._mm, self._lock
        lock.acquire()  # not `with`: twice the cost on Python 3.11
        try:
            index = self._next
            self._next = index + 1
            group.seq = seq = group.seq + 1
            _pack_record(
                mm, self._ring + (index % self.capacity) * _RECORD_SIZE,
                index, seq, group.gid, nbytes, self.step, now, now + self._wall_offset, 0.0,
                peer, kind, _ENTERED, flags, count, 0, 0.0, 0.0,
            )  # fmt: skip
            if group.offset >= 0:
                _pack_u64(mm, group.offset + 8, seq)
            _pack_u64(mm, OFF_WRITE_INDEX, index + 1)
        finally:
            lock.release()
        return index

    def mark(self, indices: Iterable[int], state: OpState | int, now: float | None = None) -> None:
        """Set the state of records (WAITING, or LEFT/FAILED with the leave time ``now``, default
        the current time)."""
        if now is None:
            now = _monotonic()
        waiting = state == _WAITING
        mm, lock = self._mm, self._lock
        lock.acquire()
        try:
            if mm.closed:
                return  # closed: records of ops still in flight keep their state
            capacity = self.capacity
            oldest = self._next - capacity
            for index in indices:
                if index < oldest:
                    continue  # overwritten by newer records
                slot = index % capacity
                offset = self._ring + slot * _RECORD_SIZE
                if waiting:
                    self._wait_mono[slot] = now
                else:
                    _pack_f64(mm, offset + OFF_LEAVE, now)
                mm[offset + OFF_STATE] = state
        finally:
            lock.release()

    def leave(self, index: int, now: float | None = None) -> None:
        """``mark((index,), OpState.LEFT, now)``, the common case, faster.

        Still under the lock, although only the thread that entered the op leaves it: without it,
        the ring could wrap onto the slot between the age check and the writes (another thread
        entering ``capacity`` ops meanwhile), and ``copy`` could see the leave time without the
        state. The lock costs ~0.1 us."""
        if now is None:
            now = _monotonic()
        mm, lock = self._mm, self._lock
        lock.acquire()
        try:
            if mm.closed or index < self._next - self.capacity:
                return
            offset = self._ring + (index % self.capacity) * _RECORD_SIZE
            _pack_f64(mm, offset + OFF_LEAVE, now)
            mm[offset + OFF_STATE] = _LEFT
        finally:
            lock.release()

    # -- completion, as the device sees it --------------------------------------------------------

    def start_event(self):
        """On CUDA, a pooled timing event recorded now on the current stream, before the op the
        caller issues next (the start of its ``DeviceSpan``); None elsewhere. No sync."""
        if not self._cuda:
            return None
        event = self._events.get()
        event.record()
        return event

    def track(self, index: int, result: object, key: object = None, start=None) -> None:
        """Follow record ``index``'s op to completion where it runs: ``result`` is what the host
        call returned (a work handle, or None for a synchronous call). The NCCL-like mode's
        ``CommOp`` tells when it started and completed; on CUDA a ``DeviceSpan`` (the start event,
        and a done event recorded now after a synchronous call, or the op's NCCL ``Work``) tells
        both; a torch ``Work`` alone only when it completed. Nothing to follow in the blocking gloo
        mode's synchronous calls (the host call was the op). ``key``: the ops tracked with one
        key complete in issue order (a group's collectives), None: no order is known (p2p).
        ``start``: on CUDA, the event ``start_event`` recorded before the op (the op then gets
        its device start and an exactly timed duration)."""
        if not self.follow_device:
            if start is not None:
                self._events.put(start)
            return
        tracker = result if hasattr(result, "is_completed") else None
        if tracker is None and result is None:
            tracker = self._completion_of_sync(start)
        elif tracker is not None and start is not None:  # a NCCL Work: its start from the event
            tracker = DeviceSpan(start, tracker, self._events)
        elif start is not None:
            self._events.put(start)  # nothing to follow
        if tracker is None:
            return
        # it tells when it started (read without querying a CUDA event on the hot path)
        queued = isinstance(tracker, DeviceSpan) or getattr(tracker, "started", None) is not None
        self.device(index, DeviceState.QUEUED if queued else DeviceState.STARTED)
        self._watcher.add(index, tracker, queued, key)

    def device(self, index: int, state: DeviceState, start: float = 0.0, done: float = 0.0):
        """Write record ``index``'s device state (and its start / completion time, if given).
        States only move forward: a write that would move one back (a late or repeated
        notification racing with a newer one), or past completed / failed, is ignored. Called
        from the host, the watcher thread and the threads that complete ops."""
        with self._lock:
            if self._mm.closed or index < self._next - self.capacity:
                return
            offset = self._ring + (index % self.capacity) * _RECORD_SIZE
            now = _U32.unpack_from(self._mm, offset + OFF_DEVICE)[0]
            if now >= _COMPLETED or state < now:
                return
            if start:
                _pack_f64(self._mm, offset + OFF_START, start)
            if done:
                _pack_f64(self._mm, offset + OFF_DONE, done)
            _U32.pack_into(self._mm, offset + OFF_DEVICE, int(state))

    def _completion_of_sync(self, start=None):
        from megascale.parallel import async_comm  # no cycle: async_comm does not import us

        engine = async_comm.installed()
        if engine is not None:
            return engine.last_op()  # the op the call just queued
        if self._cuda:
            done = self._events.get()
            done.record()  # after the op on the current stream
            return DeviceSpan(start, done, self._events)
        return None

    def copy(self, first: int, end: int) -> RingCopy:
        """Records ``first`` .. ``end - 1`` as they are now, less those already overwritten (all of
        them once the recorder is closed): one memory copy, for a reader in this process (the
        timeline takes each step's records at the step boundary)."""
        with self._lock:
            end = min(end, self._next)
            first = max(first, end - self.capacity, 0)
            if self._mm.closed or first >= end:
                return RingCopy(end, b"", array("d"))
            a, b = first % self.capacity, (end - 1) % self.capacity + 1
            size, ring = RECORD.size, self._ring
            if a < b:
                data = self._mm[ring + a * size : ring + b * size]
                waits = self._wait_mono[a:b]
            else:  # wrapped around the end of the ring
                data = self._mm[ring + a * size : ring + self.capacity * size]
                data += self._mm[ring : ring + b * size]
                waits = self._wait_mono[a:] + self._wait_mono[:b]
        return RingCopy(first, data, waits)

    def group(self, pg) -> Channel | None:
        """The entry of process group ``pg`` (None: the default group), registered on first use;
        None when this rank is not a member."""
        pg = distributed_c10d.GroupMember.WORLD if pg is None else pg
        found = self._groups.get(pg, False)
        if found is False:
            found = self._groups[pg] = self._register(pg, None)
        return found

    def pair(self, pg, peer: int | None) -> Channel | None:
        """The entry of the p2p channel between this rank and global rank ``peer`` on ``pg``."""
        pg = distributed_c10d.GroupMember.WORLD if pg is None else pg
        key = (pg, peer)
        found = self._groups.get(key, False)
        if found is False:
            found = self._groups[key] = self._register(pg, peer)
        return found

    def _register(self, pg, peer: int | None) -> Channel | None:
        if pg is distributed_c10d.GroupMember.NON_GROUP_MEMBER:
            return None
        members = tuple(dist.get_process_group_ranks(pg))
        desc = getattr(pg, "group_desc", "") or ""
        if peer is None:
            ranks, label, what = members, desc, "group"
        else:  # any-source receives (peer unknown) get a channel of their own that matches no one
            ranks = tuple(sorted({self.rank, peer})) if peer >= 0 else (self.rank,)
            label, what = f"p2p {desc}", "p2p"
        gid = _group_id(what, pg.group_name, ranks)
        channel = self.add_group(gid, ranks, label, p2p=peer is not None)
        channel.kind = group_kind(desc)
        self._channels.append(channel)
        return channel

    def add_group(
        self, gid: int, ranks: tuple[int, ...], label: str, *, p2p: bool = False
    ) -> Channel:
        """Append a group to the file's group table; returns the handle ``enter`` takes."""
        runs = runs_of(ranks)
        size = -(-(GROUP_HEAD.size + RUN.size * len(runs)) // 8) * 8
        with self._lock:
            if self._groups_used + size > self._table_bytes:
                if not self._table_full_warned:
                    logger.warning(
                        "flight recorder: group table full (%d bytes)", self._table_bytes
                    )
                    self._table_full_warned = True
                return Channel(gid, -1)
            offset = HEADER.size + self._groups_used
            label_bytes = label.encode()[:32]
            GROUP_HEAD.pack_into(
                self._mm, offset, gid, 0, len(ranks), len(runs), p2p, 0, label_bytes
            )
            for i, run in enumerate(runs):
                RUN.pack_into(self._mm, offset + GROUP_HEAD.size + i * RUN.size, *run)
            self._groups_used += size
            _U64.pack_into(self._mm, OFF_GROUPS_USED, self._groups_used)
        return Channel(gid, offset)

    # -- batch and coalescing wrappers (``flight.hooks``) ----------------------------------------

    def _batch(self, original: Callable) -> Callable:
        return batch_wrapper(self, original)

    def _coalescing(self, original: Callable) -> Callable:
        return coalescing_wrapper(self, original)


class NullFlightRecorder:
    """The recorder when disabled: same methods, no file, nothing patched."""

    path = None
    blocked_s = 0.0

    def blocked_by_group(self) -> dict[str, float]:
        return {}

    def install(self) -> NullFlightRecorder:
        return self

    def set_step(self, step: int) -> None:
        pass

    def set_section(self, name: str) -> None:
        pass

    def uninstall(self) -> None:
        pass

    def close(self) -> None:
        pass


def installed_recorder() -> FlightRecorder | None:
    """The active recorder whose wrapper stands in front of ``torch.distributed.all_reduce``
    (anywhere in a chain of stacked wrappers), or None: read from what is patched, so it is the
    recorder that sees this process's calls now."""
    fn = dist.all_reduce
    while isinstance(fn, CommWrapper):
        if isinstance(fn, _OpWrapper) and fn.recorder.active:
            return fn.recorder
        fn = fn.original
    return None


def _map(path: Path | None, size: int) -> mmap.mmap:
    """``size`` zeroed bytes: a temporary file next to ``path`` mapped (renamed onto ``path`` once
    its header is written), or anonymous memory when ``path`` is None."""
    if path is None:
        return mmap.mmap(-1, size)
    runfiles.make_dir(path.parent)
    with runfiles.open_new(_tmp_path(path)) as f:
        f.truncate(size)
        return mmap.mmap(f.fileno(), size)


def _tmp_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


def _group_id(what: str, name: str, ranks: tuple[int, ...]) -> int:
    digest = hashlib.blake2b(f"{what}|{name}|{ranks}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _proc_start(pid: int) -> int:
    """Field 22 (starttime) of /proc/<pid>/stat, or 0 where there is no /proc."""
    fields = proc_stat(pid)
    return int(fields[19]) if fields else 0


def open_recorder(
    run_dir: Path | str,
    rank: int,
    world_size: int,
    *,
    enabled: bool = True,
    capacity: int = DEFAULT_CAPACITY,
) -> FlightRecorder | NullFlightRecorder:
    """This rank's recorder at ``flight_path(run_dir, rank)``, installed; a null one if disabled."""
    if not enabled:
        return NullFlightRecorder()
    recorder = FlightRecorder(flight_path(run_dir, rank), rank, world_size, capacity=capacity)
    return recorder.install()
