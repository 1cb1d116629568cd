"""The flight-recorder file: its byte layout and the reader.

No torch here: the node agent and the controller import this module; only the worker imports the
writer (``megascale.probes.flight.recorder``). The stall analysis over what it reads is in
``megascale.probes.flight.culprits``.

Each rank keeps ``RUN_DIR/flight/rank_NNNNN.bin`` (``flight_path``), a memory-mapped file of fixed
layout, so an outside process reads it with no cooperation from the worker: while it runs, while it
is stopped (SIGSTOP), hung in a collective, or after it died.

Layout (little-endian, version 2; offsets in bytes)::

  header, 128 bytes
    0  8s  magic b"MSFLIGHT"          48 f64 created (wall clock)
    8  u32 version = 2                56 u64 write_index: records ever written; the newest is
   12  u32 header_bytes = 128                write_index-1, in slot (write_index-1) % capacity.
   16  u32 record_bytes = 96                 Bumped after the record is written.
   20  u32 capacity (ring slots)      64 u64 groups_used: bytes of the group table in use
   24  u32 group_table_bytes          72 i64 step: the training step in progress (0: init)
   28  i32 rank                       80 f64 step_mono: when step was set (CLOCK_MONOTONIC)
   32  i32 world_size                 88 f64 step_wall: the same, wall clock
   36  i32 pid                        96 16s section: "init", "step", "checkpoint", "done"
   40  u64 proc_start: field 22 of /proc/<pid>/stat (0: unknown), tells a reused pid apart
  112  16  reserved (zero)
  group table: group_table_bytes at offset 128; entries appended, each padded to 8 bytes
    0  u64 gid: the group's id, equal on every member (hash of torch's group name and ranks)
    8  u64 last_seq: the last sequence number this rank entered on the group (0: none)
   16  u32 nranks   20 u16 nruns   22 u8 p2p (1: the channel between a pair of ranks)
   23  u8  reserved
   24  32s label: torch's group_desc (e.g. "TENSOR_MODEL_PARALLEL_GROUP"); p2p: "p2p " + that
   56  nruns x (u32 start, i32 stride, u32 count): the members' global ranks in group order
  ring: capacity x 96-byte records at offset 128 + group_table_bytes
    0  u64 index: the record's number; its slot is index % capacity. A reader skips a slot
              whose index is not the one it expects (overwritten while it read).
    8  u64 seq: per group (p2p: per pair on a group) 1, 2, ...; every member numbers a call alike
   16  u64 gid       24 u64 nbytes: the payload (all-gather: output, reduce-scatter: input)
   32  i64 step      40 f64 enter_mono
   48  f64 enter_wall: enter_mono + (wall - monotonic clock) as of the last set_step
   56  f64 leave_mono: 0 until the state is LEFT or FAILED; written before the state
   64  u32 peer: p2p: the peer's global rank; 0xFFFFFFFF otherwise
   68  u16 kind (OpKind)   70 u8 state (OpState; written last)
   71  u8  flags: ASYNC 1, COALESCED 2 (a megatron-core coalescing block), P2P 4, BATCH 8
   72  u32 count: ops in the record (> 1 for a coalescing block)
   76  u32 device (DeviceState): the op as its device / communication thread sees it, written by
              the recorder's watcher thread; 0 where completion is not tracked (blocking gloo)
   80  f64 start_mono: when the op started on the device (0: not seen)
   88  f64 done_mono: when it completed or failed there (0: not yet)

Monotonic times are CLOCK_MONOTONIC seconds, comparable with ``time.monotonic()`` in any process on
the same host; wall times compare across hosts. A rank is blocked in an op that is ENTERED and
synchronous, or WAITING; an asynchronous op stays ENTERED until its handle's ``wait()`` is called,
and forever if nobody waits (megatron-core drops some p2p send handles): in flight, not blocking.
The writer creates the file under a temporary name and renames it into place, so a reader never
sees a half-written header.

Reading: ``last_state(path) -> RankState`` (what the agent sends in its heartbeat, through
``RankState.to_json``); ``read_records(path)`` (the ring, oldest first); ``read_flight(path)`` (all
of it). A file that is not a flight file, or is truncated, raises ``FlightFileError``.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAGIC = b"MSFLIGHT"
VERSION = 2
HEADER = struct.Struct("<8sIIIIIiiiQdQQqdd16s16x")
RECORD = struct.Struct("<QQQQqdddIHBBIIdd")
GROUP_HEAD = struct.Struct("<QQIHBB32s")
RUN = struct.Struct("<IiI")
OFF_WRITE_INDEX, OFF_GROUPS_USED, OFF_STEP, OFF_SECTION = 56, 64, 72, 96
OFF_LEAVE, OFF_STATE, OFF_DEVICE, OFF_START, OFF_DONE = 56, 70, 76, 80, 88  # within a record
NO_PEER = 0xFFFFFFFF
ASYNC, COALESCED, P2P, BATCH = 1, 2, 4, 8
STOPPED = ("T", "t")  # /proc states of a stopped (SIGSTOP) or traced process


class OpKind(enum.IntEnum):
    ALL_REDUCE = 1
    ALL_GATHER = 2
    ALL_GATHER_INTO_TENSOR = 3
    REDUCE_SCATTER = 4
    REDUCE_SCATTER_TENSOR = 5
    BROADCAST = 6
    REDUCE = 7
    ALL_TO_ALL = 8
    ALL_TO_ALL_SINGLE = 9
    GATHER = 10
    SCATTER = 11
    BARRIER = 12
    SEND = 13
    RECV = 14
    ISEND = 15
    IRECV = 16


class OpState(enum.IntEnum):
    ENTERED = 1  # issued: a synchronous op is still running, an asynchronous one not waited on
    WAITING = 2  # an asynchronous op whose handle's wait() was called and has not returned
    LEFT = 3
    FAILED = 4  # the call or its wait() raised


class DeviceState(enum.IntEnum):
    """An op as its device (CUDA stream, the NCCL-like mode's communication thread) sees it."""

    UNTRACKED = 0  # the host call is the op (blocking gloo): the host state says it all
    QUEUED = 1  # enqueued, not started: behind earlier work on its stream, or a dead link
    STARTED = 2  # running: waits for its peers
    COMPLETED = 3
    FAILED = 4


class FlightFileError(ValueError):
    """A file that is not a readable flight-recorder file (wrong magic, version, size)."""


def flight_path(run_dir: Path | str, rank: int) -> Path:
    """Where rank ``rank`` of the run in ``run_dir`` keeps its flight recorder."""
    return Path(run_dir) / "flight" / f"rank_{rank:05d}.bin"


@dataclass(frozen=True)
class OpRecord:
    """One collective or p2p op as the rank recorded it."""

    index: int
    seq: int
    group: int
    """The group's id (``GroupInfo.gid``)."""
    kind: OpKind
    state: OpState
    flags: int
    nbytes: int
    step: int
    enter_mono: float
    enter_wall: float
    leave_mono: float | None
    peer: int | None
    count: int
    device: DeviceState = DeviceState.UNTRACKED
    start_mono: float | None = None
    done_mono: float | None = None

    @property
    def started(self) -> bool:
        """The op has started where it runs (untracked: once the host entered it)."""
        return self.device != DeviceState.QUEUED

    @property
    def left(self) -> bool:
        return self.state in (OpState.LEFT, OpState.FAILED)

    @property
    def is_async(self) -> bool:
        return bool(self.flags & ASYNC)

    @property
    def blocking(self) -> bool:
        """The rank waits in this op: its device started it and it has not completed (NCCL-like),
        or the host is in it: a synchronous one not left, or in its wait()."""
        if self.device == DeviceState.STARTED:
            return True
        if self.device in (DeviceState.COMPLETED, DeviceState.FAILED):
            return False
        return self.state == OpState.WAITING or (
            self.state == OpState.ENTERED and not self.is_async
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "seq": self.seq,
            "group": f"{self.group:016x}",
            "kind": self.kind.name.lower(),
            "state": self.state.name.lower(),
            "flags": self.flags,
            "nbytes": self.nbytes,
            "step": self.step,
            "enter_mono": self.enter_mono,
            "enter_wall": self.enter_wall,
            "leave_mono": self.leave_mono,
            "peer": self.peer,
            "count": self.count,
            "device": self.device.name.lower(),
            "start_mono": self.start_mono,
            "done_mono": self.done_mono,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> OpRecord:
        return cls(
            index=int(d["index"]),
            seq=int(d["seq"]),
            group=int(d["group"], 16),
            kind=OpKind[str(d["kind"]).upper()],
            state=OpState[str(d["state"]).upper()],
            flags=int(d["flags"]),
            nbytes=int(d["nbytes"]),
            step=int(d["step"]),
            enter_mono=float(d["enter_mono"]),
            enter_wall=float(d["enter_wall"]),
            leave_mono=None if d.get("leave_mono") is None else float(d["leave_mono"]),
            peer=None if d.get("peer") is None else int(d["peer"]),
            count=int(d.get("count", 1)),
            device=DeviceState[str(d.get("device", "untracked")).upper()],
            start_mono=None if d.get("start_mono") is None else float(d["start_mono"]),
            done_mono=None if d.get("done_mono") is None else float(d["done_mono"]),
        )


@dataclass(frozen=True)
class GroupInfo:
    """A process group (or p2p channel) the rank has issued ops on."""

    gid: int
    label: str
    ranks: tuple[int, ...]
    """Global ranks, in group order."""
    last_seq: int
    """The last sequence number this rank entered on the group."""
    p2p: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "runs": [list(run) for run in runs_of(self.ranks)],
            "last_seq": self.last_seq,
            "p2p": self.p2p,
        }

    @classmethod
    def from_json(cls, gid: str, d: Mapping[str, Any]) -> GroupInfo:
        ranks = tuple(r for run in d["runs"] for r in _expand(*run))
        return cls(int(gid, 16), str(d["label"]), ranks, int(d["last_seq"]), bool(d["p2p"]))


@dataclass(frozen=True)
class FlightHeader:
    rank: int
    world_size: int
    pid: int
    proc_start: int
    created_wall: float
    capacity: int
    write_index: int
    step: int
    step_mono: float
    step_wall: float
    section: str


@dataclass(frozen=True)
class Flight:
    """Everything in one flight file."""

    header: FlightHeader
    groups: dict[int, GroupInfo]
    records: list[OpRecord]
    """Oldest first; at most ``capacity``, the newest ones."""


_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ+/"
_UNKNOWN = "."


@dataclass(frozen=True)
class GroupHistory:
    """A rank's collectives on one group, compactly: ``ops`` holds one character per sequence
    number from ``first`` on, the index (``_ALPHABET``) of its (op, bytes) in ``shapes``
    ("." unknown: not in the ring, or a 65th shape); ``steps``: (step, its first seq here)."""

    first: int
    shapes: tuple[tuple[str, int], ...]
    ops: str
    steps: tuple[tuple[int, int], ...]

    def at(self, seq: int) -> tuple[str, int] | None:
        """(op, bytes) of collective ``seq``, if known."""
        i = seq - self.first
        if not 0 <= i < len(self.ops) or self.ops[i] == _UNKNOWN:
            return None
        return self.shapes[_ALPHABET.index(self.ops[i])]

    def step_of(self, seq: int) -> int | None:
        """The step collective ``seq`` was issued in, if known."""
        if not self.first <= seq < self.first + len(self.ops):
            return None
        return next((step for step, start in reversed(self.steps) if start <= seq), None)

    def to_json(self) -> dict[str, Any]:
        return {"first": self.first, "shapes": [list(s) for s in self.shapes], "ops": self.ops,
                "steps": [list(s) for s in self.steps]}  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GroupHistory:
        return cls(
            int(d["first"]),
            tuple((str(k), int(n)) for k, n in d["shapes"]),
            str(d["ops"]),
            tuple((int(t), int(q)) for t, q in d["steps"]),
        )


@dataclass(frozen=True)
class RankState:
    """What a rank's flight file says about it now; the input of ``stall_suspects``."""

    rank: int
    world_size: int
    pid: int
    step: int
    section: str
    last: OpRecord | None
    """The op last entered (None before the first)."""
    blocked: tuple[OpRecord, ...]
    """The ops the rank is blocked in now: a synchronous op not left, or the ops of the handle
    whose wait() it is in. Empty when it is computing, stopped outside communication, or done."""
    groups: dict[int, GroupInfo] = field(default_factory=dict)
    last_activity_mono: float = 0.0
    last_activity_wall: float = 0.0
    """The latest of: last op entered or left, step started."""
    process: str | None = None
    """/proc state letter of the writer ("R", "S", "D", "T" stopped, "Z"); None when it is gone,
    the pid was reused, or the reader is on another host."""
    unstarted: frozenset[tuple[int, int]] = frozenset()
    """(group, seq) of the ops enqueued here that its device has not started (NCCL-like)."""
    history: dict[int, GroupHistory] = field(default_factory=dict)
    """Per group of two ranks, the collectives the ring still holds (``GroupHistory``): what
    the stall analysis compares a collective its two members disagree on with (replica groups,
    the group's previous step); a larger group has a majority and needs none. Carried only
    while the rank is blocked (a heartbeat of a rank that computes stays small)."""

    def started(self, gid: int, seq: int) -> bool:
        """Whether this rank's device started op ``seq`` on group ``gid`` (untracked: entered)."""
        return self.seq(gid) >= seq and (gid, seq) not in self.unstarted

    @property
    def last_left(self) -> bool:
        return self.last is None or self.last.left

    @property
    def stopped(self) -> bool:
        return self.process in STOPPED

    def seq(self, gid: int) -> int:
        """The last sequence number this rank entered on group ``gid`` (0: never)."""
        info = self.groups.get(gid)
        return info.last_seq if info is not None else 0

    def to_json(self) -> dict[str, Any]:
        """For a heartbeat. Also carries the keys ``controller.FlightRecord.from_json`` reads
        (seq, kind, left, group: the op blocked in, else the last one entered)."""
        summary = self.blocked[-1] if self.blocked else self.last
        info = self.groups.get(summary.group) if summary is not None else None
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": self.pid,
            "step": self.step,
            "section": self.section,
            "process": self.process,
            "last_activity_mono": self.last_activity_mono,
            "last_activity_wall": self.last_activity_wall,
            "last": self.last.to_json() if self.last is not None else None,
            "blocked": [op.to_json() for op in self.blocked],
            "groups": {f"{gid:016x}": g.to_json() for gid, g in self.groups.items()},
            "seq": summary.seq if summary is not None else 0,
            "kind": summary.kind.name.lower() if summary is not None else "",
            "left": not self.blocked,
            "group": list(info.ranks) if info is not None else None,
            "unstarted": [[f"{g:016x}", q] for g, q in sorted(self.unstarted)],
            "history": {f"{g:016x}": h.to_json() for g, h in self.history.items()},
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RankState:
        return cls(
            rank=int(d["rank"]),
            world_size=int(d["world_size"]),
            pid=int(d["pid"]),
            step=int(d["step"]),
            section=str(d["section"]),
            last=OpRecord.from_json(d["last"]) if d.get("last") else None,
            blocked=tuple(OpRecord.from_json(op) for op in d.get("blocked", ())),
            groups={
                int(gid, 16): GroupInfo.from_json(gid, g) for gid, g in d.get("groups", {}).items()
            },
            last_activity_mono=float(d.get("last_activity_mono", 0.0)),
            last_activity_wall=float(d.get("last_activity_wall", 0.0)),
            process=d.get("process"),
            unstarted=frozenset((int(g, 16), int(q)) for g, q in d.get("unstarted", ())),
            history={
                int(g, 16): GroupHistory.from_json(h) for g, h in d.get("history", {}).items()
            },
        )


# -- reading ---------------------------------------------------------------------------------------


def read_flight(path: Path | str) -> Flight:
    """Parse a flight file (a consistent snapshot when the writer is stopped or hung; while it
    runs, records being overwritten as we read are skipped)."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < HEADER.size:
        raise FlightFileError(
            f"{path}: {len(data)} bytes, shorter than the {HEADER.size}-byte flight-recorder "
            "header (truncated, or not a flight file)"
        )
    (magic, version, header_bytes, record_bytes, capacity, table_bytes, rank, world, pid,
     proc_start, created, write_index, groups_used, step, step_mono, step_wall,
     section) = HEADER.unpack_from(data)  # fmt: skip
    if magic != MAGIC:
        raise FlightFileError(f"{path}: magic {magic!r}, expected {MAGIC!r} (not a flight file)")
    if version != VERSION:
        raise FlightFileError(f"{path}: version {version}; this reader reads version {VERSION}")
    if (header_bytes, record_bytes) != (HEADER.size, RECORD.size) or capacity < 1:
        raise FlightFileError(
            f"{path}: header_bytes={header_bytes}, record_bytes={record_bytes}, "
            f"capacity={capacity}; expected {HEADER.size}, {RECORD.size}, >= 1 (corrupt header)"
        )
    expected = HEADER.size + table_bytes + capacity * RECORD.size
    if len(data) < expected:
        raise FlightFileError(
            f"{path}: {len(data)} bytes, but its header describes {expected} ({HEADER.size} "
            f"header + {table_bytes} group table + {capacity} x {RECORD.size} records): truncated"
        )
    if groups_used > table_bytes:
        raise FlightFileError(
            f"{path}: groups_used={groups_used} > group_table_bytes={table_bytes}"
        )
    header = FlightHeader(
        rank, world, pid, proc_start, created, capacity, write_index, step, step_mono, step_wall,
        section.rstrip(b"\0").decode(errors="replace"),
    )  # fmt: skip
    groups = _read_groups(path, data, groups_used)
    ring = HEADER.size + table_bytes
    records = []
    for index in range(max(0, write_index - capacity), write_index):
        fields = RECORD.unpack_from(data, ring + (index % capacity) * RECORD.size)
        if fields[0] != index:
            continue  # overwritten while we read, or never completed
        records.append(_record(path, fields))
    return Flight(header, groups, records)


def read_records(path: Path | str) -> list[OpRecord]:
    """The records in ``path``'s ring, oldest first."""
    return read_flight(path).records


def last_state(path: Path | str) -> RankState:
    """The state of the rank that writes ``path`` (see ``RankState``)."""
    flight = read_flight(path)
    header, records = flight.header, flight.records
    last = records[-1] if records else None
    blocked = tuple(r for r in records if r.blocking)
    activity = [(header.step_mono, header.step_wall)]
    if last is not None:
        activity.append((last.enter_mono, last.enter_wall))
        if last.leave_mono is not None:
            activity.append((last.leave_mono, last.enter_wall + last.leave_mono - last.enter_mono))
    mono, wall = max(activity)
    return RankState(
        rank=header.rank,
        world_size=header.world_size,
        pid=header.pid,
        step=header.step,
        section=header.section,
        last=last,
        blocked=blocked,
        groups=flight.groups,
        last_activity_mono=mono,
        last_activity_wall=wall,
        process=process_state(header.pid, header.proc_start),
        unstarted=frozenset(
            (r.group, r.seq) for r in records if r.device == DeviceState.QUEUED and not r.left
        ),
        history=_history(records, flight.groups) if blocked else {},
    )


def _history(records: list[OpRecord], groups: Mapping[int, GroupInfo]) -> dict[int, GroupHistory]:
    """``RankState.history`` from the ring (oldest first)."""
    by_group: dict[int, list[OpRecord]] = {}
    for r in records:
        info = groups.get(r.group)
        if not r.flags & P2P and info is not None and len(info.ranks) == 2:
            by_group.setdefault(r.group, []).append(r)
    out = {}
    for gid, ops in by_group.items():
        shapes: dict[tuple[str, int], int] = {}
        chars = [_UNKNOWN] * (ops[-1].seq - ops[0].seq + 1)
        steps: list[tuple[int, int]] = []
        for r in ops:
            index = shapes.setdefault((r.kind.name.lower(), r.nbytes), len(shapes))
            chars[r.seq - ops[0].seq] = _ALPHABET[index] if index < len(_ALPHABET) else _UNKNOWN
            if not steps or steps[-1][0] != r.step:
                steps.append((r.step, r.seq))
        out[gid] = GroupHistory(ops[0].seq, tuple(shapes)[: len(_ALPHABET)], "".join(chars),
                                tuple(steps))  # fmt: skip
    return out


def process_state(pid: int, proc_start: int = 0) -> str | None:
    """The /proc state letter of ``pid`` if it is still the process that started at
    ``proc_start`` (0: do not check); None when it is gone or unknown."""
    fields = proc_stat(pid)
    if fields is None or (proc_start and int(fields[19]) != proc_start):
        return None
    return fields[0]


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _read_groups(path: Path, data: bytes, used: int) -> dict[int, GroupInfo]:
    groups, offset, end = {}, HEADER.size, HEADER.size + used
    while offset < end:
        gid, last_seq, nranks, nruns, p2p, _, label = GROUP_HEAD.unpack_from(data, offset)
        size = -(-(GROUP_HEAD.size + RUN.size * nruns) // 8) * 8
        if offset + size > end:
            raise FlightFileError(f"{path}: group entry at byte {offset} runs past groups_used")
        runs = RUN.iter_unpack(
            data[offset + GROUP_HEAD.size : offset + GROUP_HEAD.size + RUN.size * nruns]
        )
        ranks = tuple(r for run in runs for r in _expand(*run))
        if len(ranks) != nranks:
            raise FlightFileError(
                f"{path}: group entry at byte {offset} has {len(ranks)} ranks in its runs, "
                f"nranks={nranks}"
            )
        label = label.rstrip(b"\0").decode(errors="replace")
        groups[gid] = GroupInfo(gid, label, ranks, last_seq, bool(p2p))
        offset += size
    return groups


def _record(path: Path, fields: tuple) -> OpRecord:
    (index, seq, gid, nbytes, step, enter_mono, enter_wall, leave_mono, peer, kind, state, flags,
     count, device, start_mono, done_mono) = fields  # fmt: skip
    try:
        kind, state, device = OpKind(kind), OpState(state), DeviceState(device)
    except ValueError as e:
        raise FlightFileError(f"{path}: record {index}: {e} (corrupt record)") from None
    left = state in (OpState.LEFT, OpState.FAILED)
    return OpRecord(
        index, seq, gid, kind, state, flags, nbytes, step, enter_mono, enter_wall,
        leave_mono if left else None, None if peer == NO_PEER else peer, count, device,
        start_mono or None, done_mono or None,
    )  # fmt: skip


def runs_of(ranks: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``ranks`` as (start, stride, count) runs: (0, 2, 4, 5) -> [(0, 2, 3), (5, 1, 1)]."""
    runs, i = [], 0
    while i < len(ranks):
        stride = ranks[i + 1] - ranks[i] if i + 1 < len(ranks) else 1
        j = i + 1
        while j < len(ranks) and ranks[j] - ranks[j - 1] == stride:
            j += 1
        runs.append((ranks[i], stride, j - i))
        i = j
    return runs


def _expand(start: int, stride: int, count: int) -> range:
    return range(start, start + stride * count, stride) if count else range(0)
