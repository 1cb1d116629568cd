"""When each collective and p2p call was issued and how long the caller was blocked in it, for the
timeline, at the lowest cost the hot path allows.

Two sources give the timeline (``megascale.diagnostics.timers``) the same records:

* ``FlightComm``: when the flight recorder (``megascale.robustness.flight_recorder``) is installed,
  as it is in training runs, its records already hold each op's issue and completion; the timeline
  copies each step's records from its ring at the step boundary and decodes them on the writer
  thread. Nothing more runs per call: one wrapper per call, the recorder's.
* ``CommTimer``: otherwise, a thin wrapper of its own in front of torch.distributed's collective
  and p2p functions, ``batch_isend_irecv`` and megatron-core's aliases and coalescing manager,
  through ``megascale.parallel.comm_hooks`` (the patching that the comm trace and the flight
  recorder share; they stack in any order): one or two microseconds per call on CPU
  (``benchmarks/timers.py --no-flight-recorder`` measures it).

``timeline_comm()`` picks one. A source's contract: ``count()`` is the index the next record will
get (it only grows; spans note it on entry and exit), ``take()`` hands over the records since the
last ``take`` as a chunk whose ``records()`` the writer thread calls, ``uninstall()`` stops it.
A record is ``(index, kind, coalesced, issued_ns, wait_start_ns, wait_end_ns)`` on the
``time.monotonic_ns`` clock (the flight recorder's):

* a synchronous call: blocked from issue until it returned;
* an asynchronous one (``isend``/``irecv``, ``async_op=True``, the ops of a batch, an asynchronous
  coalescing block): its first ``wait()`` gives the blocked interval; None if never waited on;
* a megatron-core coalescing block (one DP bucket): one record, ``coalesced`` true, ``kind`` that
  of the ops inside it; a block without ops has no record;
* from the flight recorder, an op whose start and completion where it runs were seen (the
  NCCL-like CPU mode's communication threads; not the blocking gloo mode, where the host call is
  the op, nor torch ``Work`` handles, whose start is not observable) carries two more fields,
  ``device_start_ns`` and ``device_done_ns`` (start <= done);
* ``kind`` is the operation's name as the flight recorder's ``OpKind`` spells it in lower case:
  ``_all_gather_base`` is ``all_gather_into_tensor``, ``_reduce_scatter_base`` is
  ``reduce_scatter_tensor``; each op of a ``batch_isend_irecv`` is an ``isend`` or ``irecv``.
"""

from __future__ import annotations

import contextlib
import inspect
import time

import torch.distributed as dist

from megascale.parallel.comm_hooks import COLLECTIVES, P2P_ASYNC, CommWrapper, Patches, Reentry
from megascale.robustness.flight_format import ASYNC, COALESCED, DeviceState, OpKind
from megascale.robustness.flight_recorder import FlightRecorder, RingCopy, installed_recorder

# A wrapped function's name -> the operation's name in records (the flight recorder's OpKind).
KIND_NAMES = {
    "_all_gather_base": "all_gather_into_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
}

_FLIGHT_KINDS = {int(kind): kind.name.lower() for kind in OpKind}
_COMPLETED = int(DeviceState.COMPLETED)


def timeline_comm() -> FlightComm | CommTimer:
    """The timeline's communication records: from the flight recorder when one is installed in
    this process (read with ``installed_recorder``), else from a ``CommTimer`` installed now."""
    recorder = installed_recorder()
    return FlightComm(recorder) if recorder is not None else CommTimer().install()


# --------------------------------------------------------------------------------------------------
# From the flight recorder's records
# --------------------------------------------------------------------------------------------------


class FlightComm:
    """The records of an installed flight recorder from now on. Costs nothing per call; ``take``
    copies the step's slice of the ring (one memory copy). A step that issued more ops than the
    ring holds keeps its newest ``capacity``; the recorder must stay open until the last
    ``take``."""

    def __init__(self, recorder: FlightRecorder) -> None:
        self.recorder = recorder
        self._taken = recorder.written

    def count(self) -> int:
        return self.recorder.written

    def take(self) -> _FlightChunk:
        end = self.recorder.written
        chunk = _FlightChunk(self.recorder.copy(self._taken, end))
        self._taken = end
        return chunk

    def uninstall(self) -> None:
        """Nothing to undo: the recorder is not the timeline's."""


class _FlightChunk:
    """A step's flight records, decoded into timeline records on the writer thread."""

    __slots__ = ("_copy",)

    def __init__(self, copy: RingCopy) -> None:
        self._copy = copy

    def __len__(self) -> int:
        return len(self._copy)

    def records(self) -> list[tuple]:
        out = []
        for expected, (fields, wait) in enumerate(self._copy.records(), self._copy.first):
            index, enter, leave, kind, flags = (
                fields[0],
                fields[5],
                fields[7],
                fields[9],
                fields[11],
            )
            device, start, done = fields[13], fields[14], fields[15]
            if index != expected:
                continue  # a slot overwritten before it was copied
            issued = round(enter * 1e9)
            wait_start = wait_end = None
            if leave:  # left (or failed): the caller's wait is over
                wait_end = round(leave * 1e9)
                waited = flags & ASYNC and wait >= enter  # else returned at once: synchronous
                wait_start = round(wait * 1e9) if waited else issued
            kind_name = _FLIGHT_KINDS.get(kind, "unknown")
            record = (index, kind_name, bool(flags & COALESCED), issued, wait_start, wait_end)
            if device == _COMPLETED and start and done >= start:  # ran where it was seen to
                record += (round(start * 1e9), round(done * 1e9))
            out.append(record)
        return out


# --------------------------------------------------------------------------------------------------
# Its own wrappers
# --------------------------------------------------------------------------------------------------


class _State(Reentry):
    """Per thread: inside a wrapped call (``inside``); the open coalescing block's record
    (``block``), whose ``kind`` the first op inside it sets."""

    block: list | None = None


class _Timed(CommWrapper):
    """The stand-in for one torch.distributed function. The hot path: a thread-local read, two
    clock reads and one record per call."""

    def __init__(self, name: str, original, timer: CommTimer) -> None:
        super().__init__(name, original)
        self.timer = timer
        self.kind = KIND_NAMES.get(name, name)
        self.always_async = name in P2P_ASYNC
        function = original
        while isinstance(function, CommWrapper):  # stacked on another patcher's wrapper
            function = function.original
        params = list(inspect.signature(function).parameters)
        self.async_at = params.index("async_op") if "async_op" in params else len(params)

    def __call__(self, *args, **kwargs):
        timer = self.timer
        state = timer.state
        if state.inside or not timer.installed:  # re-entered through torch, or retired
            return self.original(*args, **kwargs)
        block = state.block
        if block is not None:  # inside a coalescing block: the block's record times its ops
            if block[0] is None:
                block[0] = self.kind
            return self.original(*args, **kwargs)
        issued = time.monotonic_ns()
        state.inside = True
        try:
            result = self.original(*args, **kwargs)
        finally:
            state.inside = False
        if (
            self.always_async
            or kwargs.get("async_op")
            or (len(args) > self.async_at and args[self.async_at])
        ):
            record = [self.kind, False, issued, None, None]
            timer.events.append(record)
            return result if result is None else _TimedWork(result, (record,))
        timer.events.append((self.kind, False, issued, issued, time.monotonic_ns()))
        return result


class _TimedWork:
    """An asynchronous call's handle: its first ``wait()`` is the blocked interval of its
    records (several when one handle stands for a whole batch)."""

    __slots__ = ("_work", "_records")

    def __init__(self, work, records: tuple[list, ...]) -> None:
        self._work, self._records = work, records

    def wait(self, *args, **kwargs):
        start = time.monotonic_ns()
        result = self._work.wait(*args, **kwargs)
        end = time.monotonic_ns()
        for record in self._records:
            if record[3] is None:
                record[3], record[4] = start, end
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


class _CoalescedHandle(_TimedWork):
    """What megatron-core keeps from ``with _coalescing_manager(...) as cm`` (``cm.wait()``,
    ``cm.append``, ``cm.works``)."""

    __slots__ = ()

    def append(self, work) -> None:
        self._work.append(work)

    @property
    def works(self):
        return self._work.works


class CommTimer:
    """Records this process's communication calls into ``events`` while installed.

    Contract: ``install`` once megatron-core is imported; ``take`` hands over the records (once
    per step); ``uninstall`` restores torch.distributed (calls through a wrapper that another
    patcher still holds then pass straight through). ``events`` holds ``[kind, coalesced,
    issued_ns, wait_start_ns, wait_end_ns]``; an asynchronous call's record is there from its issue
    and gets its wait interval when its handle is waited on.
    """

    def __init__(self) -> None:
        self.events: list = []
        self.state = _State()
        self.installed = False
        self._taken = 0
        self._patches = Patches()

    def install(self) -> CommTimer:
        self.installed = True
        self._patches.install(
            {name: _Timed(name, getattr(dist, name), self) for name in COLLECTIVES},
            in_c10d=P2P_ASYNC,  # P2POp's identity check reads the c10d module's names
            batch=self._batch,
            coalescing=self._coalescing,
        )
        return self

    def uninstall(self) -> None:
        self.installed = False
        self._patches.restore()

    def count(self) -> int:
        return self._taken + len(self.events)

    def take(self) -> _TimerChunk:
        """The records since the last ``take``, oldest first."""
        events, self.events = self.events, []
        chunk = _TimerChunk(self._taken, events)
        self._taken += len(events)
        return chunk

    def _batch(self, original):
        timer = self

        def batch_isend_irecv(p2p_op_list):
            state = timer.state
            if state.inside or not timer.installed:
                return original(p2p_op_list)
            issued = time.monotonic_ns()
            records = tuple([_p2p_kind(op), False, issued, None, None] for op in p2p_op_list)
            timer.events.extend(records)
            state.inside = True  # the ops' own isend/irecv calls are these records
            try:
                works = original(p2p_op_list)
            finally:
                state.inside = False
            if len(works) == len(records):
                return [_TimedWork(w, (r,)) for w, r in zip(works, records, strict=True)]
            return [_TimedWork(w, records) for w in works]  # one handle for the batch (NCCL)

        return batch_isend_irecv

    def _coalescing(self, original):
        timer = self

        @contextlib.contextmanager
        def coalescing_manager(group=None, device=None, async_ops=False):
            state = timer.state
            if state.inside or state.block is not None or not timer.installed:
                with original(group, device, async_ops) as cm:
                    yield cm
                return
            record = [None, True, None, None, None]  # the first op inside sets its kind
            state.block = record
            try:
                with original(group, device, async_ops) as cm:
                    handle = _CoalescedHandle(cm, (record,))
                    yield handle
                    record[2] = time.monotonic_ns()  # the block's ops are issued on leaving it
            finally:
                state.block = None
            if record[0] is None:
                return  # no op inside: nothing was communicated
            if not async_ops:  # the original manager waited on leaving the block
                record[3], record[4] = record[2], time.monotonic_ns()
            timer.events.append(record)

        return coalescing_manager


class _TimerChunk:
    """``CommTimer`` records taken at a step boundary, the first with index ``first``;
    asynchronous ones may still be waited on until the writer reads them."""

    __slots__ = ("_first", "_events")

    def __init__(self, first: int, events: list) -> None:
        self._first, self._events = first, events

    def __len__(self) -> int:
        return len(self._events)

    def records(self) -> list[tuple]:
        return [(index, *e) for index, e in enumerate(self._events, self._first)]


def _p2p_kind(op) -> str:
    """``isend`` or ``irecv``: what a ``torch.distributed.P2POp`` does."""
    name = getattr(op.op, "name", None) or getattr(op.op, "__name__", "")
    return "isend" if name == "isend" else "irecv"
